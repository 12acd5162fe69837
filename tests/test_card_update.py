"""The update on the card (swap.card_update, atom/swap/card_update.py) against the update
on the host, on the CPU backend.

    pytest tests/test_card_update.py

fp32 state: the card update runs the host's fused AdamW kernel on streamed chunks of the
same state, so the two trainings agree bit for bit (losses, every weight, both moments),
for each clipping choice, order, accumulation and resident units; and equal plain
PyTorch as the host update does. Compact state: close to the host update (the host lands
a bf16 gradient, the card keeps it in fp32), and it trains.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from atom.config import ConfigError
from atom.optim import lr_at
from atom.resident.engine import ResidentEngine
from atom.swap.backend import CpuBackend
from atom.swap.engine import SwapEngine
from tests.conftest import tiny_config
from tests.test_swap_equivalence import batches_for, rel_err

STEPS = 4


def _config(card: str, clip: float, update: str, order: str, accum: int, resident: int, **kw):
    return tiny_config(
        model={"tie_embeddings": False, **kw.pop("model", {})},
        train={"grad_clip": clip, "grad_accum": accum, "lr": 3e-3, **kw.pop("train", {})},
        swap={"card_update": card, "update": update, "order": order,
              "resident_units": resident, **kw.pop("swap", {})},
    )  # fmt: skip


def _train(cfg, backend=None, steps: int = STEPS):
    engine = SwapEngine(cfg, backend or CpuBackend(), torch.float32)
    try:
        losses = [
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in range(steps)
        ]
        return losses, dict(engine.state_files()), engine.card.updates, engine.optimizer_steps()
    finally:
        engine.close()


def _flat(files: dict) -> dict[str, torch.Tensor]:
    return {f"{stem}/{k}": v.clone() for stem, tensors in files.items() for k, v in tensors.items()}


# (grad_clip, swap.update, order, grad_accum, resident_units): no clipping (updates as each
# unit's backward ends), exact clipping (updates after the norm), eager (previous norm);
# unit- and micro-batch-major; accumulation 1 and 4; weights kept all step or streamed.
# A clip of 0.05 clips every step of this model, so the coefficient is exercised.
CASES = [
    (0.0, "exact", "unit", 1, 0),
    (0.0, "exact", "unit", 4, 1),
    (0.0, "exact", "micro", 4, 0),
    (0.05, "exact", "unit", 1, 1),
    (0.05, "exact", "unit", 4, 0),
    (0.05, "exact", "micro", 4, 1),
    (0.05, "eager", "unit", 1, 0),
    (0.05, "eager", "unit", 4, 1),
    (0.05, "eager", "micro", 4, 0),
]


@pytest.mark.parametrize("clip,update,order,accum,resident", CASES)
def test_card_update_equals_host_update_bit_for_bit(clip, update, order, accum, resident):
    host = _train(_config("none", clip, update, order, accum, resident))
    card = _train(_config("all", clip, update, order, accum, resident))
    assert card[2] == STEPS * 5  # every unit (embedding, 3 blocks, head) every step
    assert host[2] == 0
    assert card[0] == host[0]
    assert card[3] == host[3] == STEPS
    want, got = _flat(host[1]), _flat(card[1])
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("card,resident", [("1,3-4", 0), ("2-3", 3)])
def test_some_units_on_the_card_the_rest_on_the_host_bit_for_bit(card, resident):
    """Streamed units on either side; with 3 resident units, unit 1 is resident but
    updated on the host (loaded once a step) beside units 2-3 kept on the card."""
    host = _train(_config("none", 0.05, "exact", "unit", 2, resident))
    mixed = _train(_config(card, 0.05, "exact", "unit", 2, resident))
    assert mixed[2] == STEPS * 3 if card == "1,3-4" else STEPS * 2
    assert mixed[0] == host[0]
    for name, tensor in _flat(host[1]).items():
        assert torch.equal(_flat(mixed[1])[name], tensor), name


def test_card_update_with_a_copy_thread_and_host_worker_thread_bit_for_bit():
    """The CUDA backend's concurrency on the CPU: copies on a thread of their own, landings
    on the host worker thread, the unit's lock released by that thread."""
    cfg = _config("all", 0.05, "exact", "unit", 2, 0)
    host = _train(_config("none", 0.05, "exact", "unit", 2, 0))
    card = _train(cfg, CpuBackend(helper_threads=True))
    assert card[0] == host[0]
    for name, tensor in _flat(host[1]).items():
        assert torch.equal(_flat(card[1])[name], tensor), name


