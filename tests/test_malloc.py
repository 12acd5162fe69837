"""atom/swap/malloc.py: the CPU backend keeps per-visit gradient buffers in the heap."""

import subprocess
import sys

import pytest

from atom.swap import malloc

pytestmark = pytest.mark.skipif(
    malloc.mmapped_bytes() is None, reason="needs glibc with mallinfo2 (Linux)"
)

CHILD = """
import torch
from atom.swap import malloc
if {apply}:
    from atom.swap.backend import CpuBackend
    CpuBackend().close()
before = malloc.mmapped_bytes()
x = torch.zeros(4 * 2**20)  # 16 MiB, the size of a unit's gradient
print(malloc.mmapped_bytes() - before)
"""


def _mmapped_growth(apply: bool) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD.format(apply=apply)], check=True,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    return int(out.stdout.split()[-1])


def test_cpu_backend_serves_unit_sized_buffers_from_the_heap():
    assert _mmapped_growth(apply=False) >= 16 * 2**20  # glibc's default: a fresh mmap
    assert _mmapped_growth(apply=True) == 0  # kept in the heap, reused next visit


def test_applied_once_and_reported():
    assert malloc.keep_freed_blocks() is True
    assert malloc.keep_freed_blocks() is True
