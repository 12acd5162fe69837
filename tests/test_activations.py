"""Where checkpointed unit inputs wait between forward and backward (atom/swap/
unit_passes.py): on the device, or in host memory (`swap.offload_activations`) except for
the last `swap.acts_on_card` block units, whose backward comes first.

    pytest tests/test_activations.py

Training is the same wherever the inputs wait (the CUDA backend's real offload and fetch,
run on the CPU through tests/fake_cuda.py); the memory ledger counts exactly the inputs
kept on the device, so keeping some there costs their bytes and no more; the host buffers
of the offloaded ones, and only those, are page-locked, and an abandoned step gives them
all back.
"""

from __future__ import annotations

import pytest
import torch

from atom.config import ConfigError
from atom.optim import lr_at
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.fake_cuda import cuda_backend
from tests.test_swap_equivalence import batches_for

STEPS = 2
N_LAYER = 3  # block units 1-3; the embedding is unit 0, the head unit 4
ACCUM = 2


def _config(order: str, offload: bool, on_card: int = 0):
    return tiny_config(
        model={"n_layer": N_LAYER},
        train={"grad_accum": ACCUM},
        swap={"checkpoint": True, "offload_activations": offload, "acts_on_card": on_card,
              "order": order},
    )  # fmt: skip


def _train(cfg, backend=None, sim=None, steps: int = STEPS):
    engine = SwapEngine(cfg, backend or CpuBackend(), torch.float32)
    try:
        losses = []
        for s in range(steps):
            if sim is not None:
                with sim.watch():
                    losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
            else:
                losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
        return losses, engine.named_parameters(), engine.ledger.peak, engine.backend.pinned_bytes
    finally:
        engine.close()


def _hidden_bytes(cfg) -> int:
    return cfg.train.micro_batch * cfg.model.seq_len * cfg.model.d_model * 4


@pytest.mark.parametrize("order", ["unit", "micro"])
def test_inputs_on_the_card_or_offloaded_train_bit_identically(monkeypatch, order):
    """The last block unit's inputs kept on the card and the others offloaded, against
    every input kept on the device (no offload), on the CUDA backend: inputs really go to
    page-locked host buffers and come back (the other counts: the ledger test below and
    tests/test_cuda_ordering.py). Compared on that backend: its host worker thread and
    the CPU backend's inline one differ bit-wise."""
    want = _train(_config(order, offload=False), *cuda_backend(monkeypatch, 1 << 16))
    hidden = _hidden_bytes(_config(order, offload=True))
    for on_card in (1,):
        backend, sim = cuda_backend(monkeypatch, 1 << 16)
        got = _train(_config(order, offload=True, on_card=on_card), backend, sim)
        assert sim.violations == []
        assert got[0] == want[0], on_card
        for name, p in want[1].items():
            assert torch.equal(got[1][name], p), (on_card, name)
        # only the offloaded inputs take host buffers (each page-aligned): unit-major
        # keeps every micro-batch's in flight, micro-batch-major one micro-batch's
        offloaded = (N_LAYER - on_card) * (ACCUM if order == "unit" else 1)
        grown = got[3] - want[3]
        assert offloaded * hidden <= grown <= offloaded * (hidden + 4096), on_card


def test_the_ledger_counts_exactly_the_inputs_kept_on_the_card():
    """Unit-major: every micro-batch's input of every block unit is alive at the turn.
    Once that is the peak (a unit's backward, with its recompute and gradients, is the
    peak while few are kept), each more block unit kept on the card adds its ACCUM inputs
    to it; all of them kept there is the peak without offload, and offloading lowers it."""
    peaks = [_train(_config("unit", True, k), steps=1)[2] for k in range(N_LAYER + 1)]
    plain = _train(_config("unit", offload=False), steps=1)[2]
    per_unit = ACCUM * _hidden_bytes(_config("unit", True))
    assert peaks == sorted(peaks) and peaks[0] < plain
    assert [b - a for a, b in zip(peaks[1:-1], peaks[2:], strict=True)] == [per_unit] * (
        N_LAYER - 1
    )
    assert peaks[-1] == plain


def test_an_abandoned_step_gives_back_every_offloaded_input(monkeypatch):
    """Ctrl+C in the backward, with inputs both offloaded and on the card: the host
    buffers of the offloaded ones go back to the pool (the next steps page-lock nothing
    more), the device ones are dropped, and training goes on equal to an unbroken run."""
    cfg = _config("unit", offload=True, on_card=2)
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    engine = SwapEngine(cfg, backend, torch.float32)
    n_forward = len(engine.units) * ACCUM
    asked = []

    def stop() -> bool:  # after the head and the first backward unit's micro-batches
        asked.append(1)
        return len(asked) > n_forward + ACCUM

    try:
        with sim.watch():
            engine.train_step(batches_for(0, cfg), lr_at(0, cfg.train))
            pinned = backend.pinned_bytes
            with pytest.raises(KeyboardInterrupt):
                engine.train_step(batches_for(1, cfg), lr_at(1, cfg.train), stop=stop)
            loss = engine.train_step(batches_for(1, cfg), lr_at(1, cfg.train)).loss
        assert backend.pinned_bytes == pinned
        assert engine.ledger.current == engine.ledger.base
        assert sim.violations == []
    finally:
        engine.close()
    unbroken = _train(_config("unit", offload=False), *cuda_backend(monkeypatch, 1 << 16))
    assert loss == unbroken[0][1]


def test_a_negative_count_is_refused():
    with pytest.raises(ConfigError, match="acts_on_card must be >= 0"):
        tiny_config(swap={"acts_on_card": -1})
