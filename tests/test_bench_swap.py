"""tools/bench/swap: each engine in its own process, and `atom train` beside them.

    pytest tests/test_bench_swap.py

Timings are not asserted (machine noise); what is: both sides ran in processes of their
own, alternating, and the report carries the engines' ratio, the `atom train` ratio and
the traffic.
"""

from __future__ import annotations

import json
import os

import pytest

from tools.bench import swap as bench_swap


@pytest.mark.slow
def test_bench_swap_runs_each_side_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "bench.json"
    shape = ["model.n_layer=2", "model.d_model=64", "model.seq_len=32", "model.vocab_size=256"]
    argv = ["--rounds", "2", "--steps", "1", "--shapes", "2x2", "--recompute", "no",
            "--cli-rounds", "1", "--cli-steps", "2", "--json", str(out)]  # fmt: skip
    for kv in shape:
        argv += ["--set", kv]
    assert bench_swap.main(argv) == 0
    (r,) = json.loads(out.read_text())
    assert r["swapped_step_s"] > 0 and r["resident_step_s"] > 0
    assert len(r["ratio_spread"]) == 2 and r["ratio"] > 0 and r["cli_ratio"] > 0
    assert r["h2d_bytes_per_step"] >= r["h2d_min_bytes"] > 0
    assert r["d2h_copies_per_step"] >= 1
    assert "| 2 x 2 | no | unit |" in capsys.readouterr().out


def test_a_served_side_answers_in_json_lines(tmp_path):
    """The child protocol: ready, `run N` -> seconds per step, `stats`, `quit`."""
    from atom.config import load_config

    cfg = load_config(None, ["model.n_layer=2", "model.d_model=64", "model.seq_len=32",
                             "train.micro_batch=2"])  # fmt: skip
    side = bench_swap._Side("swapped", cfg, None)
    try:
        assert side.ready
        assert side.ask("run 1")["s_per_step"] > 0
        stats = side.ask("stats")
        assert stats["per_step"]["d2h_copies"] >= 1 and len(stats["min_traffic"]) == 2
        assert side.proc.pid != os.getpid()
    finally:
        side.close()
    assert side.proc.returncode == 0
