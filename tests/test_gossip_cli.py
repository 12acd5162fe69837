"""The peers' command line: keygen, peers, and train's flags; bad input is one line, exit 2.

pytest tests/test_gossip_cli.py
"""

from __future__ import annotations

import json
import logging
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
         "nothing listens at tcp://127.0.0.1:1"),
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


def test_a_wrong_port_is_told_as_such_not_as_a_nat(capsys, tmp_path, text_dataset, caplog):
    """Issue 42: a --join to a port nothing listens on (connections refused, not dropped)
    used to end with advice on routers and NAT, after a goodbye to a group it never
    joined. It says, while waiting, that nothing listens there yet (the member may still
    be starting), and at the end that nothing listens there."""
    caplog.set_level(logging.INFO, logger="atom.gossip")
    code, _, err = run(
        capsys, "train", "--set", f"train.data={text_dataset}", "--set", "model.n_layer=1",
        "--max-steps", "1", "--out", str(tmp_path / "run"), "--no-progress",
        "--join", "tcp://127.0.0.1:1", "--set", "gossip.join_timeout_s=4",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "nothing listens at tcp://127.0.0.1:1" in err and "NAT" not in err
    lines = [r.getMessage() for r in caplog.records]
    assert any("nothing accepts connections at tcp://127.0.0.1:1 yet" in line
               for line in lines), lines  # fmt: skip
    assert not any("left the group" in line for line in lines), lines


def test_no_answer_from_a_live_port_still_names_the_firewall_and_nat():
    """A seed that accepts connections but never answers as a member (silence: a firewall,
    another program) keeps the NAT advice; refused everywhere is a wrong port."""
    import socket

    from atom.gossip.net.handshake import no_member_line, refused_everywhere

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: refused
        alive = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        dead = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        assert refused_everywhere([dead]) and not refused_everywhere([dead, alive])
        assert not refused_everywhere([])
    assert "NAT" in no_member_line([alive], 30, refused=False)
    assert "nothing listens" in no_member_line([dead], 30, refused=True)
    # refused elsewhere may be a router forwarding no port (tests/test_nat.py)
    far = no_member_line(["tcp://192.0.2.7:5555"], 30, refused=True)
    assert "nothing accepts connections" in far and "NAT" in far


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


def test_an_empty_set_value_is_the_empty_string():
    """`--set gossip.join=` said "gossip.join must be str, got None" though its default
    is ""; a key that also takes null (gossip.listen) keeps YAML's null."""
    from atom.run.run_config import load_run_config

    cfg = load_run_config(None, ["gossip.join=", "gossip.listen=", "gossip.name="])
    assert cfg.gossip.join == "" and cfg.gossip.listen is None and cfg.gossip.name == ""


@pytest.mark.multiprocess
def test_a_peers_run_continues_alone_with_one_flag(tmp_path, text_dataset, capsys):
    """issue 42: once its group was gone, `atom train --resume runs/bob` reused the saved
    --listen/--join, and after the join timeout said "start the first peer without
    --join", though none was typed; only two --set's nobody names worked. The failing
    join names --alone, and --alone continues the run without peers."""
    import sys

    from tests import gossip_util as gu

    sets = ["--set", f"train.data={text_dataset}", "--set", "model.n_layer=1", "--no-progress"]
    alice = gu.start([sys.executable, "-m", "atom.cli", "train", "--out", str(tmp_path / "a"),
                      "--listen", "tcp://127.0.0.1:0", "--max-steps", "100000", *sets],
                     tmp_path / "a.log")  # fmt: skip
    try:
        ep = gu.endpoint(tmp_path / "a", procs=[alice])
        bob = str(tmp_path / "b")
        code, _, err = run(capsys, "train", "--out", bob, "--listen", "tcp://127.0.0.1:0",
                           "--join", ep, "--set", "gossip.pull_state=false", "--max-steps",
                           "2", *sets)  # fmt: skip
        assert code == 0, err
    finally:
        alice.kill()
        alice.wait(30)
    code, out, err = run(capsys, "train", "--resume", bob, "--max-steps", "4", "--set",
                         "gossip.join_timeout_s=1", *sets)  # fmt: skip
    assert code == 2 and err.count("\n") == 1, err
    assert "nothing listens at" in err and "--alone" in err  # alice is gone
    assert "--alone continues it without peers" in out  # said before the wait
    code, out, err = run(capsys, "train", "--resume", bob, "--max-steps", "4", "--alone", *sets)
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4]
    code, _, err = run(capsys, "train", "--resume", bob, "--alone", "--join", ep, *sets)
    assert code == 2 and "--alone trains without peers" in err
