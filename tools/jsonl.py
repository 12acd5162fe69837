"""Read the JSON-lines files runs write (metrics.jsonl, snapshots.jsonl) while, or after,
they are written."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """Every complete record; [] for a file not written yet. A line that does not parse
    (the one a live writer is in the middle of) is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out
