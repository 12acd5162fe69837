"""tools/hardware_table: the README's table of cards x host RAM comes from the profiler."""

from __future__ import annotations

import re

from atom.profiler.hardware import PRESETS, stated
from tools import hardware_table


def test_every_card_of_the_table_is_a_preset_with_a_plan(capsys):
    assert hardware_table.main(["--config", "tiny", "--batch", "4", "--hosts", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| RTX")]
    assert len(rows) == len(hardware_table.CARDS)
    for card, row in zip(hardware_table.CARDS, rows, strict=True):
        assert row.startswith(f"| {PRESETS[card]['name']} |")
        assert re.search(r"\| [\d,]+ \((compute|bus|host)-bound; (fp32|compact)", row), row


def test_a_host_too_small_says_how_much_ram_the_model_needs(capsys):
    # a GPT (tied embeddings: no tiered plan, which fits any RAM with a disk beside it)
    args = ["--config", "gpt3-350m", "--batch", "2", "--hosts", "1", "--cards", "rtx3060"]
    assert hardware_table.main(args) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| RTX")]
    assert re.search(r"does not fit: needs [\d.]+ GiB of RAM", row[0]), row


def test_the_presets_rates_are_measured_rates_scaled_once():
    """A faster card is predicted faster; copies in both directions are slower than one."""
    a, b = stated("rtx3060"), stated("rtx4090")
    assert b.matmul_flops > 5 * a.matmul_flops
    for name in hardware_table.CARDS:
        hw = stated(name)
        assert hw.duplex_h2d_bps < hw.h2d_bps and hw.device == "cuda"


def test_the_model_table_names_torchtune_beside_each_model(capsys):
    """--models: a row per model on one card, with what torchtune runs on one card; a tiered
    plan's cell says so and what it writes to the disk."""
    args = ["--models", "llama-1b", "codellama-34b", "--cards", "rtx4090", "--hosts", "32",
            "--batch", "8"]  # fmt: skip
    assert hardware_table.main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0] == "| model | 32 GiB RAM | torchtune, one card |"
    assert rows[1].startswith("| llama-1b | ") and rows[1].endswith("| - |")
    big = rows[2]
    assert "tiered; writes" in big and "of 600 TBW a day" in big
    assert big.endswith(f"| {hardware_table.TORCHTUNE['codellama-34b']} |")
