"""Cutting a model into swap units and running one unit from a flat parameter buffer.

A unit is the embedding, a run of `layers_per_unit` consecutive blocks, or the head.
Each unit's parameters are laid out in one flat buffer (the thing that crosses the bus):

    [ owned, weight-decayed | owned, not decayed | aliases of other units' params ]

each parameter at an element offset that is a multiple of ALIGN, with padding between
(zeros in every buffer of the layout: they are never a weight, and a zero gradient leaves
a zero master and zero moments).

An alias is a tied weight (GPT's head reuses the embedding matrix): its master copy and
optimizer state belong to the owning unit; the holder only gets a copy to compute with
and sends its gradient back to be folded into the owner's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from atom.model import LanguageModel
from atom.model.documents import Documents
from atom.model.head_loss import head_loss

# Why: compiled blocks (torch.compile, train.compile_blocks) get each parameter as a view of
# a device slot, and Inductor's kernels load 16 bytes at a time from inputs that are
# 16-byte aligned (an unaligned one is copied, or read by slower code). 8 elements are 16
# bytes in the narrowest dtype a unit's flat buffers come in (bf16/fp16; 32 in fp32); the
# host master, gradient and optimizer state share the layout, as copies go flat 1:1.
ALIGN = 8


def aligned(n: int) -> int:
    """`n` elements rounded up to where the next parameter of a unit may start."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ParamEntry:
    local_name: str  # name inside the unit module
    full_name: str  # name in the whole model: checkpoints and init use this
    shape: tuple[int, ...]
    offset: int  # into the unit's flat buffer
    numel: int
    decay: bool
    alias_of: tuple[int, int] | None = None  # (owner unit index, offset in owner's flat)


@dataclass
class UnitSpec:
    index: int
    kind: str  # embed | blocks | head
    module: nn.Module  # built on the meta device: structure only, parameters come from a slot
    params: list[ParamEntry] = field(default_factory=list)
    # in elements, padding included (a flat buffer's size: never a sum of numels)
    n_owned: int = 0  # owned params: the master/optimizer region
    n_decay: int = 0  # first n_decay elements are weight-decayed
    n_total: int = 0  # owned + aliases: what goes to the device
    # (submodule, attribute) per entry of params: where run_unit binds each tensor
    bindings: list[tuple[nn.Module, str]] = field(default_factory=list)

    @property
    def owned(self) -> list[ParamEntry]:
        return [p for p in self.params if p.alias_of is None]

    @property
    def aliases(self) -> list[ParamEntry]:
        return [p for p in self.params if p.alias_of is not None]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Unit-local name -> view into a flat buffer laid out like this unit."""
        return {
            p.local_name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.params
        }

    def owned_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Full name -> view into an owned-region buffer (master, optimizer state)."""
        return {p.full_name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in self.owned}


class UnitModule(nn.Module):
    """The parts of one unit, applied in order; the head part also computes the loss."""

    def __init__(self, kind: str, parts: list[nn.Module]):
        super().__init__()
        self.kind = kind
        self.parts = nn.ModuleList(parts)

    def forward(self, h: torch.Tensor, targets=None, docs: Documents | None = None):
        if self.kind == "head" and targets is not None:
            (head,) = self.parts
            return head_loss(head, h, targets)  # the logits never whole
        for part in self.parts:
            h = part(h) if self.kind == "head" else part(h, docs=docs)
        return h


def partition(model: LanguageModel, layers_per_unit: int) -> list[UnitSpec]:
    """Units in forward order: [embed, blocks[0:k], blocks[k:2k], ..., head]."""
    groups: list[tuple[str, list[nn.Module], list[str]]] = [("embed", [model.embed], ["embed"])]
    n = len(model.blocks)
    for start in range(0, n, layers_per_unit):
        idx = range(start, min(start + layers_per_unit, n))
        groups.append(("blocks", [model.blocks[i] for i in idx], [f"blocks.{i}" for i in idx]))
    groups.append(("head", [model.head], ["head"]))

    units: list[UnitSpec] = []
    owner_of: dict[int, tuple[int, ParamEntry]] = {}  # id(Parameter) -> owning unit, entry
    for index, (kind, parts, prefixes) in enumerate(groups):
        unit = UnitSpec(index=index, kind=kind, module=UnitModule(kind, parts))
        fresh: list[tuple[str, str, nn.Parameter]] = []
        tied: list[tuple[str, str, nn.Parameter]] = []
        for j, (part, prefix) in enumerate(zip(parts, prefixes, strict=True)):
            for name, param in part.named_parameters(remove_duplicate=False):
                item = (f"parts.{j}.{name}", f"{prefix}.{name}", param)
                (tied if id(param) in owner_of else fresh).append(item)
        # decayed (matrices) first, then vectors: two contiguous optimizer groups
        fresh.sort(key=lambda item: item[2].dim() < 2)
        offset = 0
        for local, full, param in fresh:
            entry = ParamEntry(
                local, full, tuple(param.shape), offset, param.numel(), decay=param.dim() >= 2
            )
            unit.params.append(entry)
            owner_of[id(param)] = (index, entry)
            offset = aligned(offset + param.numel())
            if entry.decay:
                unit.n_decay = offset
        unit.n_owned = offset
        for local, _full, param in tied:
            owner, owner_entry = owner_of[id(param)]
            unit.params.append(
                ParamEntry(
                    local,
                    owner_entry.full_name,
                    tuple(param.shape),
                    offset,
                    param.numel(),
                    decay=False,
                    alias_of=(owner, owner_entry.offset),
                )
            )
            offset = aligned(offset + param.numel())
        unit.n_total = offset
        for entry in unit.params:
            owner, _, attr = entry.local_name.rpartition(".")
            unit.bindings.append((unit.module.get_submodule(owner), attr))
        units.append(unit)
    return units


def param_leaves(unit: UnitSpec, flat: torch.Tensor) -> list[torch.Tensor]:
    """One autograd leaf per parameter, each a view of the slot (same order as unit.params).

    Why not one flat leaf sliced into views: autograd would then build a zero-filled
    unit-sized gradient per parameter and add them up (a dozen unit-sized memory passes
    per block backward); per-parameter leaves get exactly their own gradient."""
    return [
        flat[p.offset : p.offset + p.numel].view(p.shape).detach().requires_grad_()
        for p in unit.params
    ]


def run_unit(
    unit: UnitSpec,
    params: torch.Tensor | list[torch.Tensor],
    h: torch.Tensor,
    targets: torch.Tensor | None = None,
    docs: Documents | None = None,
) -> torch.Tensor:
    """Forward one unit with its parameters taken from a flat slot buffer, or from a list
    of per-parameter tensors in unit.params order (param_leaves).

    The unit's template module (meta-built, used only by the training thread) gets each
    tensor bound in place of its parameter: what torch.func.functional_call does, without
    walking the module tree on every visit (measured ~0.1 ms a visit)."""
    if isinstance(params, torch.Tensor):
        params = [params[p.offset : p.offset + p.numel].view(p.shape) for p in unit.params]
    for (module, attr), tensor in zip(unit.bindings, params, strict=True):
        module._parameters[attr] = tensor
    return unit.module(h, targets, docs)
