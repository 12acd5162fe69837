"""Byte sizes typed by users: one parser for --gpu-mem, --host-mem and --max-shard-size."""

from __future__ import annotations

import pytest

from atom.config import ConfigError
from atom.ground.sizes import parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1234, 1234),
        (0, 0),
        ("1234", 1234),
        ("512B", 512),
        ("24GiB", 24 * 2**30),
        ("24gib", 24 * 2**30),
        ("24 GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2Ti", 2 * 2**40),
        ("12GB", 12 * 10**9),
        ("5GB", 5 * 10**9),  # transformers' max_shard_size: decimal gigabytes
        ("30KB", 30_000),
        ("500M", 500 * 10**6),
        ("1e9", 10**9),
        ("1.5e3", 1500),
        ("0.1GB", 10**8),  # no float rounding down to 99999999
        (" 2 TB ", 2 * 10**12),
    ],
)
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12XB", "abc", "-1GB", "1..5GB", -1, True, None, "nan"])
def test_parse_bytes_refuses_with_one_line_naming_the_value(text) -> None:
    with pytest.raises(ConfigError) as err:
        parse_bytes(text, "--gpu-mem")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("--gpu-mem: ") and repr(text) in msg


def test_callers_share_the_parser() -> None:
    from atom.profiler import hardware

    assert hardware.parse_bytes is parse_bytes
