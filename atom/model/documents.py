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

from atom.model.sdpa import attention, expand_kv

IGNORE = -100  # a target that carries no loss (F.cross_entropy's default ignore_index)
QUERY_CHUNK = 256  # queries per attention call over packed documents


class Documents:
    """Positions within each row's documents, and attention that keeps them apart.

    Attention runs in chunks of QUERY_CHUNK queries, each against the keys from the
    earliest document start any of its queries needs (within the window when there is
    one) up to itself: with short documents most of the T x T square is never computed
    (a masked SDPA cannot skip it), so packing costs about T x (chunk + document) scores
    instead of T x T. The chunk ranges come from the positions on the host (`on` builds
    them before the positions cross to the device: no sync)."""

    def __init__(self, positions: torch.Tensor, host: torch.Tensor | None = None) -> None:
        if positions.dim() != 2:
            raise ValueError(f"positions must be (batch, time), got shape {tuple(positions.shape)}")
        self.positions = positions.long()
        host = (positions if host is None else host).cpu().long()
        # the first key any row's query i may need: where its document starts
        self._first_key = (torch.arange(host.size(1)) - host).min(dim=0).values.tolist()
        self._blocks: dict[int | None, list] = {}

    @classmethod
    def on(cls, positions: torch.Tensor, device, non_blocking: bool = False) -> Documents:
        """From host positions, moved to `device`."""
        return cls(positions.to(device, non_blocking=non_blocking), host=positions)

    def blocks(self, window: int | None = None) -> list[tuple[int, int, int, torch.Tensor]]:
        """(first query, end, first key, (B, 1, queries, keys) bool mask) per chunk: True
        where query i may attend key j (j <= i, same document, i - j < window)."""
        if window not in self._blocks:
            pos = self.positions
            T = pos.size(1)
            out = []
            for a in range(0, T, QUERY_CHUNK):
                b = min(a + QUERY_CHUNK, T)
                lo = self._first_key[a]
                if window is not None:
                    lo = max(lo, a - window + 1)
                i = torch.arange(a, b, device=pos.device)[:, None]
                j = torch.arange(lo, b, device=pos.device)[None, :]
                gap = i - j
                same = (pos[:, a:b, None] - pos[:, None, lo:b]) == gap  # same document
                allowed = same & (gap >= 0)
                if window is not None:
                    allowed &= gap < window
                out.append((a, b, lo, allowed[:, None]))
            self._blocks[window] = out
        return self._blocks[window]

    def attend(self, q, k, v, window: int | None = None):
        """SDPA of (B, heads, T, hs) queries over their own documents' keys and values
        (B, kv_heads, T, hs): grouped-query heads keep a fused kernel (atom/model/sdpa.py).
        Every chunk is masked, so K/V heads are expanded here, once: the chunks' slices
        are views of one tensor, saved once for the backward (expanded per chunk, each
        chunk's copy was saved: memory growing with T x chunks, not T)."""
        k, v = expand_kv(q, k, v)
        outs = [
            attention(q[:, :, a:b], k[:, :, lo:b], v[:, :, lo:b], mask=mask)
            for a, b, lo, mask in self.blocks(window)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def mask(self, window: int | None = None) -> torch.Tensor:
        """The whole (B, 1, T, T) mask the blocks cut from (tests, inspection)."""
        B, T = self.positions.shape
        full = torch.zeros(B, 1, T, T, dtype=torch.bool, device=self.positions.device)
        for a, b, lo, m in self.blocks(window):
            full[:, :, a:b, lo:b] = m
        return full

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


def micro_batch(batch: tuple, device) -> tuple:
    """A micro-batch (x, y), or (x, y, positions) for rows packed with documents, on the
    device as (x, y, Documents or None)."""
    x, y = (t.to(device, non_blocking=True) for t in batch[:2])
    docs = Documents.on(batch[2], device, non_blocking=True) if len(batch) > 2 else None
    return x, y, docs
