"""Helper threads keep their own OpenMP share and leave everyone else's alone.

pytest tests/test_threads.py
"""

from __future__ import annotations

import threading

import pytest
import torch

from atom.ground.threads import start_helper


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


# ------------------------------------------------ the CPU backend: host work on the compute thread


def _helper_names() -> set[str]:
    return {t.name for t in threading.enumerate()} & {"atom-h2d", "atom-host-opt"}


@pytest.mark.parametrize("helper_threads", [False, True])
def test_on_the_cpu_the_host_work_runs_where_the_compute_runs(helper_threads):
    """The CPU backend's "device" is the host's own cores: by default copies, landings and
    updates run on the thread that computes (a helper's OpenMP team would only fight the
    compute's for them), and no helper thread exists. helper_threads=True (tests of the
    concurrency CUDA relies on) brings both helpers back. The numbers are the same."""
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config
    from tests.test_swap_equivalence import batches_for, rel_err

    cfg = tiny_config(train={"grad_accum": 2})
    before = _helper_names()
    engine = SwapEngine(cfg, CpuBackend(helper_threads=helper_threads), torch.float32)
    where: set[str] = set()
    real_update = engine._update

    def update(u, coef, lr):
        where.add(threading.current_thread().name)
        return real_update(u, coef, lr)

    engine._update = update
    try:
        losses = [engine.train_step(batches_for(s, cfg), 1e-3).loss for s in range(3)]
        engine.wait_idle()
        started = _helper_names() - before
        params = engine.named_parameters()
    finally:
        engine.close()
    if helper_threads:
        assert started == {"atom-h2d", "atom-host-opt"} and where == {"atom-host-opt"}
    else:
        assert started == set() and where == {threading.current_thread().name}
    # the same training either way (the reference for both: tests/test_swap_equivalence.py);
    # not to the bit: a norm summed by a team of another size rounds differently
    other = SwapEngine(cfg, CpuBackend(helper_threads=not helper_threads), torch.float32)
    try:
        got = [other.train_step(batches_for(s, cfg), 1e-3).loss for s in range(3)]
        assert got == pytest.approx(losses, rel=1e-6)
        assert max(rel_err(v, params[k]) for k, v in other.named_parameters().items()) < 1e-6
    finally:
        other.close()


def test_an_inline_update_that_fails_ends_the_step_with_its_error_and_keeps_it():
    """Inline, a failing host job raises in the step that ran it, with its own error (as
    the worker thread's error surfaces), and stays raised: the next step and close say it
    again rather than train on half-updated units."""
    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config
    from tests.test_swap_equivalence import batches_for

    cfg = tiny_config(train={"grad_clip": 0.0})  # updates run as gradients land
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)

    def failing_update(u, coef, lr):
        raise OSError("planted: the optimizer step failed")

    engine._update = failing_update
    with pytest.raises(RuntimeError, match="planted") as err:
        engine.train_step(batches_for(0, cfg), 1e-3)
    assert isinstance(err.value.__cause__, OSError)
    assert not engine.committed
    with pytest.raises(RuntimeError, match="planted"):
        engine.train_step(batches_for(1, cfg), 1e-3)
    with pytest.raises(RuntimeError, match="planted"):
        engine.close()


def test_an_interrupt_inside_an_inline_update_leaves_no_unit_waiting():
    """Ctrl+C that reaches an inline update (a library caller without atom's handler)
    propagates as it is, and leaves no unit waiting for an update that will not come: a
    checkpoint (wait_idle) and the next step go on at once (they waited 10 minutes)."""
    import time

    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config
    from tests.test_swap_equivalence import batches_for

    cfg = tiny_config()
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    real, calls = engine._update, [0]

    def update(u, coef, lr):
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt
        return real(u, coef, lr)

    engine._update = update
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.train_step(batches_for(0, cfg), 1e-3)
        assert not engine.committed
        t0 = time.monotonic()
        engine.wait_idle()
        assert engine.train_step(batches_for(1, cfg), 1e-3).loss > 0
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()


def test_an_interrupt_inside_an_inline_copy_abandons_the_step_at_once():
    """Ctrl+C while the compute thread runs a unit's copy (or waits for a peer's merge to
    let go of the unit): the step is abandoned, its slots released without waiting for
    the cut copy (that release waited 10 minutes), and the next step trains."""
    import time

    from atom.swap.backend import CpuBackend
    from atom.swap.engine import SwapEngine
    from tests.conftest import tiny_config
    from tests.test_swap_equivalence import batches_for

    cfg = tiny_config()
    backend = CpuBackend()
    engine = SwapEngine(cfg, backend, torch.float32)
    real, calls = backend.h2d, [0]

    def h2d(dst, src, after, host_ready, locks=()):
        t = real(dst, src, after, host_ready, locks)
        calls[0] += 1
        if calls[0] == 3:
            def interrupted() -> None:
                raise KeyboardInterrupt

            t.job = interrupted
        return t

    backend.h2d = h2d
    try:
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            engine.train_step(batches_for(0, cfg), 1e-3)
        assert engine.train_step(batches_for(1, cfg), 1e-3).loss > 0
        assert time.monotonic() - t0 < 30
    finally:
        engine.close()
