"""profiler/simulate.py's arithmetic and `atom simulate`'s command line (seconds, no
measuring: stated hardware and synthetic piece times only)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from atom.cli import main
from atom.config import Config, load_config
from atom.profiler.cost import Candidate
from atom.profiler.hardware import stated
from atom.profiler.simulate import (
    Links,
    Machine,
    Workload,
    allreduce_s,
    efficiency,
    exposed_allreduce_s,
    gpipe_time,
    simulate,
    simulate_pipeline,
    split_layers,
)
from atom.profiler.timing import PieceTimes


def test_allreduce_is_ring_volume_over_the_link():
    assert allreduce_s(1e6, 4, 1e6) == pytest.approx(1.5)  # 2 (N-1)/N of the buffer
    assert allreduce_s(1e6, 4, 1e6, latency_s=0.01) == pytest.approx(1.5 + 6 * 0.01)
    assert allreduce_s(1e6, 1, 1e6) == 0.0


def test_exposed_allreduce_hides_all_buckets_but_the_last_under_backward():
    assert exposed_allreduce_s(4.0, 10.0, 1) == 4.0  # one bucket: starts after backward
    assert exposed_allreduce_s(4.0, 10.0, 4) == 1.0  # long backward: only the last bucket
    assert exposed_allreduce_s(4.0, 2.0, 4) == pytest.approx(4.0 - 2.0 * 3 / 4)


@pytest.mark.parametrize("S,M", [(1, 1), (2, 3), (4, 8), (8, 32)])
def test_gpipe_with_free_links_is_fill_drain(S, M):
    f, b = 1.0, 2.0
    t = gpipe_time([f] * S, [b] * S, [0.0] * (S - 1), [0.0] * (S - 1), M)
    assert t == pytest.approx((M + S - 1) * (f + b))
    busy = M * (f + b)
    assert 1 - busy / t == pytest.approx((S - 1) / (M + S - 1))  # the GPipe bubble


def test_gpipe_event_order_by_hand():
    # stage0 fwd m0 [0,1], m1 [1,2]; link 0->1 carries m0 [1,4], m1 [4,7]
    # stage1 fwd m0 [4,5], m1 [7,8]; bwd m0 [8,10], m1 [10,12]; link 1->0 [10,13], [13,16]
    # stage0 bwd (after its sends, at 7) m0 [13,15], m1 [16,18]
    assert gpipe_time([1, 1], [2, 2], [3], [3], 2) == pytest.approx(18.0)


def test_gpipe_slow_links_bound_the_step():
    fast = gpipe_time([1] * 4, [2] * 4, [0.1] * 3, [0.1] * 3, 8)
    slow = gpipe_time([1] * 4, [2] * 4, [5.0] * 3, [5.0] * 3, 8)
    assert slow > fast
    assert slow >= 2 * 8 * 5.0  # every micro-batch crosses a link both ways, one at a time
    with pytest.raises(ValueError):
        gpipe_time([1, 1], [1], [0.0], [0.0], 2)


def test_efficiency_between_independent_runs_and_sync():
    assert efficiency(0, 4, 8.0) == pytest.approx(1.0)
    assert efficiency(1e12, 4, 8.0) == pytest.approx(0.25)
    assert efficiency(8.0, 4, 8.0) == pytest.approx((1 + 0.25) / 2)
    assert efficiency(5.0, 1, 8.0) == 1.0
    assert efficiency(3.0, 4, 8.0) > efficiency(30.0, 4, 8.0)


def test_split_layers_and_links_validation():
    assert split_layers(4, 4) == [1, 1, 1, 1]
    assert split_layers(6, 4) == [2, 2, 1, 1]
    assert split_layers(24, 8) == [3] * 8
    # a head worth two blocks: the last stage gets fewer blocks, the slowest stage is minimal
    balanced = split_layers(24, 8, block_s=1.0, last_s=2.0)
    assert sum(balanced) == 24 and balanced[-1] == 1
    assert max(c + (2.0 if i == 7 else 0) for i, c in enumerate(balanced)) == 4.0
    with pytest.raises(ValueError):
        split_layers(2, 3)
    with pytest.raises(ValueError):
        Links([[0, 10], [0, 0]])
    with pytest.raises(ValueError):
        Links([[0, 1, 1], [1, 0, 1]])
    links = Links([[0, 8, 16], [8, 0, 8], [16, 8, 0]])
    assert links.bps(0, 2) == 2e6 and links.slowest_bps() == 1e6


def _tiny() -> Config:
    return load_config(
        None,
        ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "model.seq_len=32",
         "model.tie_embeddings=false", "train.micro_batch=4", "swap.checkpoint=false"],
    )  # fmt: skip


def _machine(scale: float = 1.0) -> Machine:
    hw = stated("rtx3060")
    return Machine(hw, torch.bfloat16, lambda mb: PieceTimes(1e-3 * mb, 2e-3 * mb, 1e-3 * mb,
                                                             1e-4 * mb), scale)  # fmt: skip


def test_simulate_systems_respond_to_the_link_as_modelled():
    cfg = _tiny()
    plan = Candidate(1, 1, 4, 1, False, False)
    w = Workload(peers=4, peer_batch=4, chunks=8)
    m = _machine()
    slow = {p.system: p for p in simulate(cfg, m, Links.uniform(4, 1), w, plan)}
    fast = {p.system: p for p in simulate(cfg, m, Links.uniform(4, 10_000), w, plan)}
    # atom never waits for the network: same step, but less mixing on the slow link
    assert slow["atom"].step_s == fast["atom"].step_s
    assert slow["atom"].detail["tau_steps"] > fast["atom"].detail["tau_steps"]
    assert slow["atom"].efficiency < fast["atom"].efficiency <= 1.0
    assert slow["atom"].tokens_per_s == pytest.approx(4 * 4 * 32 / slow["atom"].step_s)
    # ddp = atom's per-peer step + the exposed all-reduce (one bucket for a tiny model)
    grads = slow["ddp"].detail["allreduce_s"]
    assert grads == pytest.approx(allreduce_s(
        sum(p.numel() for p in _params(cfg)) * 2, 4, 1e6 / 8))  # fmt: skip
    assert slow["ddp"].step_s == pytest.approx(slow["atom"].step_s + grads)
    # the pipeline slows on slow links and approaches its free-link schedule on fast ones
    assert slow["pipeline"].tokens_per_s < fast["pipeline"].tokens_per_s
    assert fast["pipeline"].comm_s < 0.05 * fast["pipeline"].step_s
    for p in fast.values():
        assert p.time_to(1e6) == pytest.approx(1e6 / (p.tokens_per_s * p.efficiency))
    # compute contention slows every system
    slower = {p.system: p for p in simulate(cfg, _machine(2.0), Links.uniform(4, 10_000), w, plan)}
    assert all(slower[k].step_s > fast[k].step_s for k in fast)


def test_simulate_models_the_outer_optimizers_schedule():
    cfg = _tiny()
    plan = Candidate(1, 1, 4, 1, False, False)
    m, fast = _machine(), Links.uniform(4, 10_000)
    runs = {}
    for strategy in ("gossip", "diloco", "noloco"):
        w = Workload(peers=4, peer_batch=4, chunks=8, strategy=strategy, inner_steps=40)
        runs[strategy] = next(p for p in simulate(cfg, m, fast, w, plan) if p.system == "atom")
    # a unit is due H steps after its last exchange, started or served: every H / 2 ln 2
    assert runs["diloco"].detail["tau_steps"] == pytest.approx(40 / (2 * math.log(2)))
    assert runs["gossip"].detail["tau_steps"] < runs["diloco"].detail["tau_steps"]
    assert runs["diloco"].sent_bytes_per_step < runs["gossip"].sent_bytes_per_step
    # noloco's exchange carries outer weights and pseudo-gradient: twice the bytes
    assert runs["noloco"].sent_bytes_per_step == pytest.approx(
        2 * runs["diloco"].sent_bytes_per_step)  # fmt: skip
    assert runs["diloco"].step_s == runs["gossip"].step_s  # never on the step's path


def _params(cfg: Config):
    from atom.model import build_model

    return list(build_model(cfg.model).parameters())


def test_pipeline_flags_stages_that_do_not_fit():
    cfg = load_config("gpt3-6.7b", ["model.seq_len=256"])
    m = _machine()
    p = simulate_pipeline(cfg, m, Links.uniform(2, 1000), Workload(2, 4, 4))
    assert not p.fits and "GiB" in p.note


def test_cli_tabulates_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    args = ["simulate", "--hardware", "rtx3060", "--peers", "4", "--link-mbps", "10", "1000",
            "--set", "model.tie_embeddings=false", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| atom |" in text and "| pipeline |" in text and "| ddp |" in text
    rows = json.loads(out.read_text())
    assert len(rows) == 6
    by = {(r["system"], r["link"]): r for r in rows}
    assert by[("pipeline", "10 Mb/s")]["vs_pipeline"] == 1.0
    assert by[("atom", "10 Mb/s")]["tokens_per_s"] == by[("atom", "1000 Mb/s")]["tokens_per_s"]
    for r in rows:
        assert math.isfinite(r["time_to_target_s"]) and r["time_to_target_s"] > 0


def test_cli_link_matrix_and_bad_input(tmp_path, capsys):
    good = tmp_path / "links.json"
    good.write_text(json.dumps([[0, 100, 5], [100, 0, 5], [5, 5, 0]]))
    assert main(["simulate", "--hardware", "rtx3060", "--peers", "3", "--links", str(good),
                 "--set", "model.tie_embeddings=false"]) == 0  # fmt: skip
    assert "| matrix |" in capsys.readouterr().out
    assert main(["simulate", "--hardware", "rtx3060", "--peers", "4", "--links", str(good)]) == 2
    assert "--links has 3 peers" in capsys.readouterr().err
    assert main(["simulate", "--hardware", "rtx3060", "--peers", "1"]) == 2


def test_cli_wide_puts_the_systems_side_by_side(capsys):
    args = ["simulate", "--hardware", "rtx4090", "--peers", "2", "--link-mbps", "100",
            "--set", "model.tie_embeddings=false", "--wide"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "| atom tokens/s | pipeline | ddp | atom / pipeline |" in out
    assert out.count("| tiny | RTX 4090 | 100 Mb/s |") == 1
