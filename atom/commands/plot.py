"""`atom plot`: loss curves of one or more runs as a PNG.

Each run directory's metrics.jsonl gives the train loss per step (drawn faint, with a
moving average over it) and the validation loss where it was measured (markers); several
runs are overlaid, each in its own colour, labelled by directory name. The x axis is the
optimizer step, the tokens trained on (from the run's config.json), or the wall time
spent in steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from atom.ground.errors import ConfigError

AXES = ("step", "tokens", "time")


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run} holds no metrics.jsonl; give run directories of atom train")
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest of the run still plots
        if isinstance(rec, dict) and "step" in rec and "loss" in rec:
            out.append(rec)
    if not out:
        raise ConfigError(f"{path} has no step records yet; train first")
    return out


def _tokens_per_step(run: Path) -> int:
    try:
        cfg = json.loads((run / "config.json").read_text())
        t, m = cfg["train"], cfg["model"]
        return int(t["micro_batch"]) * int(t["grad_accum"]) * int(m["seq_len"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            f"{run}/config.json is missing or unreadable: plot it with --x step"
        ) from None


def _xs(run: Path, records: list[dict], x: str) -> list[float]:
    if x == "step":
        return [r["step"] for r in records]
    if x == "tokens":
        per = _tokens_per_step(run)
        return [r["step"] * per for r in records]
    total, out = 0.0, []
    for r in records:
        total += float(r.get("step_time_s", 0.0))
        out.append(total / 60)
    return out


def _smooth(values: list[float], span: int) -> list[float]:
    out, acc = [], None
    alpha = 2 / (span + 1)
    for v in values:
        acc = v if acc is None else alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def plot_runs(runs: list[Path], out: Path | None = None, x: str = "step") -> Path:
    """Write the PNG (default: loss.png in the first run directory) and return its path."""
    if x not in AXES:
        raise ConfigError(f"--x must be one of {', '.join(AXES)}, got {x!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("atom plot needs matplotlib: pip install 'atom[plot]'") from None
    runs = [Path(r) for r in runs]
    data = [(run, _records(run)) for run in runs]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (run, records) in enumerate(data):
        colour = f"C{i % 10}"
        xs = _xs(run, records, x)
        losses = [float(r["loss"]) for r in records]
        ax.plot(xs, losses, color=colour, alpha=0.25, linewidth=0.8)
        span = max(1, len(losses) // 50)
        ax.plot(xs, _smooth(losses, span), color=colour, label=f"{run.name} train")
        val = [(xv, float(r["val_loss"])) for xv, r in zip(xs, records, strict=True)
               if "val_loss" in r]  # fmt: skip
        if val:
            ax.plot(*zip(*val, strict=True), "o--", color=colour, label=f"{run.name} val")
    ax.set_xlabel({"step": "step", "tokens": "tokens", "time": "minutes in steps"}[x])
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(out) if out is not None else runs[0] / "loss.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
