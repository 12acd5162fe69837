"""Units kept on the card (resident across steps and updated there): their weights live in
their device slot alone (atom/swap/card_kept.py), and the host keeps no copy of them.

    pytest tests/test_card_kept.py

The reference is the same config with swap.resident_units=0: the same units updated on
the card, their weights streamed from the host (the card update's arithmetic does not
depend on where the weights live: tests/test_card_update.py). Checkpoints (every tensor),
the engine's parameters, exports, peers' reads, adds and writes, and a resume agree bit
for bit, in fp32 and compact state, with the compute copy the master itself or not; the
host store is smaller by what the card holds, and so is the trainer's host-RAM estimate.
Over the fake CUDA (tests/fake_cuda.py) every copy is ordered, and a checkpoint's read of a
unit that does not wait for the unit's update is caught.
"""

from __future__ import annotations

import contextlib
import math
import threading

import pytest
import torch

from atom.optim import lr_at
from atom.run.run_config import card_kept_bytes, host_bytes_needed
from atom.store.checkpoint import load_checkpoint, save_checkpoint
from atom.swap.backend import CpuBackend
from atom.swap.card_kept import CardKept
from atom.swap.card_update import CardUpdate
from atom.swap.engine import SwapEngine
from tests.test_card_update import _config, _flat
from tests.test_swap_equivalence import batches_for

KEPT = {1, 2, 3}  # the three block units, with resident_units=3
# (swap.state, compute dtype): compact's master is the bf16 compute copy itself (on the
# card: only the remainder and the moments stay on the host), or beside an fp32 copy;
# fp32's master is state (it stays on the host), its bf16 or fp32 copy on the card
STATES = {
    "compact": ("compact", torch.bfloat16),
    "compact, fp32 compute": ("compact", torch.float32),
    "fp32": ("fp32", torch.float32),
    "fp32, bf16 compute": ("fp32", torch.bfloat16),
    "bf16": ("bf16", torch.bfloat16),
    "bf16, fp32 compute": ("bf16", torch.float32),
}
TWO = [STATES["compact"], STATES["fp32"], STATES["bf16"]]


def _cfg(state: str, resident: int, clip: float = 0.05, update: str = "exact", card="all"):
    swap = {"state": state, "compile_update": False}
    return _config(card, clip, update, "unit", 2, resident, swap=swap,
                   train={"max_steps": 30})  # fmt: skip


def _steps(engine, cfg, steps) -> list[float]:
    return [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in steps]


def _seen(engine) -> dict[str, torch.Tensor]:
    """What everything outside a step reads: checkpoint tensors, the engine's parameters,
    peers' reads of every unit."""
    out = {f"ckpt/{k}": v for k, v in _flat(dict(engine.state_files())).items()}
    out.update({f"param/{k}": v.clone() for k, v in engine.named_parameters().items()})
    out.update({f"peer/{s.index}": s.read() for s in engine.shared_units()})
    return out


def _gossip(engine) -> None:
    """A peer's merge into one kept unit (add) and a pull of another (write), between
    steps; the values are the same for every engine."""
    shared = engine.shared_units()
    gen = torch.Generator().manual_seed(7)
    shared[2].add(torch.randn(shared[2].numel, generator=gen) * 1e-3)
    shared[1].write(shared[1].read() + torch.randn(shared[1].numel, generator=gen) * 1e-3)


def _run(cfg, dtype, backend=None):
    engine = SwapEngine(cfg, backend or CpuBackend(), dtype)
    try:
        losses = _steps(engine, cfg, range(3))
        seen = _seen(engine)
        _gossip(engine)
        after = {f"gossip/{k}": v for k, v in _seen(engine).items()}
        losses += _steps(engine, cfg, range(3, 5))
        return losses, {**seen, **after, **{f"end/{k}": v for k, v in _seen(engine).items()}}
    finally:
        engine.close()


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("state,dtype", STATES.values(), ids=STATES.keys())
def test_weights_on_the_card_read_and_write_as_host_weights_do(state, dtype):
    """Checkpoints, parameters and peers' reads after three steps, after a peer's add and
    write into kept units, and after two more steps: the bits of the host-weights run."""
    want_losses, want = _run(_cfg(state, 0), dtype)
    got_losses, got = _run(_cfg(state, 3), dtype)
    assert got_losses == want_losses
    assert want_losses[-1] < want_losses[0]
    _assert_same(got, want)


