"""Keys and values of the tokens seen so far, for generation one token at a time.

Training never uses it: the blocks' forward takes it as an optional argument, so the
swap engine's units (which call forward(x)) are untouched. Each attention layer appends
its new keys/values to its own LayerCache; `KVCache.pos` is where the next tokens go.
"""

from __future__ import annotations

import torch


class LayerCache:
    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, h, T, hs) new keys/values -> all of them so far."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class KVCache:
    def __init__(self, n_layer: int) -> None:
        self.n_layer = n_layer
        self.reset()

    def reset(self) -> None:
        self.layers = [LayerCache() for _ in range(self.n_layer)]
        self.pos = 0  # tokens already cached: the position of the next one


def attention_mask(start: int, T: int, window: int | None, device) -> torch.Tensor | None:
    """Which cached keys (0 .. start+T-1) the queries at start .. start+T-1 may see: causal,
    and within `window` when there is one. None where every key is allowed (one query, no
    window cutting in): SDPA's fastest path."""
    total = start + T
    if T == 1 and (window is None or total <= window):
        return None
    q = torch.arange(start, total, device=device)[:, None]
    k = torch.arange(total, device=device)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed
