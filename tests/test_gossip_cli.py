"""The peers' command line: keygen, peers, and train's flags; bad input is one line, exit 2.

pytest tests/test_gossip_cli.py
"""

from __future__ import annotations

import time

import pytest

from atom.cli import main
from atom.gossip.status import write_status


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_keygen_writes_a_bundle_per_peer(tmp_path, capsys):
    code, out, _ = run(capsys, "keygen", str(tmp_path / "g"), "--peers", "alice,bob")
    assert code == 0 and "--group-key" in out
    for name in ("alice", "bob"):
        bundle = tmp_path / "g" / name
        assert (bundle / f"{name}.key_secret").exists()
        assert (bundle / "group.key_secret").exists()
        assert (bundle / f"{name}.key_secret").stat().st_mode & 0o077 == 0  # private
    code, _, err = run(capsys, "keygen", str(tmp_path / "g"), "--peers", "bob")
    assert code == 2 and err.count("\n") == 1 and "already exists" in err


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--listen", "tcp://0.0.0.0:5555"], "needs a group key"),
        # no --listen: a client; nobody at the member's address: one line in join_timeout
        (["--join", "tcp://127.0.0.1:1", "--set", "gossip.join_timeout_s=1"],
         "no group member answered"),
        (["--listen", "udp://x:1"], "tcp://HOST:PORT"),
        (["--listen", "tcp://127.0.0.1:0", "--group-key", "/no/such/dir"], "not a directory"),
        (["--listen", "tcp://127.0.0.1:0", "--resident"], "drop --resident"),
        (["--set", "gossip.codec=zip"], "fp32|bf16|int8"),
    ],
)
def test_bad_peer_flags_are_one_line(capsys, tmp_path, text_dataset, argv, needle):
    code, _, err = run(
        capsys, "train", "--set", f"train.data={text_dataset}", "--set", "model.n_layer=1",
        "--max-steps", "1", "--out", str(tmp_path / "run"), "--no-progress", *argv,
    )  # fmt: skip
    assert code == 2, err
    assert err.startswith("atom: error:") and err.count("\n") == 1 and needle in err


def test_peers_prints_the_group(tmp_path, capsys):
    write_status(
        tmp_path,
        {
            "id": "alice", "endpoint": "tcp://10.0.0.1:5555", "group": "key:abc", "step": 42,
            "strategy": "gossip", "selection": "flow", "codec": "fp32", "time": time.time(),
            "state": "running",
            "counters": {"exchange.ok": 7, "rejected.nonfinite": 1},
            "wire": {"steps": 40, "sent_per_step": 2.5e5, "received_per_step": 3e5,
                     "model_fp32_bytes": 1e6},
            "peers": [{"id": "bob", "status": "alive", "step": 40, "bw": 117e6, "rtt": 0.0004,
                       "last_exchange_s": 1.5, "exchanges": 7, "failures": 0,
                       "apart": 2.5e-5}],
        },
    )  # fmt: skip
    code, out, _ = run(capsys, "peers", str(tmp_path))
    assert code == 0
    assert "peer alice" in out and "step 42" in out and "rejected 1" in out
    assert "bob" in out and "936.0 Mb/s" in out and "1.5s ago" in out and "2.5e-05" in out
    assert "250.00 kB sent, 300.00 kB received per step over 40 steps (0.25x the fp32" in out
    code, _, err = run(capsys, "peers", str(tmp_path / "nothing"))
    assert code == 2 and "no gossip.json" in err