@pytest.mark.parametrize("state,dtype", STATES.values(), ids=STATES.keys())
def test_the_host_keeps_nothing_the_card_holds(state, dtype):
    """No compute copy on the host for a kept unit; no master either where the master is
    that copy (compact, bf16 compute): the store is smaller by exactly what the estimate
    leaves out (card_kept_bytes), and the initial weights went up once, a unit each."""
    engines = {r: SwapEngine(_cfg(state, r), CpuBackend(), dtype) for r in (0, 3)}
    try:
        kept, ref = engines[3], engines[0]
        assert kept.persistent == KEPT
        for u in KEPT:
            buf = kept.store.buffers[u]
            on_card = state in ("compact", "bf16") and dtype == torch.bfloat16
            assert buf.kept and buf.master_on_card == on_card
            assert buf.master.numel() == (0 if on_card else buf.spec.n_owned)
            if not buf.compute_is_master:
                assert buf.compute.numel() == 0
        saved = ref.store.nbytes() - kept.store.nbytes()
        # bytes a parameter: the bf16 master, an fp32 or bf16 copy, nothing (fp32 master)
        per = {("compact", torch.bfloat16): 2, ("compact", torch.float32): 4,
               ("fp32", torch.float32): 0, ("fp32", torch.bfloat16): 2,
               ("bf16", torch.bfloat16): 2, ("bf16", torch.float32): 4}  # fmt: skip
        expected = per[state, dtype]
        n = sum(kept.units[u].n_owned for u in KEPT)
        assert saved == card_kept_bytes(_cfg(state, 3), dtype) == expected * n
        estimates = [host_bytes_needed(_cfg(state, r), dtype)[1] for r in (0, 3)]
        assert estimates[0] - estimates[1] == saved
        assert kept.store.card.bytes_written == n * dtype.itemsize  # the initial weights
        assert ref.store.card.bytes_written == 0
        # and nothing of them comes back with each update: the same bytes a parameter less
        for engine in engines.values():
            _steps(engine, _cfg(state, 0), range(2))
        assert ref.card.bytes_down - kept.card.bytes_down == 2 * expected * n
    finally:
        for engine in engines.values():
            engine.close()


@pytest.mark.parametrize("state,dtype", TWO, ids=["compact", "fp32", "bf16"])
def test_a_checkpoint_resumes_into_weights_on_the_card(tmp_path, state, dtype):
    """A checkpoint of a kept run, loaded into a fresh kept engine (the slots filled from
    it) and into a host-weights one: evaluation (`atom eval`'s path), the next steps and
    the next checkpoint agree bit for bit, and `atom export` of the kept run's checkpoint
    is the host-weights run's export."""
    from safetensors.torch import load_file

    from atom.hf.export import export_hf

    cfg = _cfg(state, 3)
    source = SwapEngine(cfg, CpuBackend(), dtype)
    try:
        _steps(source, cfg, range(3))
        meta = {"optimizer_steps": 3, "config": cfg.to_dict()}
        path = save_checkpoint(tmp_path / "kept", 3, source.state_files(), meta)
    finally:
        source.close()
    runs = []
    for resident in (3, 0):
        c = _cfg(state, resident)
        engine = SwapEngine(c, CpuBackend(), dtype, init=False)
        try:
            engine.load_state(load_checkpoint(path).get, True, 3)
            val = engine.evaluate(batches_for(99, c))
            losses = _steps(engine, c, range(3, 5))
            meta = {"optimizer_steps": 5, "config": c.to_dict()}
            save_checkpoint(tmp_path / f"r{resident}", 5, engine.state_files(), meta)
            runs.append((val, losses, _seen(engine)))
        finally:
            engine.close()
    (val, losses, got), (want_val, want_losses, want) = runs
    assert val == want_val and losses == want_losses
    _assert_same(got, want)
    exports = []
    for resident in (3, 0):
        out = tmp_path / f"export{resident}"
        export_hf(tmp_path / f"r{resident}", out)
        exports.append({k: v for f in sorted(out.glob("*.safetensors")) for k, v in
                        load_file(f).items()})  # fmt: skip
    assert exports[0] and exports[0].keys() == exports[1].keys()
    _assert_same(exports[0], exports[1])


# ---------------------------------------------------------------------- CUDA ordering


def _cuda_case(engine, cfg, sim=None) -> tuple[list[float], dict]:
    """Two steps, a peer's add and write at once (before anything else reads the units),
    what is seen then, a step, what is seen then. `sim`: the steps under its checker (the
    reads' and writes' copies are checked on their own streams in any case)."""
    watch = sim.watch if sim is not None else contextlib.nullcontext
    with watch():
        losses = _steps(engine, cfg, range(2))
    _gossip(engine)
    seen = _seen(engine)
    with watch():
        losses += _steps(engine, cfg, range(2, 3))
    return losses, {**seen, **{f"end/{k}": v for k, v in _seen(engine).items()}}


