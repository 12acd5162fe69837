"""Helper threads with their own share of the CPU's OpenMP threads.

Every thread that runs a torch op in parallel gets its own OpenMP team, sized by torch's
thread count. On a GPU the swap engine runs torch ops on three threads: the one that
launches the model's compute, the copy thread, and the host worker (landing gradients,
the optimizer step). Left alone, each helper gets a team as large as the compute thread's,
and the teams fight for the same cores: their spinning threads take the cores the compute
needs (a resident engine ran 1.4x slower on 2 cores while a swapped one merely existed in
the same process). So each helper is started with the count it needs. (On the CPU the
engine runs its host work on the compute thread instead: docs/architecture.md.)

`torch.set_num_threads` sets the calling thread's count and also the process default that
a thread picks up at its first parallel op; `start_helper` puts that default back, so
neither the compute thread nor threads started later (checkpoint writer, gossip) change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

_starting = threading.Lock()


def start_helper(target: Callable[[], None], name: str, threads: int) -> threading.Thread:
    """Start daemon thread `name` running `target` with `threads` OpenMP threads."""
    ready = threading.Event()

    def run() -> None:
        # torch sets a thread's count up at its first parallel op, from the process
        # default (put back below): trigger that first, or it would undo this
        torch.get_num_threads()
        torch.set_num_threads(max(1, threads))
        ready.set()
        target()

    with _starting:
        own = torch.get_num_threads()  # fixes this thread's own count before the helper runs
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        ready.wait(timeout=30)
        torch.set_num_threads(own)  # the process default, for threads started later
    return thread


def host_worker_threads(device_type: str) -> int:
    """The host worker's share. On a GPU the compute thread only launches kernels, but it
    must never wait for a core: the host optimizer gets all cores but one. On the CPU
    (a worker thread only with CpuBackend(helper_threads=True), for tests) one core's
    worth, leaving the rest to the compute's team."""
    if device_type == "cuda":  # torch's default: physical cores, not hyperthreads
        return max(1, torch.get_num_threads() - 1)
    return 1


# A token decoded at batch 1 is matrix-vector products over d_model x 4*d_model weights:
# below this many elements an OpenMP team's wake-ups cost more than its threads save (the
# 0.8M-parameter default model generated 11-37 tokens/s on every core of a loaded box,
# 478-501 on one thread).
SMALL_MATVEC = 1 << 20


@contextmanager
def decode_threads(d_model: int) -> Iterator[int]:
    """Run token-by-token decoding of a model `d_model` wide on the threads that suit it:
    one for a small model, torch's default otherwise. Yields the count; restores it."""
    before = torch.get_num_threads()
    use = 1 if 4 * d_model * d_model < SMALL_MATVEC else before
    torch.set_num_threads(use)
    try:
        yield use
    finally:
        torch.set_num_threads(before)
