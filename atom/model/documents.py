"""Several documents packed into one row, kept apart.

A chat or instruction dataset packs whole conversations into each training row. Each one
must read as if it were alone: its positions start at 0 and its tokens attend only to
earlier tokens of the same document. Both follow from one (B, T) tensor of positions
within the document (what Hugging Face passes as position_ids for padding-free packing):
tokens i >= j of a row belong to the same document exactly when pos[i] - pos[j] == i - j,
since positions climb by one inside a document and fall back to 0 where the next starts.

Training and evaluation on such data pass a `Documents` through the blocks; plain text
(one long stream) passes None and keeps SDPA's fastest causal path.
"""

from __future__ import annotations

import torch

IGNORE = -100  # a target that carries no loss (F.cross_entropy's default ignore_index)


class Documents:
    """Positions within each row's documents, and the attention mask they imply (built
    once per window size and reused by every layer of the micro-batch)."""

    def __init__(self, positions: torch.Tensor) -> None:
        if positions.dim() != 2:
            raise ValueError(f"positions must be (batch, time), got shape {tuple(positions.shape)}")
        self.positions = positions.long()
        self._masks: dict[int | None, torch.Tensor] = {}

    def to(self, device, non_blocking: bool = False) -> Documents:
        return Documents(self.positions.to(device, non_blocking=non_blocking))

    def mask(self, window: int | None = None) -> torch.Tensor:
        """(B, 1, T, T) bool, True where query i may attend key j: j <= i, same document,
        and i - j < window when there is one (the sliding-window rule)."""
        if window not in self._masks:
            pos = self.positions
            T = pos.size(1)
            i = torch.arange(T, device=pos.device)
            gap = i[:, None] - i[None, :]  # (T, T): i - j
            allowed = (pos[:, :, None] - pos[:, None, :]) == gap  # same document (where j <= i)
            allowed &= gap >= 0
            if window is not None:
                allowed &= gap < window
            self._masks[window] = allowed[:, None]
        return self._masks[window]

    def gather(self, table: torch.Tensor) -> torch.Tensor:
        """Rows of a (T, d) per-position table for every token: (B, 1, T, d), broadcasting
        over attention heads (RoPE's cos/sin)."""
        return table[self.positions][:, None]


def positions_in_documents(starts: torch.Tensor) -> torch.Tensor:
    """(B, T) bool document starts -> (B, T) positions within each document; a row's first
    token starts one whatever the flag says."""
    B, T = starts.shape
    i = torch.arange(T, device=starts.device).expand(B, T)
    first = torch.where(starts, i, torch.zeros_like(i))
    first[:, 0] = 0
    return i - torch.cummax(first, dim=1).values
