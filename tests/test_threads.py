"""Helper threads keep their own OpenMP share and leave everyone else's alone.

pytest tests/test_threads.py
"""

from __future__ import annotations

import threading

import torch

from atom.threads import start_helper


def _parallel_op() -> None:
    (torch.randn(1 << 20) * 2).sum()  # large enough for a parallel region


def test_a_helper_keeps_its_count_after_its_first_parallel_op_and_others_keep_theirs():
    """torch sets a thread's count up at its first parallel op from the process default;
    a helper that set its own before that op got the default back (full-size teams)."""
    default = torch.get_num_threads()
    seen = []

    def work() -> None:
        _parallel_op()
        seen.append(torch.get_num_threads())

    start_helper(work, "atom-test-helper", 1).join(timeout=30)
    later = []

    def plain() -> None:
        _parallel_op()
        later.append(torch.get_num_threads())

    t = threading.Thread(target=plain)
    t.start()
    t.join(timeout=30)
    assert seen == [1]
    assert torch.get_num_threads() == default and later == [default]
