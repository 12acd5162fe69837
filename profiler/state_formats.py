"""What each host state format (swap.state) costs in bytes, and the engine parts of issue 49
that the cost model counts on.

Per parameter (n_owned; compute dtype bf16):

| state   | host RAM                                   | a host update through DRAM   |
|---------|--------------------------------------------|------------------------------|
| fp32    | master 4, moments 8, gradient 4, bf16 copy 2 | ~38: norm 4, AdamW 28, copy 6 |
| compact | bf16 master 2 (the bus copy), remainder 2,  | ~16: norm 2, read 8.03, write  |
|         | moments 2.03, gradient 2                    | 6.03                           |
| bf16    | bf16 weights 2 (the bus copy), moments     | ~12: norm 2, read 6.03, write  |
|         | 2.03, gradient 2 (lighter, not bit-exact)   | 4.03                           |

Moments in compact and bf16 state: 8-bit codes (float8 e4m3) with an fp32 scale per 256
(atom/optim/compact.py), 2 + 8/256 bytes a parameter for both. The bf16 state has no fp32
master: its update rounds the new weights to bf16 stochastically (lighter, not bit-exact to
fp32; issue 49, item 2).

A unit whose weights stay on the card (kept there across steps and updated there;
`weights_stay`) has no bf16 weights on the host at all: the host keeps the remainder and
the moments (compact), the moments (bf16), or the fp32 master and moments without a bus
copy (fp32), and its card update sends no weights down (issue 49, item 1).
"""

from __future__ import annotations

import torch

from atom.optim.compact import BLOCK, padded
from atom.profiler.analysis import UnitInfo, dtype_bytes

# Engine parts of issue 49 that land beside this model. Each False makes the cost model
# count as before that part, and a plan that needs it lists it (tiers.needs, Plan.needs:
# `atom train --plan` refuses it, tools/hardware_table says "not built yet").
# swap.state: bf16: bf16 weights, 8-bit moments, stochastic rounding, no fp32 master
ENGINE_BF16_STATE = True
# a unit kept on the card across steps and updated there keeps its weights only there
ENGINE_CARD_WEIGHTS_STAY = True

STATES = ("fp32", "compact", "bf16")
# the bf16 state's update against the compact one's, per parameter: the same decode,
# AdamW and encode, without the remainder's join and split (a stochastic rounding
# instead). An estimate until the engine's update is measured (tools/bench/host_update)
BF16_UPDATE_SHARE = 3.9
# Device-memory traffic of the update on the card, bytes a parameter: read gradient,
# master and moments, write master, moments (and the compute copy), the chunk's copies;
# bf16: compact's without the remainder's read and write
CARD_WORK_BYTES = {"fp32": 32, "compact": 24, "bf16": 20}
# The card update's new state comes down by DMA straight into the page-locked host state
# on CUDA (atom/swap/card_update.py `_land_in_place`: every card unit's state and the NVMe
# tier's slots come from the pinned arena): one pass through host DRAM for each byte down.
# (Through the staging pool and a host copy after, as before, it was three.)
CARD_DOWN_DRAM_PASSES = 1


def master_dtype(state: str) -> torch.dtype:
    """The dtype of the host's weights and gradient in this state."""
    return torch.float32 if state == "fp32" else torch.bfloat16


def moment_bytes(n: int) -> int:
    """Two 8-bit code arrays and their block scales for n parameters (compact, bf16)."""
    blocks = padded(n)
    return 2 * blocks + 2 * 4 * blocks // BLOCK


def weights_stay(state: str, dtype: torch.dtype) -> bool:
    """Do units kept and updated on the card keep their weights only there? Where the
    engine does it (ENGINE_CARD_WEIGHTS_STAY), and the card's copy can stand for the host's:
    bf16 compute for compact and bf16 state (the slot holds the master's bf16 half), any
    compute dtype but fp32 for fp32 state (the host keeps the fp32 master)."""
    if not ENGINE_CARD_WEIGHTS_STAY:
        return False
    if state == "fp32":
        return dtype != torch.float32
    return dtype == torch.bfloat16


