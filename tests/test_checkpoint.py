"""Tests for atom.store.checkpoint: round trip, pruning, re-saving, corruption, and SIGKILL safety.

Run: pytest tests/test_checkpoint.py
(the SIGKILL test is marked slow + multiprocess; deselect with -m "not slow")
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from atom.store import checkpoint as ckpt_mod
from atom.store.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tests.checkpoint_writer import expected_files

WRITER = Path(__file__).with_name("checkpoint_writer.py")


def _simple(step: int) -> list[tuple[str, dict[str, torch.Tensor]]]:
    return [
        ("a", {"a.w": torch.full((4, 4), float(step))}),
        ("b", {"b.w": torch.arange(6, dtype=torch.int64) + step}),
    ]


def _steps(path: Path) -> list[int]:
    return [int(d.name.removeprefix("step_")) for d in list_checkpoints(path)]


def _tmp_dirs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob(".tmp-*"))


def _assert_one_line_error(exc: pytest.ExceptionInfo[CheckpointError], *parts: str) -> None:
    msg = str(exc.value)
    assert "\n" not in msg
    for part in parts:
        assert part in msg, f"{part!r} not in {msg!r}"


# ----------------------------------------------------------------------------- round trip


def test_round_trip_dtypes_views_shared_storage(tmp_path: Path) -> None:
    base = torch.randn(8, 6)
    tensors_a = {
        "fp32": torch.randn(3, 5),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "int64": torch.arange(-5, 5, dtype=torch.int64),
        "transposed": base.t(),  # non-contiguous view
        "strided": base[::2, 1::2],  # non-contiguous view sharing base's storage
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
    }
    tensors_b = {"base": base, "row0": base[0], "row1": base[1]}  # all share one storage
    expected = {**tensors_a, **tensors_b}
    snapshot = {k: v.clone() for k, v in expected.items()}

    produced: list[str] = []

    def units():
        # Checks laziness: unit N is written to disk before unit N+1 is even requested.
        for stem, tensors in (("a", tensors_a), ("b", tensors_b)):
            for done in produced:
                assert list((tmp_path / "checkpoints").glob(f".tmp-*/{done}.safetensors"))
            produced.append(stem)
            yield stem, tensors

    meta = {"lr": 3e-4, "config": {"layers": 2, "name": "tiny"}, "tokens_seen": 12345}
    final = save_checkpoint(tmp_path, 7, units(), meta)

    assert final == tmp_path / "checkpoints" / "step_00000007"
    assert sorted(p.name for p in final.iterdir()) == [
        "a.safetensors",
        "b.safetensors",
        "meta.json",
    ]
    assert _tmp_dirs(tmp_path) == []
    for k, v in expected.items():  # the caller's tensors are untouched
        assert torch.equal(v, snapshot[k])

    ck = load_checkpoint(tmp_path)
    assert ck.path == final and ck.step == 7
    assert ck.meta["format_version"] == FORMAT_VERSION
    assert {k: ck.meta[k] for k in meta} == meta
    assert ck.meta["tensors"] == {**dict.fromkeys(tensors_a, "a"), **dict.fromkeys(tensors_b, "b")}
    for name, info in ck.meta["files"].items():
        assert (final / name).stat().st_size == info["bytes"]
    assert sorted(ck.names()) == sorted(expected)
    for name, want in expected.items():
        got = ck.get(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want), name
    many = ck.get_many(["row1", "bf16", "base"])
    assert list(many) == ["row1", "bf16", "base"]
    assert torch.equal(many["row1"], base[1])
    b = ck.stem_tensors("b")
    assert sorted(b) == ["base", "row0", "row1"] and torch.equal(b["row0"], base[0])


def test_path_forms_run_dir_checkpoints_dir_and_step_dir(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _simple(1), {})
    final = save_checkpoint(tmp_path, 2, _simple(2), {})
    for path in (tmp_path, tmp_path / "checkpoints", final):
        assert find_latest(path) == final
        assert load_checkpoint(path).step == 2
    older = tmp_path / "checkpoints" / "step_00000001"
    assert find_latest(older) == older and load_checkpoint(older).step == 1
    assert list_checkpoints(tmp_path) == list_checkpoints(tmp_path / "checkpoints")


def test_missing_tensor_and_stem_raise(tmp_path: Path) -> None:
    ck = load_checkpoint(save_checkpoint(tmp_path, 1, _simple(1), {}))
    with pytest.raises(CheckpointError) as exc:
        ck.get("nope")
    _assert_one_line_error(exc, "'nope'", str(ck.path))
    with pytest.raises(CheckpointError) as exc:
        ck.get_many(["a.w", "nope"])
    _assert_one_line_error(exc, "'nope'")
    with pytest.raises(CheckpointError) as exc:
        ck.stem_tensors("zzz")
    _assert_one_line_error(exc, "zzz.safetensors")


def test_invalid_arguments_write_nothing(tmp_path: Path) -> None:
    dup = [("a", {"x": torch.ones(2)}), ("b", {"x": torch.zeros(2)})]
    with pytest.raises(ValueError, match="'x'.*unique"):
        save_checkpoint(tmp_path, 1, dup, {})
    with pytest.raises(ValueError, match="stem"):
        save_checkpoint(tmp_path, 1, [("a", {"x": torch.ones(1)}), ("a", {"y": torch.ones(1)})], {})
    with pytest.raises(ValueError, match="stem"):
        save_checkpoint(tmp_path, 1, [("../evil", {"x": torch.ones(1)})], {})
    with pytest.raises(ValueError, match="reserved"):
        save_checkpoint(tmp_path, 1, _simple(1), {"files": 1})
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, 10**8, _simple(1), {})
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(tmp_path, 1, _simple(1), {}, keep=0)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, 1, _simple(1), {"bad": object()})
    assert list_checkpoints(tmp_path) == []
    assert _tmp_dirs(tmp_path) == []


# ----------------------------------------------------------------------------- durability


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to map fds to paths")
def test_fsync_and_rename_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    (tmp_path / "checkpoints").mkdir()
    final = save_checkpoint(tmp_path, 3, _simple(3), {})

    root = str(tmp_path / "checkpoints")
    tmp = f"{root}/.tmp-step_00000003-{os.getpid()}"
    assert events == [
        ("fsync", f"{tmp}/a.safetensors"),
        ("fsync", f"{tmp}/b.safetensors"),
        ("fsync", f"{tmp}/meta.json"),
        ("fsync", tmp),
        ("rename", str(final)),
        ("fsync", root),
    ]


# ----------------------------------------------------------------------------- pruning, re-save


def test_keep_prunes_oldest(tmp_path: Path) -> None:
    for step in range(1, 7):
        save_checkpoint(tmp_path, step, _simple(step), {}, keep=3)
        assert _steps(tmp_path) == list(range(max(1, step - 2), step + 1))
    save_checkpoint(tmp_path, 7, _simple(7), {}, keep=1)
    assert _steps(tmp_path) == [7]
    assert _tmp_dirs(tmp_path) == []


def test_keep_counts_only_valid_checkpoints(tmp_path: Path) -> None:
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, _simple(step), {}, keep=10)
    (list_checkpoints(tmp_path)[-1] / "a.safetensors").unlink()  # step 4 is now corrupt
    save_checkpoint(tmp_path, 5, _simple(5), {}, keep=2)
    # Newest two valid are 5 and 3; corrupt 4 lies between them so it stays for now.
    assert _steps(tmp_path) == [3, 4, 5]
    save_checkpoint(tmp_path, 6, _simple(6), {}, keep=2)
    assert _steps(tmp_path) == [5, 6]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "rename-aside"])
def test_resave_same_step_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        import atom.ground.atomic_dir

        monkeypatch.setattr(atom.ground.atomic_dir, "_exchange", lambda a, b: False)
    save_checkpoint(tmp_path, 1, _simple(1), {"v": "old"})
    save_checkpoint(tmp_path, 2, [("a", {"a.w": torch.zeros(3)})], {"v": "old"})
    final = save_checkpoint(tmp_path, 2, [("c", {"c.w": torch.ones(5)})], {"v": "new"})
    assert _steps(tmp_path) == [1, 2]
    assert _tmp_dirs(tmp_path) == []
    assert sorted(p.name for p in final.iterdir()) == ["c.safetensors", "meta.json"]
    ck = load_checkpoint(tmp_path)
    assert ck.meta["v"] == "new" and ck.names() == ["c.w"]
    assert torch.equal(ck.get("c.w"), torch.ones(5))


def test_failed_save_leaves_previous_state(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 1, _simple(1), {})

    def units():
        yield "a", {"a.w": torch.ones(2)}
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        save_checkpoint(tmp_path, 2, units(), {})
    assert _steps(tmp_path) == [1]
    assert _tmp_dirs(tmp_path) == []


def test_stale_tmp_dirs_of_dead_pids_are_removed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    root.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stale = [
            root / f".tmp-step_00000009-{dead_pid}",
            root / f".tmp-pruned-step_00000001-{dead_pid}",
        ]
        alive = root / f".tmp-step_00000009-{live.pid}"
        for d in (*stale, alive):
            d.mkdir()
            (d / "junk.safetensors").write_bytes(b"x" * 100)
        (root / "step_5").mkdir()  # names not matching step_\d{8} are ignored
        (root / "step_0000000x").mkdir()
        (root / "step_00000003").write_text("a file, not a dir")

        save_checkpoint(tmp_path, 2, _simple(2), {})
        assert _tmp_dirs(tmp_path) == [alive]
        assert _steps(tmp_path) == [2]
        assert (root / "step_5").is_dir()  # foreign names are left alone
    finally:
        live.kill()
        live.wait(timeout=10)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        save_checkpoint(tmp_path, 3, _simple(3), {})
    save_checkpoint(tmp_path, 4, _simple(4), {})
    assert _tmp_dirs(tmp_path) == []
    assert (root / "step_00000003").read_text() == "a file, not a dir"


# ----------------------------------------------------------------------------- corruption


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    files = [
        ("model", {"w": torch.randn(64, 64), "b": torch.randn(64)}),
        ("opt", {"m": torch.randn(64)}),
    ]
    return save_checkpoint(tmp_path, 5, files, {"note": "x"})


def _edit_meta(step_dir: Path, **changes) -> None:
    meta = json.loads((step_dir / "meta.json").read_text())
    meta.update(changes)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def test_truncated_file_refused(saved: Path) -> None:
    f = saved / "model.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 10)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(
        exc, str(saved), "model.safetensors", f"has {size - 10} bytes, expected {size}"
    )


def test_flipped_byte_refused_by_sha256(saved: Path) -> None:
    f = saved / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(exc, str(saved), "model.safetensors", "sha256")
    # verify=False only checks sizes: it opens (and would return the damaged data).
    assert load_checkpoint(saved, verify=False).step == 5


def test_missing_file_refused(saved: Path) -> None:
    (saved / "opt.safetensors").unlink()
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved, verify=False)
    _assert_one_line_error(exc, str(saved), "opt.safetensors is missing")


def test_bad_json_meta_refused(saved: Path) -> None:
    (saved / "meta.json").write_text('{"format_version": 1, "step": ')
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(exc, str(saved), "meta.json is not valid JSON")


def test_missing_meta_refused(saved: Path) -> None:
    (saved / "meta.json").unlink()
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(exc, str(saved), "meta.json is missing")


def test_wrong_format_version_refused(saved: Path) -> None:
    _edit_meta(saved, format_version=99)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(
        exc, str(saved), "format_version 99", f"reads format_version {FORMAT_VERSION}"
    )


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"step": 6}, "says step 6"),
        ({"files": {"../x.safetensors": {"bytes": 1, "sha256": "0" * 64}}}, "bad file name"),
        ({"tensors": {"w": "ghost"}}, "unknown file 'ghost'"),
    ],
)
def test_inconsistent_meta_refused(saved: Path, changes: dict, problem: str) -> None:
    _edit_meta(saved, **changes)
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(saved)
    _assert_one_line_error(exc, str(saved), problem)


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        find_latest(tmp_path)
    _assert_one_line_error(exc, f"no checkpoint found in {tmp_path}", "train first")
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError) as exc:
        load_checkpoint(tmp_path)
    _assert_one_line_error(exc, "no checkpoint found")
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError) as exc:
        find_latest(missing)
    _assert_one_line_error(exc, str(missing), "does not exist")


def test_find_latest_skips_corrupt_newest(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    older = save_checkpoint(tmp_path, 1, _simple(1), {})
    newest = save_checkpoint(tmp_path, 2, _simple(2), {})
    f = newest / "a.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))

    with caplog.at_level("WARNING", logger="atom.store.checkpoint"):
        assert find_latest(tmp_path) == older
    assert any(str(newest) in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records)
    ck = load_checkpoint(tmp_path)
    assert ck.step == 1 and torch.equal(ck.get("a.w"), torch.full((4, 4), 1.0))
    with pytest.raises(CheckpointError, match="sha256"):  # an explicit step dir must verify
        find_latest(newest)

    (older / "meta.json").write_text("not json")
    with pytest.raises(CheckpointError) as exc:
        find_latest(tmp_path)
    _assert_one_line_error(exc, "all 2 failed verification", str(newest))


# ----------------------------------------------------------------------------- SIGKILL


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line.strip())
    lines.put(None)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_mid_write_always_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20240611)
    rounds, keep = 15, 2
    deadline = time.monotonic() + 90  # generous cap; the test normally takes ~15 s
    prev_step = 0
    for rnd in range(rounds):
        assert time.monotonic() < deadline, f"kill test over time at round {rnd}"
        # A third of the kills come right after the first save, the rest at random points;
        # a save takes ~20 ms, so most kills land inside one.
        delay = rng.uniform(0, 0.002) if rnd % 3 == 0 else rng.uniform(0.005, 0.25)
        stderr_path = tmp_path / f"writer-{rnd}.err"
        lines: queue.Queue[str | None] = queue.Queue()
        with open(stderr_path, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, str(WRITER), str(tmp_path / "run"), "60"],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        reader = threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True)
        try:
            reader.start()
            first = lines.get(timeout=30)
            assert first is not None and first.startswith("saved "), stderr_path.read_text()
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            reader.join(timeout=10)
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, stderr_path.read_text()

        printed = [int(first.split()[1])]
        while (line := lines.get_nowait()) is not None:
            assert re.fullmatch(r"saved \d+", line), line
            printed.append(int(line.split()[1]))
        last = max(printed)

        latest = find_latest(tmp_path / "run")
        ck = load_checkpoint(latest, verify=True)
        # The kill may land after a save completed but before its "saved" line was printed.
        assert last <= ck.step <= last + 1 and ck.step >= prev_step
        for stem, want in expected_files(ck.step):
            got = ck.stem_tensors(stem)
            assert sorted(got) == sorted(want)
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), (ck.step, name)
        # No kill can leave a broken step dir: every one listed verifies, and pruning lags
        # by at most the one save that was interrupted.
        listed = list_checkpoints(tmp_path / "run")
        assert 1 <= len(listed) <= keep + 1
        for d in listed:
            load_checkpoint(d, verify=True)
        # Leftovers belong only to the writer just killed; earlier ones were cleaned by it.
        for d in _tmp_dirs(tmp_path / "run"):
            assert d.name.endswith(f"-{proc.pid}"), d
        prev_step = ck.step


_OUT_OF_FILES_SCRIPT = r"""
import errno, json, os, resource, sys
from pathlib import Path
import torch
from atom.store.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