def test_card_update_equals_plain_pytorch():
    """As tests/test_swap_equivalence.py holds the host update to plain PyTorch (at its
    learning rate: Adam turns 1-ulp gradient differences into larger weight ones)."""
    cfg = _config("all", 1.0, "exact", "unit", 2, 0, train={"lr": 6e-4})
    resident = ResidentEngine(cfg, torch.device("cpu"), torch.float32)
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        for s in range(STEPS):
            batches, lr = batches_for(s, cfg), lr_at(s, cfg.train)
            a, b = engine.train_step(batches, lr).loss, resident.train_step(batches, lr).loss
            assert abs(a - b) <= 1e-5 * abs(b)
        swapped, ref = engine.named_parameters(), resident.named_parameters()
        for name, p in ref.items():
            assert rel_err(swapped[name], p) < 1e-5, name
    finally:
        engine.close()


def test_small_device_chunks_stream_a_unit_in_many_pieces():
    """A unit crosses in many chunks (the next one's copy issued before this one's
    update), a chunk cut by the decay boundary: the same bits as one chunk per unit."""
    cfg = _config("all", 0.0, "exact", "unit", 1, 0)
    whole = _train(cfg)
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    engine.card.chunk_limit = 256 * 13  # the blocks' units have ~50k parameters: ~15 chunks
    try:
        losses = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                  for s in range(STEPS)]  # fmt: skip
        files = _flat(dict(engine.state_files()))
    finally:
        engine.close()
    assert losses == whole[0]
    for name, tensor in _flat(whole[1]).items():
        assert torch.equal(files[name], tensor), name


def test_compact_state_on_the_card_follows_the_host_update():
    """Compact state: the card keeps the summed gradient in fp32 where the host lands it in
    bf16, and rounds its moments' fp32 sums in another order: close, not equal."""
    kw = {"swap": {"state": "compact", "compile_update": False}, "train": {"max_steps": 30}}
    host = _train(_config("none", 0.0, "exact", "unit", 2, 0, **kw), steps=12)
    card = _train(_config("all", 0.0, "exact", "unit", 2, 0, **kw), steps=12)
    assert card[2] == 12 * 5
    assert card[0][-1] < card[0][0] - 0.4  # it trains
    for a, b in zip(card[0], host[0], strict=True):
        assert abs(a - b) < 0.01 * b, (card[0], host[0])


def test_card_update_with_an_fp32_compute_copy_of_compact_state_writes_it_back():
    """Compact state with an fp32 compute dtype: the compute copy is a buffer of its own,
    and the card update writes the new weights there too (the next step trains on them)."""
    cfg = _config("all", 0.0, "exact", "unit", 1, 0, swap={"state": "compact"})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        for s in range(3):
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train))
        engine.wait_idle()
        for buf in engine.store.buffers:
            assert not buf.compute_is_master
            assert torch.equal(buf.compute[: buf.spec.n_owned], buf.master.float())
    finally:
        engine.close()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("9", "unit 9 does not exist"),
        ("1-x", "not a unit index"),
    ],
)
def test_bad_unit_lists_are_refused_in_one_line(spec, match):
    with pytest.raises(ConfigError, match=match):
        SwapEngine(_config(spec, 0.0, "exact", "unit", 1, 0), CpuBackend(), torch.float32)


def test_tied_units_stay_on_the_host():
    """GPT's tied embedding and head: `all` leaves them to the host; naming one refuses."""
    cfg = tiny_config(swap={"card_update": "all"})
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        assert engine.card_units == {1, 2, 3}
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="unit 0 shares tied weights"):
        SwapEngine(tiny_config(swap={"card_update": "0-2"}), CpuBackend(), torch.float32)


def test_units_updated_on_the_card_keep_their_moments_only_on_the_nvme_tier(monkeypatch, tmp_path):
    """With the NVMe tier, a card unit's moments are in its tier record, paged in for the
    update: no page-locked moments of their own beside it (tests/test_disk_tier.py has the
    training itself)."""
    from tests.fake_cuda import cuda_backend

    pinned = {}
    for card in ("none", "all"):
        cfg = _cuda_config("fp32", 0.0, "exact", 0)
        cfg.swap.card_update, cfg.swap.disk_dir = card, str(tmp_path)
        backend, _ = cuda_backend(monkeypatch, 1 << 15)
        engine = SwapEngine(cfg, backend, torch.float32)
        try:
            pinned[card] = backend.pinned_bytes
            assert engine.tier is not None and bool(engine.card_units) == (card == "all")
        finally:
            engine.close()
    assert pinned["all"] == pinned["none"]


