"""The soak (tools/net/soak.py) in its short form, as CI runs it: a 5-peer group for two
minutes through one fault of every kind this machine can do (kills and restarts, a clean
stop, a pause, a full disk, a partition, a slow and a flapping link, a late joiner, a
peer leaving), every invariant holding. The hour-long run's report is in
docs/benchmarks.md.

pytest tests/test_soak.py
"""

from __future__ import annotations

import json

import pytest

from tools.net import soak_faults


def test_the_schedule_replays_and_has_every_kind():
    kinds, _ = soak_faults.usable_kinds(netns=True, root=True)
    a = soak_faults.schedule(7, 3600, kinds, 20.0, min_each=5)
    b = soak_faults.schedule(7, 3600, kinds, 20.0, min_each=5)
    assert [(f.at, f.kind, f.hold) for f in a] == [(f.at, f.kind, f.hold) for f in b]
    assert all(sum(f.kind == k for f in a) >= 5 for k in kinds)
    for f, g in zip(a, a[1:], strict=False):  # one at a time, each given time to recover
        assert f.ends + min(soak_faults.RECOVER_S, 1.0) <= g.at
    assert a[-1].ends < 3600 - 10
    with pytest.raises(ValueError, match="do not fit"):
        soak_faults.schedule(7, 60, kinds, 20.0, min_each=5)


def test_without_namespaces_the_network_faults_are_left_out():
    kinds, left = soak_faults.usable_kinds(netns=False, root=False)
    assert not set(kinds) & (soak_faults.NETWORK_KINDS | soak_faults.ROOT_KINDS)
    assert len(left) == len(soak_faults.NETWORK_KINDS | soak_faults.ROOT_KINDS)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_minute_soak_holds_every_invariant(tmp_path):
    from tools.net.soak import main

    code = main(["--minutes", "2", "--seed", "1", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    failed = [i for i in summary["invariants"] if not i["ok"]]
    assert code == 0 and not failed, (tmp_path / "report.md").read_text()
    done = [f for f in summary["faults"] if not f["detail"].startswith("skipped")]
    assert len(done) >= 8  # all 11 kinds as root (namespaces, tmpfs); 8 on loopback