run = Path(sys.argv[1])
save_checkpoint(run, 1, [("a", {"a.w": torch.ones(8)})], {})
ckpt = load_checkpoint(run)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
outcome = {}
for what, act in [("save", lambda: save_checkpoint(run, 2, [("a", {"a.w": torch.zeros(8)})], {})),
                  ("read", lambda: ckpt.get("a.w"))]:
    try:
        act()
        outcome[what] = "ok"
    except CheckpointError as e:
        outcome[what] = [getattr(e, "errno", None), str(e)]
    except Exception as e:
        outcome[what] = ["other", type(e).__name__, str(e)]
for fd in held:
    os.close(fd)
outcome["after"] = float(load_checkpoint(run).get("a.w").sum())
save_checkpoint(run, 3, [("a", {"a.w": torch.zeros(8)})], {})  # clears what step 2 left
outcome["left"] = sorted(p.name for p in (run / "checkpoints").iterdir())
print(json.dumps(outcome))
"""


def test_out_of_open_files_is_a_system_refusal_not_a_traceback_or_corruption(
    tmp_path: Path,
) -> None:
    """safetensors reports an I/O error as SafetensorError with the OS error in its text: a
    save or a read that ran out of file handles must come out as a CheckpointError carrying
    EMFILE (the trainer retries those), leave no half-written directory and not call a good
    checkpoint corrupt."""
    import errno

    done = subprocess.run(
        [sys.executable, "-c", _OUT_OF_FILES_SCRIPT, str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["save"][0] == errno.EMFILE, out
    assert "open-file limit" in out["save"][1] and "untouched" in out["save"][1]
    assert out["read"][0] == errno.EMFILE, out
    assert "corrupt" not in out["read"][1] and "intact" in out["read"][1]
    assert out["after"] == 8.0
    assert out["left"] == ["step_00000001", "step_00000003"]  # no half checkpoint, no temp


def test_a_writer_error_that_is_no_io_failure_is_not_called_a_disk_problem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import SafetensorError

    save_checkpoint(tmp_path, 1, _simple(1), {})

    def refuse(*args, **kwargs):
        raise SafetensorError("Error while serializing: a dtype it does not know")

    monkeypatch.setattr(ckpt_mod, "save_file", refuse)
    with pytest.raises(SafetensorError, match="dtype it does not know"):
        save_checkpoint(tmp_path, 2, _simple(2), {})
    assert _steps(tmp_path) == [1] and _tmp_dirs(tmp_path) == []


def test_a_file_that_is_there_but_would_not_open_is_not_called_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """safe_open calls every failure to open 'No such file or directory'; when the file is
    there and opens again by the time we look (a handle shortage that just ended), the
    checkpoint is not declared corrupt (whose advice is to delete it)."""
    save_checkpoint(tmp_path, 1, _simple(1), {})
    ckpt = load_checkpoint(tmp_path)

    def not_now(path, **kwargs):
        raise FileNotFoundError(f"No such file or directory: {path!r}")

    monkeypatch.setattr(ckpt_mod, "safe_open", not_now)
    with pytest.raises(CheckpointError) as err:
        ckpt.get("a.w")
    assert "corrupt" not in str(err.value) and "try again" in str(err.value)
    (ckpt.path / "a.safetensors").unlink()  # really gone: that is damage
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.get("a.w")


def test_a_small_file_written_atomically_is_never_seen_half_written(tmp_path):
    """write_text_atomic (config.json, gossip.json): a reader racing 300 rewrites sees the
    old text or the new, never a part (a plain write_text shows an empty or cut file)."""
    import threading

    from atom.ground.atomic_dir import write_text_atomic

    path = tmp_path / "config.json"
    texts = ["a" * 300_000 + "\n", "b" * 200_000 + "\n"]
    write_text_atomic(path, texts[0])
    done = threading.Event()

    def writer():
        for k in range(300):
            write_text_atomic(path, texts[k % 2])
        done.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    while not done.is_set():
        text = path.read_text()
        assert text in texts, f"a reader saw {len(text)} characters"
    thread.join(timeout=30)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]  # no temporary left
