"""Where a run's metrics go besides metrics.jsonl (always written): `train.logger`, a
comma-separated choice of csv, tensorboard and wandb (litgpt's choose_logger, several at
once). Each receives every step's record (loss, lr, tokens/s, step time, device bytes,
gradient norm, validation loss when measured, gossip stats when peering).

    csv          RUN/metrics.csv, one row per step (resume drops rows past the checkpoint)
    tensorboard  RUN/tensorboard/ event files (pip install 'atom[tensorboard]')
    wandb        a W&B run in RUN/wandb, offline unless WANDB_MODE says otherwise, so no
                 account is needed (pip install 'atom[wandb]'; `wandb sync` uploads later)
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

from atom.config import LOGGERS
from atom.ground.errors import ConfigError

CSV_FIELDS = ("step", "loss", "val_loss", "lr", "tokens_per_s", "step_time_s",
              "device_peak_bytes", "grad_norm")  # fmt: skip


def parse(spec: str) -> list[str]:
    """The loggers besides jsonl (train.logger is validated with the config)."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    return [n for n in dict.fromkeys(names) if n in LOGGERS and n != "jsonl"]


def _scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a record, nested dicts flattened (gossip/...)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or key == "step":
            continue
        if isinstance(value, int | float):
            out[prefix + key] = float(value)
        elif isinstance(value, dict):
            out.update(_scalars(value, f"{prefix}{key}/"))
    return out


def _step(row: dict) -> float:
    try:
        return int(row["step"])
    except (KeyError, TypeError, ValueError):  # a row cut by a kill: dropped
        return float("inf")


class CsvLogger:
    def __init__(self, run: Path, start_step: int):
        self.path = run / "metrics.csv"
        rows = []
        if self.path.exists():  # a resumed run: keep the rows the checkpoint includes
            with self.path.open(newline="") as f:
                rows = [r for r in csv.DictReader(f) if _step(r) <= start_step]
        self.file = self.path.open("w", newline="")
        self.writer = csv.DictWriter(self.file, CSV_FIELDS, extrasaction="ignore")
        self.writer.writeheader()
        self.writer.writerows(rows)
        self.file.flush()

    def log(self, record: dict[str, Any]) -> None:
        self.writer.writerow(record)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardLogger:
    def __init__(self, run: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run: events past the checkpoint (to be redone) are dropped
        self.writer = SummaryWriter(str(run / "tensorboard"), purge_step=start_step + 1)

    def log(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, run: Path, config: dict):
        import wandb

        self.run = wandb.init(
            project="atom", name=run.name, dir=str(run), config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )  # fmt: skip

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


_NEEDS = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
}


def check_available(spec: str) -> None:
    """Refuse, before anything slow starts, a logger whose package is not installed."""
    import importlib

    for name in parse(spec):
        if name in _NEEDS:
            module, extra = _NEEDS[name]
            try:
                importlib.import_module(module)
            except ImportError:
                raise ConfigError(
                    f"train.logger={name} needs {extra}: pip install 'atom[{extra}]'"
                    + (" (it logs offline, no account needed)" if name == "wandb" else "")
                ) from None


def make_loggers(spec: str, run: Path, start_step: int, config: dict) -> list:
    check_available(spec)
    made: list = []
    try:
        for name in parse(spec):
            if name == "csv":
                made.append(CsvLogger(run, start_step))
            elif name == "tensorboard":
                made.append(TensorBoardLogger(run, start_step))
            elif name == "wandb":
                made.append(WandbLogger(run, config))
    except BaseException:
        for logger in made:
            logger.close()
        raise
    return made
