"""docs/config.md from the config dataclasses (keys, defaults) and atom/config/describe.py
(what each key does): `python -m tools.config_reference` rewrites it; tests/test_docs.py
fails when a key has no description or the page differs from what this writes."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields

from atom.config import Config
from atom.config.describe import DESCRIPTIONS
from tools import ROOT

PAGE = ROOT / "docs" / "config.md"

HEAD = """# Configuration reference

A config is YAML with four sections (`model`, `train`, `swap`, `gossip`): a file or a name
from `configs/` given to `--config` (the built-in default is the tiny model), and any key
can be set on the command line with `--set section.key=value` (repeatable). `--resume`
continues with the config saved in the run. A value of the wrong type, out of range or a
key that does not exist is refused in one line before anything runs.

This page is generated from atom/config (`python -m tools.config_reference`); a test fails
when a key is added without a line here.
"""


def _default(f) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if value == "":
        return '""'
    return str(value)


def config_keys() -> list[tuple[str, str]]:
    """(section.key, default) of every config key, in the dataclasses' order."""
    out = []
    for section in fields(Config):
        for f in fields(section.default_factory()):  # type: ignore[misc]
            out.append((f"{section.name}.{f.name}", _default(f)))
    return out


def render() -> str:
    parts, section = [HEAD], None
    for key, default in config_keys():
        name = key.split(".")[0]
        if name != section:
            section = name
            parts.append(f"\n## {name}\n\n| key | default | what it does |\n|---|---|---|")
        said = DESCRIPTIONS.get(key, "(no description: add one in atom/config/describe.py)")
        parts.append(f"| `{key}` | `{default}` | {said} |")
    return "\n".join(parts) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = p.parse_args()
    text = render()
    if args.check:
        return 0 if PAGE.read_text() == text else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE} ({len(config_keys())} keys)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
