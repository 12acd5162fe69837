"""tools/cpuload.py: benchmarks tell other users' CPU use from their own."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tools.cpuload import ForeignLoad

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/stat")


def test_a_process_that_is_not_ours_counts_as_foreign():
    # detached through a shell that exits at once: another user's process burning a core
    pid = int(subprocess.run(
        ["sh", "-c", '"$0" -c "$1" >/dev/null 2>&1 & echo $!', sys.executable, BURN.format(s=30)],
        check=True, capture_output=True, text=True, timeout=30,
    ).stdout)  # fmt: skip
    try:
        time.sleep(0.5)
        with ForeignLoad() as load:
            time.sleep(1.5)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert load.cpu_s >= 0.5, load.cpu_s  # ~1.5 s of one core
    assert 0.0 < load.share <= 1.0
    assert any("python" in name for name in load.top), load.top


def test_our_own_work_and_waited_children_are_not_foreign():
    with ForeignLoad(name_processes=False) as load:
        t = time.process_time()
        while time.process_time() - t < 0.7:  # this process burns 0.7 s
            pass
        subprocess.run([sys.executable, "-c", BURN.format(s=0.7)], check=True, timeout=60)
    # 1.4 s of CPU was ours; only interpreter start-up noise and other users may remain
    assert load.cpu_s < 0.5, load.cpu_s