def card_state_bytes(
    u: UnitInfo,
    state: str,
    dtype: torch.dtype,
    persistent: bool,
    stay: bool | None = None,
    paged: bool = False,
) -> tuple[float, float]:
    """(up, down): bytes of a card-updated unit's optimizer state over the bus per update,
    as atom/swap/card_update.py moves them.

    fp32: master and both moments each way (12 bytes a parameter), and down the compute
    copy where it is not the master. compact: the 16-bit remainder and the moments each way;
    bf16: the moments each way. Both bring the bf16 master up but for a unit kept on the
    card across steps in a bf16 step (read from its slot), and down but where the slot is
    its only home (kept, `stay`, bf16 compute, not `paged` to the NVMe tier); other compute
    dtypes also bring the compute copy down, but for a kept unit (its slot is the copy)."""
    n = u.n_total
    dt = dtype_bytes(dtype)
    if stay is None:
        stay = persistent and weights_stay(state, dtype)
    if state == "fp32":
        copy = 0 if dtype == torch.float32 or stay else dt * n
        return 12.0 * n, 12.0 * n + copy
    state_bytes = moment_bytes(n) + (2 * n if state == "compact" else 0)
    bf16 = dtype == torch.bfloat16
    up = state_bytes + (0 if bf16 and persistent else 2 * n)
    master_back = 0 if stay and bf16 and not paged else 2 * n
    down = state_bytes + master_back + (0 if bf16 or stay else dt * n)
    return float(up), float(down)


def pinned_state_per_param(state: str, dtype: torch.dtype) -> float:
    """Host state a card-updated unit page-locks, bytes a parameter: the moments (and the
    remainder, compact), and the master where it is not the compute copy."""
    per = {"fp32": 8, "compact": 4 + 8 / BLOCK, "bf16": 2 + 8 / BLOCK}[state]
    master = master_dtype(state)
    return per + (dtype_bytes(master) if dtype != master else 0)


def update_dram_bytes(state: str, dtype: torch.dtype) -> float:
    """Bytes through host DRAM a parameter of one host update: the gradient norm's read,
    the update's reads and writes, and the refresh of the compute copy where it is not the
    master. compact: gradient, master, remainder, codes and scales read; master, remainder,
    codes and scales written; bf16: the same without the remainder. The update's fp32
    scratch is cache-sized chunks (atom/optim/compact.py): not charged."""
    scales = 2 * 4 / BLOCK  # both moments' scales, each way
    if state == "fp32":
        update = 4 + 16 + 12  # norm; p, g, m, v read; p, m, v written (fused AdamW)
    elif state == "compact":
        update = 2 + (8 + scales) + (6 + scales)
    else:
        update = 2 + (6 + scales) + (4 + scales)
    master = master_dtype(state)
    refresh = dtype_bytes(master) + dtype_bytes(dtype) if dtype != master else 0
    return update + refresh


def host_update_s_per_param(state: str, hw) -> float:
    """Seconds a parameter of the host's update in this state (HardwareSpec's rates)."""
    if state == "fp32":
        return hw.adam_s_per_param
    share = BF16_UPDATE_SHARE if state == "bf16" else 1.0
    return hw.compact_adam_s_per_param * share


def card_work_s(u: UnitInfo, state: str, hw) -> float:
    """Seconds of the update itself on the device: memory-bound on a card; on the CPU
    backend the "card" is the host's cores, at the host update's own rate."""
    if hw.device == "cuda" and hw.card_mem_bps > 0:
        return u.n_total * CARD_WORK_BYTES[state] / hw.card_mem_bps
    return u.n_total * host_update_s_per_param(state, hw)


def needs(state: str) -> list[str]:
    """What the engine lacks to run a plan in this state."""
    if state == "bf16" and not ENGINE_BF16_STATE:
        return ["the bf16 state (swap.state: bf16)"]
    return []
