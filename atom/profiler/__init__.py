"""`atom profile`'s code, installed as atom.profiler (pyproject maps the checkout's
top-level profiler/ here, so no top-level module of that generic name is installed).

This file serves a checkout run without installing (`PYTHONPATH=. python -m atom.cli`,
as on the GPU machine): the package's modules are read from profiler/ beside atom/. An
install never sees it: the mapped profiler/ is the package there.
"""

from pathlib import Path

__path__ = [str(Path(__file__).resolve().parents[2] / "profiler")]
