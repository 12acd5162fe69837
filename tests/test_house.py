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

# floor of each folder (the longest matching prefix wins): a module's floor is its folder's
FLOORS = {
    "atom.ground": 0, "atom.config": 0,
    "atom.model": 1, "atom.optim": 1, "atom.text": 1, "atom.store": 1,
    "atom.swap": 2, "atom.resident": 2, "atom.data": 2, "atom.hf": 2, "atom.gossip.net": 2,
    "atom.gossip": 3, "atom.profiler": 3,
    "atom.run": 4, "atom.commands": 4,
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


def test_every_floor_is_a_folder():
    """The floors are folders: each key above is a package (its own directory), and atom/'s
    top level holds packages and at most a few modules."""

    def folder(name):
        parts = name.split(".")[1:]  # profiler/ installs as atom.profiler
        return ROOT / Path(*parts) if parts[:1] == ["profiler"] else ROOT / "atom" / Path(*parts)

    assert [n for n in FLOORS if not (folder(n) / "__init__.py").is_file()] == []
    assert len(list((ROOT / "atom").glob("*.py"))) <= 6
    assert len(list((ROOT / "tools").glob("*.py"))) <= 10


def test_the_architecture_table_names_the_folders():
    """docs/architecture.md's floor table lists, floor by floor, the folders FLOORS holds."""
    import re

    table = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        row = re.match(r"\| (\d)\. [^|]+\| (.*?) \|", line)
        if row:
            table[int(row.group(1))] = set(re.findall(r"`(\w+(?:/\w+)*)/`", row.group(2)))
    wanted = {}
    for name, floor in FLOORS.items():
        if name != "atom":
            wanted.setdefault(floor, set()).add(name.removeprefix("atom.").replace(".", "/"))
    assert table == wanted


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
