"""What the attack benches share (tools/bench/attacks.py, tools/bench/impersonate.py): a
victim's model fingerprint, and clean and attacked runs interleaved."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path


def fingerprint(run: Path) -> str:
    """The victim's model fingerprint, from the config it wrote (as a member knows it)."""
    from atom.config import Config
    from atom.gossip.merge import UnitParams
    from atom.run.train import build_engine

    engine = build_engine(Config.from_dict(json.loads((run / "config.json").read_text())))
    try:
        return UnitParams(engine.shared_units()).fingerprint
    finally:
        engine.close()


def interleaved(repeats: int, run) -> list[dict]:
    """run(root, attacked) -> a result, clean then attacked, `repeats` times (each attacked
    run beside a clean one), each in a fresh folder; each result printed as a JSON line."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for attacked in (False, True):
                root = Path(tmp) / f"r{r}{'a' if attacked else 'c'}"
                root.mkdir()
                result = run(root, attacked)
                result["attacked"] = attacked
                rows.append(result)
                print(json.dumps(result, default=str), flush=True)
    return rows