# ---------------------------------------------------------------------- kept on the card


def test_resident_units_updated_on_the_card_stay_on_the_device_across_steps():
    """Resident + card-updated: their weights go up once, when the engine is built (no
    step loads them: every step moves only the streamed units' weights), and training is
    still bit-equal to the host update."""
    cfg = _config("all", 0.0, "exact", "unit", 2, 3)
    engine = SwapEngine(cfg, CpuBackend(), torch.float32)
    host = _train(_config("none", 0.0, "exact", "unit", 2, 3))
    try:
        assert engine.persistent == {1, 2, 3}
        blocks = sum(engine.units[u].n_owned * 4 for u in (1, 2, 3))
        assert engine.store.card.bytes_written == blocks  # the initial weights, once
        loaded = []
        for s in range(STEPS):
            before = engine.slots.bytes_loaded
            engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train))
            loaded.append(engine.slots.bytes_loaded - before)
        streamed = sum(engine.store.buffers[u].compute.nbytes for u in (0, 4))
        assert len(set(loaded)) == 1 and 0 < loaded[0] <= 2 * streamed  # forward, backward
        assert engine.store.card.bytes_written == blocks
        assert set(engine.slots.resident_units()) >= {1, 2, 3}  # between steps too
        files = _flat(dict(engine.state_files()))
    finally:
        engine.close()
    for name, tensor in _flat(host[1]).items():
        assert torch.equal(files[name], tensor), name


def test_a_merge_into_a_unit_kept_on_the_card_reaches_the_next_step():
    """A peer's merge lands in the host master between steps: the unit kept on the device
    is loaded anew, so both placements train on the merged weights, bit for bit."""
    from atom.gossip.merge import UnitParams

    runs = []
    for card in ("none", "all"):
        cfg = _config(card, 0.0, "exact", "unit", 1, 3)
        engine = SwapEngine(cfg, CpuBackend(), torch.float32)
        try:
            losses = [engine.train_step(batches_for(0, cfg), lr_at(0, cfg.train)).loss]
            params = UnitParams(engine.shared_units())
            params.add(params.units[2], torch.full((engine.units[2].n_owned,), 1e-3))
            losses += [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                       for s in (1, 2)]  # fmt: skip
            runs.append((losses, _flat(dict(engine.state_files()))))
        finally:
            engine.close()
    (host_losses, host_files), (card_losses, card_files) = runs
    assert card_losses == host_losses
    for name, tensor in host_files.items():
        assert torch.equal(card_files[name], tensor), name


def test_a_checkpoint_loaded_into_an_engine_with_units_on_the_card_is_trained_on(tmp_path):
    from atom.store.checkpoint import load_checkpoint, save_checkpoint

    cfg = _config("all", 0.0, "exact", "unit", 1, 3)
    a = SwapEngine(cfg, CpuBackend(), torch.float32)
    b = SwapEngine(cfg, CpuBackend(), torch.float32)
    try:
        for s in range(3):
            a.train_step(batches_for(s, cfg), lr_at(s, cfg.train))
        path = save_checkpoint(tmp_path, 3, a.state_files(), {"optimizer_steps": 3})
        b.train_step(batches_for(0, cfg), lr_at(0, cfg.train))  # its own weights on the card
        b.load_state(load_checkpoint(path).get, True, 3)
        got = [b.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in (3, 4)]
        want = [a.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss for s in (3, 4)]
    finally:
        a.close()
        b.close()
    assert got == want


def test_compact_state_with_bf16_weights_kept_on_the_card_equals_them_streamed():
    """Compact state, bf16 compute: a unit kept on the device gives its update the bf16
    master from its slot (no copy up) and takes the new weights there; streamed, the master
    crosses from the host. The same bits either way."""
    kw = {"swap": {"state": "compact", "compile_update": False}, "train": {"max_steps": 30}}
    runs = []
    for resident in (0, 3):
        cfg = _config("all", 0.0, "exact", "unit", 1, resident, **kw)
        engine = SwapEngine(cfg, CpuBackend(), torch.bfloat16)
        try:
            losses = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                      for s in range(6)]  # fmt: skip
            runs.append((losses, _flat(dict(engine.state_files())), engine.card.bytes_up))
        finally:
            engine.close()
    (streamed, s_files, s_up), (kept, k_files, k_up) = runs
    assert kept == streamed
    assert streamed[-1] < streamed[0]
    for name, tensor in s_files.items():
        assert torch.equal(k_files[name], tensor), name
    assert k_up < s_up  # the kept units' masters did not cross


