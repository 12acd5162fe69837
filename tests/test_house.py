"""The floors of docs/architecture.md hold: no module imports from a floor above its own
(imports inside functions count), and nothing below the CLI prints or exits.

    pytest tests/test_house.py
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# floor of each module or package (the longest matching prefix wins)
FLOORS = {
    "atom.errors": 0, "atom.config": 0, "atom.sizes": 0, "atom.device": 0,
    "atom.engine_protocol": 0, "atom.threads": 0,
    "atom.model": 1, "atom.optim": 1,
    "atom.text": 1,
    "atom.tokenize": 1, "atom.checkpoint": 1, "atom.run_dir": 1, "atom.atomic_dir": 0,
    "atom.swap": 2, "atom.resident": 2, "atom.data": 2, "atom.hf": 2, "atom.gossip.net": 2,
    "atom.loggers": 2,
    "atom.gossip": 3, "atom.profiler": 3, "atom.run_config": 3,
    "atom.train": 4, "atom.run_log": 4, "atom.signals": 4, "atom.evaluate": 4,
    "atom.generate": 4, "atom.plot": 4, "atom.guard": 4,
    "atom.cli": 5, "atom": 5,
}  # fmt: skip


def floor_of(module: str) -> int | None:
    best = None
    for prefix in FLOORS:
        if (module == prefix or module.startswith(prefix + ".")) and (
            best is None or len(prefix) > len(best)
        ):
            best = prefix
    return None if best is None else FLOORS[best]


def modules():
    """(dotted name, tree) of every module; profiler/ installs as atom.profiler."""
    for top in ("atom", "profiler"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            name = "atom." + name if top == "profiler" else name
            yield name.removesuffix(".__init__"), ast.parse(path.read_text())


def test_every_module_has_a_floor():
    assert [name for name, _ in modules() if floor_of(name) is None] == []


def test_no_module_imports_from_a_floor_above_its_own():
    upward = []
    for name, tree in modules():
        mine = floor_of(name)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                theirs = floor_of(target)
                if theirs is not None and theirs > mine:
                    upward.append(f"{name} (floor {mine}) imports {target} (floor {theirs})")
    assert upward == []


def test_nothing_below_the_cli_prints_or_exits():
    found = []
    for name, tree in modules():
        if floor_of(name) == 5:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                owner = getattr(getattr(f, "value", None), "id", "")
                if called == "print" or (owner == "sys" and called == "exit"):
                    found.append(f"{name}:{node.lineno} {owner + '.' if owner else ''}{called}")
    assert found == []


def test_every_package_is_installed():
    """pyproject lists its packages (configs/ installs as atom.configs): a new one left off
    the list would be missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])  # fmt: skip
    found = {
        ("atom." if top == "profiler" else "") + ".".join(p.relative_to(ROOT).parts)
        for top in ("atom", "profiler")
        for p in [ROOT / top, *(ROOT / top).rglob("*")]
        if p.is_dir() and any(p.glob("*.py"))
    }
    assert found <= listed and "atom.configs" in listed, sorted(found - listed)


@pytest.mark.slow
def test_a_non_editable_install_runs_from_anywhere(tmp_path):
    """`pip install .` (not editable): named configs are found, training and profiling run
    from another directory (configs/ used to be looked up outside the package), and the
    profiler is atom.profiler (it was a top-level `profiler`)."""
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if build.returncode != 0 and "No module named" in build.stderr:
        pytest.skip(f"cannot build here: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-2000:]
    # the profiler installs under atom's name, from profiler/ (not the checkout's shim)
    assert not (site / "profiler").exists() and (site / "atom" / "profiler" / "cost.py").exists()
    assert "__path__" not in (site / "atom" / "profiler" / "__init__.py").read_text()
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not the checkout
    for argv in (
        ["train", "--config", "gpt2-124m", "--max-steps", "1", "--set", "model.n_layer=2",
         "--set", "model.d_model=64", "--set", "model.n_head=2", "--set", "model.seq_len=64",
         "--set", "train.micro_batch=2", "--set", "train.eval_batches=1", "--no-progress"],
        ["profile", "--config", "llama-7b", "--gpu-mem", "24GiB", "--hardware", "rtx4090"],
    ):  # fmt: skip
        code = ("import atom, sys; print(atom.__file__); from atom.cli import main; "
                "sys.exit(main(sys.argv[1:]))")  # fmt: skip
        run = subprocess.run([sys.executable, "-c", code, *argv], cwd=away, env=env,
                             capture_output=True, text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.startswith(str(site)), run.stdout[:200]  # the installed copy ran


def test_no_module_is_over_600_lines():
    """A module the next engineer can read in one sitting (the house rule; engine.py was 645)."""
    long = []
    for top in ("atom", "profiler", "tools"):
        for path in (ROOT / top).rglob("*.py"):
            n = len(path.read_text().splitlines())
            if n > 600:
                long.append(f"{path.relative_to(ROOT)} ({n})")
    assert long == []
