"""Save checkpoints in a loop so that tests/test_checkpoint.py can SIGKILL it mid-write.

Usage: python tests/checkpoint_writer.py RUN_DIR [MAX_SECONDS]

Continues from the newest step under RUN_DIR, saves every step twice (the second save
replaces the first, exercising the re-save path) with keep=2, and prints "saved STEP" after
each save. Tensor values are a deterministic function of the step (expected_files), so a
reader can check content. Exits on its own after MAX_SECONDS (default 120) in case the test
that started it died without killing it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch


def expected_files(step: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """About 3.5 MB in three files, yielded one file at a time like a trainer's units."""
    gen = torch.Generator().manual_seed(step)
    yield "embed", {"embed.weight": torch.randn(256, 1024, generator=gen)}
    yield (
        "block_0",
        {
            "block_0.w": torch.randn(384, 1024, generator=gen),
            "block_0.norm": torch.randn(1024, generator=gen).to(torch.bfloat16),
        },
    )
    yield (
        "head",
        {
            "head.weight": torch.randn(256, 1024, generator=gen),
            "head.step": torch.tensor([step], dtype=torch.int64),
        },
    )


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        sys.stderr.write(__doc__ or "")
        return 2
    # Run as a script from any cwd, whether or not atom is installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from atom.store.checkpoint import list_checkpoints, save_checkpoint

    run_dir = Path(argv[1])
    max_seconds = float(argv[2]) if len(argv) == 3 else 120.0
    existing = list_checkpoints(run_dir)
    step = int(existing[-1].name.removeprefix("step_")) + 1 if existing else 1
    deadline = time.monotonic() + max_seconds
    while time.monotonic() < deadline:
        for _ in range(2):
            save_checkpoint(run_dir, step, expected_files(step), {"pid": os.getpid()}, keep=2)
            print(f"saved {step}", flush=True)
        step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