@pytest.mark.parametrize("state,dtype", TWO, ids=["compact", "fp32", "bf16"])
def test_reads_and_writes_of_weights_on_the_card_are_ordered_on_cuda(monkeypatch, state, dtype):
    """The CUDA backend over the fake torch.cuda: a kept unit's reads (checkpoint,
    parameters, peers) wait for its update on the side stream, its writes (initial
    weights, a peer's add and write) for its update and the compute that read it, and the
    next step's compute for the write; the numbers are the CPU backend's."""
    cfg = _cuda_cfg(state)
    engine = SwapEngine(cfg, CpuBackend(), dtype)
    try:
        want_losses, want = _cuda_case(engine, cfg)
    finally:
        engine.close()
    losses, got, violations = _cuda_run(monkeypatch, cfg, dtype)
    assert violations == []
    assert losses == want_losses
    _assert_same(got, want)


def _cuda_cfg(state: str):
    # updates beside the backward; the kept units alone on the card, so that unit 1's
    # update is the step's last side-stream work (no later update's copies order the
    # streams after it by chance)
    return _cfg(state, 3, clip=1.0, update="eager", card="1-3")


def _cuda_run(monkeypatch, cfg, dtype):
    from tests.fake_cuda import cuda_backend

    backend, sim = cuda_backend(monkeypatch, 1 << 15)  # a small pool: reads in pieces
    engine = SwapEngine(cfg, backend, dtype)
    try:
        return (*_cuda_case(engine, cfg, sim), sim.violations)
    finally:
        engine.close()


def test_a_write_that_does_not_wait_for_the_units_update_is_caught(monkeypatch):
    """Planted: the card update records no marker of its last write of the slot, so a
    peer's write right after the step (fp32 state: no read of the slot before it) copies
    into the slot while the update's side stream may still be writing it: caught."""
    monkeypatch.setattr(CardKept, "updated", lambda self, unit, marker: None)
    violations = _cuda_run(monkeypatch, _cuda_cfg("fp32"), torch.float32)[2]
    assert any("overwrites" in v for v in violations), violations[:3]


def _read_during_update(monkeypatch, planted: bool):
    """A checkpoint's read of kept unit 2 from another thread, started while the unit's
    card update has written the slot's first chunk and not yet sent its state back.
    `planted`: the read does not wait for the update (no lock; no marker of its last
    write). Returns (what the read gave, unit 2's weights after the step, violations)."""
    from tests.fake_cuda import cuda_backend

    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    cfg = _cfg("compact", 3, clip=0.0)
    engine = SwapEngine(cfg, backend, torch.bfloat16)
    store, read = engine.store, {}

    def checkpoint_read() -> None:
        if planted:
            store.card.after.pop(2, None)
            read["values"] = store.read_master(2)
        else:
            with store.buffers[2].lock:
                read["values"] = store.read_master(2)

    real_land, started = CardUpdate._land, []

    def land(self, outs):
        if store.buffers[2].lock.locked() and not started and not store.buffers[2].ready.is_set():
            reader = threading.Thread(target=checkpoint_read)
            started.append(reader)
            reader.start()
            reader.join(timeout=0.5)  # planted: done; else it waits for the update's lock
        return real_land(self, outs)

    monkeypatch.setattr(CardUpdate, "_land", land)
    try:
        engine.card.chunk_limit = 256 * 8  # several chunks a unit
        with sim.watch():
            _steps(engine, cfg, range(1))
        engine.wait_idle()
        started[0].join(timeout=30)
        with store.buffers[2].lock:
            final = store.read_master(2)
        return read["values"], final, sim.violations
    finally:
        engine.close()


def test_a_checkpoint_read_that_does_not_wait_for_the_update_is_caught(monkeypatch):
    """Planted race: the read of a kept unit does not wait for its card update, and copies
    the slot out while the update's side stream may still be writing it: caught. Without
    the plant the same read waits (the unit's lock, held by the update until its last
    piece has landed) and gives the updated weights, with no violation."""
    got, final, violations = _read_during_update(monkeypatch, planted=False)
    assert violations == []
    assert torch.equal(got, final)
    _, _, violations = _read_during_update(monkeypatch, planted=True)
    assert any("reads" in v for v in violations), violations[:3]


def test_a_peer_merging_during_training_waits_for_the_step(monkeypatch):
    """A peer's thread adds into a kept unit again and again while the CUDA backend (over
    the fake torch.cuda) trains: each add lands between steps (a kernel may read the slot
    at any time), neither side waits for ever, and no copy is out of order."""
    from tests.fake_cuda import cuda_backend

    cfg = _cuda_cfg("compact")
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    engine = SwapEngine(cfg, backend, torch.bfloat16)
    shared, stop, adds = engine.shared_units()[2], threading.Event(), []

    def peer() -> None:
        while not stop.is_set() and len(adds) < 50:
            shared.add(torch.full((shared.numel,), 1e-4))
            adds.append(1)

    try:
        thread = threading.Thread(target=peer)
        thread.start()
        with sim.watch():
            losses = _steps(engine, cfg, range(3))
        stop.set()
        thread.join(timeout=60)
        assert not thread.is_alive() and adds
        assert sim.violations == []
        assert all(math.isfinite(x) for x in losses)
    finally:
        stop.set()
        engine.close()
