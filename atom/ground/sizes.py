"""Byte sizes as people write them: ``24GiB``, ``12GB``, ``512MiB``, ``5GB``, ``1e9``.

The one parser behind every size a user types: ``atom profile --gpu-mem/--host-mem``,
``atom export --max-shard-size``, ``tools/bench/swap.py --gpu-mem``. Units are
case-insensitive and may be separated from the number by spaces:

- ``KB MB GB TB`` (or ``K M G T``): powers of 10, as in transformers' ``max_shard_size``
  (``5GB`` is 5 * 10**9 bytes);
- ``KiB MiB GiB TiB`` (or ``Ki Mi Gi Ti``): powers of 2 (``24GiB`` is 24 * 2**30);
- ``B`` or no unit: bytes.

The number may have a fraction or an exponent (``1.5GB``, ``1e9``); the result is rounded
down to whole bytes. Negative sizes are refused.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from atom.ground.errors import ConfigError

_SCALE = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(
    r"(?P<number>(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d{1,3})?)(?P<unit>[kmgt]i?)?b?", re.IGNORECASE
)
EXAMPLES = "24GiB, 12GB, 512MiB or 1e9"


def parse_bytes(text: str | int | float, what: str | None = None) -> int:
    """Bytes in `text` (an int, or a string such as 24GiB, 12GB, 512MiB, 5GB, 1e9).

    `what` names the setting in the error (e.g. ``--max-shard-size``); a value that is not a
    size raises :class:`atom.config.ConfigError` with a one-line message naming it.
    """
    where = f"{what}: " if what else ""
    if isinstance(text, bool):
        pass  # True is an int to Python, not a size to anyone
    elif isinstance(text, int):
        if text >= 0:
            return text
    elif isinstance(text, float):
        if math.isfinite(text) and text >= 0:
            return int(text)
    elif isinstance(text, str):
        m = _SIZE.fullmatch(re.sub(r"\s+", "", text))
        if m:
            unit = (m.group("unit") or "").lower()
            return int(Decimal(m.group("number")) * _SCALE[unit])
    raise ConfigError(f"{where}cannot read {text!r} as a size; write e.g. {EXAMPLES}")


__all__ = ["parse_bytes"]