# ---------------------------------------------------------------------- CUDA ordering
# The CUDA backend over the fake torch.cuda (tests/fake_cuda.py): every stream op's order
# is checked as a GPU would be free to reorder it.

CUDA_CASES = {
    "fp32, exact clipping, streamed": ("fp32", 1.0, "exact", 0, torch.float32),
    "fp32, no clipping, kept on the card": ("fp32", 0.0, "exact", 3, torch.float32),
    "compact bf16, eager, kept on the card": ("compact", 1.0, "eager", 3, torch.bfloat16),
}


def _cuda_config(state: str, clip: float, update: str, resident: int):
    return tiny_config(
        model={"arch": "llama", "n_kv_head": 2, "tie_embeddings": False},
        train={"grad_accum": 2, "grad_clip": clip, "max_steps": 30},
        swap={"card_update": "all", "state": state, "update": update,
              "resident_units": resident, "compile_update": False},
    )  # fmt: skip


def _cuda_train(cfg, backend, dtype, sim=None, steps: int = 2):
    engine = SwapEngine(cfg, backend, dtype)
    try:
        losses = []
        for s in range(steps):
            with sim.watch() if sim is not None else contextlib.nullcontext():
                losses.append(engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss)
        return losses, _flat(dict(engine.state_files())), engine.card.updates
    finally:
        engine.close()


@pytest.mark.parametrize("tier", [False, True], ids=["ram", "nvme"])
@pytest.mark.parametrize("case", CUDA_CASES.values(), ids=CUDA_CASES.keys())
def test_card_update_on_the_cuda_backend_orders_every_copy(monkeypatch, tmp_path, case, tier):
    from tests.fake_cuda import cuda_backend

    state, clip, update, resident, dtype = case
    cfg = _cuda_config(state, clip, update, resident)
    cfg.swap.disk_dir = str(tmp_path) if tier else None
    want = _cuda_train(cfg, CpuBackend(), dtype)
    backend, sim = cuda_backend(monkeypatch, 1 << 15)  # a small pool: a few chunks a unit
    got = _cuda_train(cfg, backend, dtype, sim)
    assert sim.violations == []
    assert got[2] == want[2] == 2 * 5
    assert got[0] == want[0]
    for name, tensor in want[1].items():
        assert torch.equal(got[1][name], tensor), name


class _NoStateWait:
    """A backend whose compute never waits for a copy: the card update reads state the
    copy stream may not have written yet."""

    def __init__(self, backend):
        self._backend = backend

    def wait_compute(self, t) -> None:
        from atom.swap import backend as backend_mod

        backend_mod._wait_issued(t)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def test_an_update_that_does_not_wait_for_its_state_copy_is_caught(monkeypatch):
    from tests.fake_cuda import cuda_backend

    cfg = _cuda_config("fp32", 0.0, "exact", 0)
    backend, sim = cuda_backend(monkeypatch, 1 << 14)
    engine = SwapEngine(cfg, backend, torch.float32)
    engine.card.backend = _NoStateWait(backend)
    try:
        with sim.watch():
            engine.train_step(batches_for(0, cfg), 1e-3)
    finally:
        engine.close()
    assert any("reads" in v or "overwrites" in v for v in sim.violations), sim.violations[:3]


def test_a_state_chunk_reused_before_its_copy_landed_is_caught(monkeypatch):
    """The staging chunks of the state's D2H go back to the pool at once: the next copy
    overwrites host memory the landing has not read."""
    from atom.swap.backend import CudaBackend
    from tests.fake_cuda import cuda_backend, release_staging_early

    release_staging_early(monkeypatch)
    monkeypatch.setattr(CudaBackend, "d2h_into", lambda self, pairs: None)  # staged
    cfg = _cuda_config("fp32", 0.0, "exact", 0)
    backend, sim = cuda_backend(monkeypatch, 1 << 16)
    sim.copy_delay_s = 0.2  # the landing sleeps in its wait while the next copy is issued
    engine = SwapEngine(cfg, backend, torch.float32)
    try:
        with sim.watch():
            engine.train_step(batches_for(0, cfg), 1e-3)
            engine.wait_idle()
    finally:
        engine.close()
    assert any("on the host reads" in v for v in sim.violations), sim.violations[:3]


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_the_new_state_lands_in_place_with_the_staged_bits(monkeypatch, state):
    """On CUDA the state is page-locked: its copies back go straight into it (no staging
    pool, no host copy after), and land the same bits as through the staging pool."""
    from atom.swap.backend import CudaBackend
    from tests.fake_cuda import cuda_backend

    dtype = torch.bfloat16 if state == "compact" else torch.float32
    cfg = _cuda_config(state, 0.0, "exact", 0)
    runs = []
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(CudaBackend, "d2h_into", lambda self, pairs: None)
        backend, sim = cuda_backend(monkeypatch, 1 << 15)
        sim.copy_delay_s = 0.01  # a landing read before its copy is done would read NaN
        engine = SwapEngine(cfg, backend, dtype)
        try:
            with sim.watch():
                losses = [engine.train_step(batches_for(s, cfg), lr_at(s, cfg.train)).loss
                          for s in range(2)]  # fmt: skip
            files = _flat(dict(engine.state_files()))
            runs.append((losses, files, engine.card.landed_in_place, engine.card.bytes_down))
        finally:
            engine.close()
        assert sim.violations == []
    (losses, files, chunks, down), (want_losses, want, staged, want_down) = runs
    assert chunks > 0 and staged == 0 and down == want_down
    assert losses == want_losses
    for name, tensor in want.items():
        assert torch.equal(files[name], tensor), name


def test_a_landing_in_place_not_waited_for_is_caught(monkeypatch):
    """Planted: the host worker does not wait for the copies into the state before it gives
    the unit back, so the next step's copy up reads state the copy back may not have
    written: caught."""
    from atom.swap.backend import CudaBackend, _wait_issued
    from tests.fake_cuda import cuda_backend

    monkeypatch.setattr(CudaBackend, "wait_host", lambda self, t: _wait_issued(t))
    cfg = _cuda_config("fp32", 0.0, "exact", 0)
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    sim.copy_delay_s = 0.05
    _cuda_train(cfg, backend, torch.float32, sim)
    assert any("host" in v for v in sim.violations), sim.violations[:3]


def test_the_update_runs_beside_the_compute_and_the_next_step_waits_for_it(monkeypatch):
    """The update's kernels run on the side stream (the backward is not queued behind
    them); a next step that did not wait for it (join_side forgotten) would read slots the
    update may still be writing: caught."""
    from atom.swap.backend import CudaBackend
    from tests.fake_cuda import cuda_backend

    cfg = _cuda_config("fp32", 0.0, "exact", 3)
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    _cuda_train(cfg, backend, torch.float32, sim)
    assert sim.violations == []
    assert sim.clocks[backend.side.name][backend.side.name] > 100  # the update's ops
    # only the kept units on the card: no later state copy happens to order the compute
    # stream after their updates (a streamed unit's load waits on the copy stream, which
    # waited on the side stream for its state's copies)
    cfg.swap.card_update = "1-3"
    monkeypatch.setattr(CudaBackend, "join_side", lambda self: None)
    backend, sim = cuda_backend(monkeypatch, 1 << 15)
    _cuda_train(cfg, backend, torch.float32, sim)
    assert any("reads" in v or "overwrites" in v for v in sim.violations), sim.violations[:3]


@pytest.mark.parametrize("state", ["fp32", "compact"])
def test_the_state_of_units_updated_on_the_card_is_page_locked(monkeypatch, state):
    """Their state crosses the bus every step: the master (where it is not the compute
    copy), the remainder and the moments are page-locked beside the compute copies (the
    profiler prices these copies at the pinned rate)."""
    from tests.fake_cuda import cuda_backend

    dtype = torch.bfloat16 if state == "compact" else torch.float32
    pinned = {}
    for card in ("none", "all"):
        cfg = _cuda_config(state, 0.0, "exact", 0)
        cfg.swap.card_update = card
        backend, _ = cuda_backend(monkeypatch, 1 << 15)
        engine = SwapEngine(cfg, backend, dtype)
        try:
            pinned[card] = backend.pinned_bytes
            n = sum(engine.units[u].n_owned for u in engine.card_units)
        finally:
            engine.close()
    # fp32: two fp32 moments (the master is the fp32 compute copy, pinned already);
    # compact: remainder 2 + two 1-byte codes (+ scales); the master is the bf16 copy
    per = 8 if state == "fp32" else 4
    extra = pinned["all"] - pinned["none"]
    assert per * n <= extra <= per * n * 1.05 + 64 * 4096, (extra, per * n)


def test_a_single_unit_from_the_command_line_is_a_unit_list():
    """`--set swap.card_update=3`: YAML reads 3 as a number; it names unit 3."""
    from atom.config import load_config

    cfg = load_config(None, ["swap.card_update=3", "model.tie_embeddings=false"])
    assert cfg.swap.card_update == "3"
