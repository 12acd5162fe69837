"""Atomic, verifiable training checkpoints: one safetensors file per unit plus meta.json.

Layout: RUN_DIR/checkpoints/step_00001234/{stem}.safetensors + meta.json.

A step_* directory only ever appears through an atomic rename of a fully written and fsync'd
temp directory, so a process killed at any instant leaves either the old state or the new one.
meta.json records the byte size and sha256 of every file, so damage that happens later (disk
errors, a truncated copy, a hand edit) is caught before a run resumes from it.
Only safetensors and JSON are read: a checkpoint can never execute code (no pickle).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from atom.ground.atomic_dir import fsync_dir, publish
from atom.ground.errors import CheckpointError  # noqa: F401  (re-exported: callers import it from here too)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1

CHECKPOINTS_DIR = "checkpoints"
META_NAME = "meta.json"
_SUFFIX = ".safetensors"
_STEP_RE = re.compile(r"^step_(\d{8})$")
# Temp dirs end in the writer's pid so a later writer can tell a dead writer's leftovers
# from a directory that a live process is still filling.
_TMP_RE = re.compile(r"^\.tmp-.+-(\d+)$")
_STEM_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_RESERVED = ("format_version", "step", "files", "tensors")
_MAX_STEP = 99_999_999  # step_{:08d} must stay 8 digits or list_checkpoints would not see it
_HASH_CHUNK = 8 << 20


# ----------------------------------------------------------------------------- writing


def save_checkpoint(
    run_dir: Path,
    step: int,
    files: Iterable[tuple[str, dict[str, torch.Tensor]]],
    meta: dict,
    keep: int = 3,
) -> Path:
    """Write run_dir/checkpoints/step_{step:08d}/ atomically, then prune old checkpoints.

    `files` is consumed lazily, one (stem, tensors) unit at a time, so the extra RAM needed is
    one unit's tensors. Returns the final checkpoint directory.
    """
    if not 0 <= step <= _MAX_STEP:
        raise ValueError(f"step must be in 0..{_MAX_STEP}, got {step}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    clash = sorted(set(meta) & set(_RESERVED))
    if clash:
        raise ValueError(f"meta keys {clash} are reserved by the checkpoint format; rename them")
    json.dumps(meta)  # fail before writing gigabytes if meta is not JSON-serialisable

    started = time.monotonic()
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        root.mkdir(parents=True, exist_ok=True)
        fsync_dir(root.parent)
    final = root / f"step_{step:08d}"
    if final.exists() and not final.is_dir():  # never swap our dir with a foreign file
        raise CheckpointError(
            f"{final} exists and is not a checkpoint directory; move it away and save again"
        )
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():  # left by an earlier failed save in this same process
        shutil.rmtree(tmp)
        _left_behind.discard(tmp)
    tmp.mkdir()
    try:
        file_info, owner = _write_files(tmp, files)
        doc = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "files": file_info,
            "tensors": owner,
            **meta,
        }
        # meta.json goes last: with it every file is final, so it marks the dir as complete.
        _write_json(tmp / META_NAME, doc)
        fsync_dir(tmp)
        replaced = publish(tmp, final)
    except OSError as err:
        _discard(tmp)
        raise _save_failed(err, final, root) from None
    except BaseException:
        _discard(tmp)
        raise
    fsync_dir(root)  # make the rename itself durable
    if replaced is not None:
        _discard(replaced)
    try:
        _prune(root, keep, final)
    except OSError as e:  # the checkpoint is safely written; a failed cleanup must not undo that
        log.warning("checkpoint %s saved, but pruning old checkpoints failed: %s", final, e)
    total = sum(info["bytes"] for info in file_info.values())
    log.info(
        "saved checkpoint %s (%d files, %.1f MB) in %.2fs",
        final,
        len(file_info),
        total / 1e6,
        time.monotonic() - started,
    )
    return final


# what a user can do about a save that the system refused
_SAVE_FIXES = {
    errno.ENOSPC: "free space on that disk or lower train.keep_checkpoints",
    errno.EDQUOT: "free space in your quota or lower train.keep_checkpoints",
    errno.EMFILE: "raise the open-file limit (ulimit -n) or run fewer peers in this process",
    errno.ENFILE: "the system is out of file handles: close other programs",
    errno.EROFS: "the disk is read-only: train with another --out",
    errno.EACCES: "make the run directory writable, or train with another --out",
}


# refusals that say nothing about a file's content (a read can fail for them too)
_READ_FIXES = {
    errno.EMFILE: _SAVE_FIXES[errno.EMFILE],
    errno.ENFILE: _SAVE_FIXES[errno.ENFILE],
    errno.EACCES: "make the checkpoint readable by this user",
    errno.ENOMEM: "free memory (the file is mapped to read it)",
}
_OS_ERROR_RE = re.compile(r"\(os error (\d+)\)")


def _as_os_error(e: BaseException) -> OSError | None:
    """safetensors' Rust core raises SafetensorError with the OS error only in its text
    ('I/O error: Too many open files (os error 24)'); an OSError with that errno lets a
    caller tell a full disk or a file-handle shortage from a bad file. None when the
    error names no OS error (not an I/O failure: leave it as it is)."""
    if isinstance(e, OSError):
        return e
    found = _OS_ERROR_RE.search(str(e))
    if found is None:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _refusal_behind(e: BaseException, file: Path) -> OSError | None:
    """The system refusal behind a failed read, if it was one. safe_open reports any
    failure to open as 'No such file or directory', so the file is opened again here to
    learn the real reason."""
    failed = _as_os_error(e)
    if failed is not None and failed.errno in _READ_FIXES:
        return failed
    try:
        os.close(os.open(file, os.O_RDONLY))
    except OSError as probe:
        if probe.errno in _READ_FIXES:
            return probe
    return None


def _save_failed(err: OSError, final: Path, root: Path) -> CheckpointError:
    """One line: what failed, what is still safe, what to do. A system refusal (disk full,
    too many open files) is the user's to fix; the half-written directory is gone (or, when
    not even its removal could open a handle, removed by the next save)."""
    try:
        kept = [p for p in list_checkpoints(root) if p != final]
        safe = f"the previous checkpoint {kept[-1]} is intact" if kept else "no earlier checkpoint"
    except OSError:  # listing needs a file handle too
        safe = "earlier checkpoints are untouched"
    fix = _SAVE_FIXES.get(err.errno, "check the disk and the run directory")
    error = CheckpointError(
        f"could not save checkpoint {final} ({err.strerror or err}); {safe}; {fix}"
    )
    error.errno = err.errno  # the trainer retries a save that ran out of open files
    return error


def _write_files(
    tmp: Path, files: Iterable[tuple[str, dict[str, torch.Tensor]]]
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    file_info: dict[str, dict[str, Any]] = {}
    owner: dict[str, str] = {}
    for stem, tensors in files:
        if not isinstance(stem, str) or not _STEM_RE.match(stem):
            raise ValueError(f"file stem {stem!r} must match {_STEM_RE.pattern}")
        name = stem + _SUFFIX
        if name in file_info:
            raise ValueError(f"file stem {stem!r} is given twice; stems must be unique")
        prepared: dict[str, torch.Tensor] = {}
        for tname, tensor in tensors.items():
            if tname in owner:
                raise ValueError(
                    f"tensor name {tname!r} appears in both {owner[tname]!r} and {stem!r}; "
                    "tensor names must be unique across files"
                )
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{stem}/{tname} is a {type(tensor).__name__}, not a tensor")
            owner[tname] = stem
            # safetensors refuses non-contiguous tensors and tensors sharing storage; a fresh
            # contiguous CPU copy satisfies both and cannot change under us while writing.
            prepared[tname] = tensor.detach().to(
                "cpu", copy=True, memory_format=torch.contiguous_format
            )
        # Drop references before the generator produces the next unit, so peak is one unit.
        del tensors
        path = tmp / name
        try:
            save_file(prepared, str(path))
        except SafetensorError as e:  # the Rust writer's I/O errors are no OSError
            failed = _as_os_error(e)
            if failed is None:
                raise
            raise failed from e
        del prepared
        file_info[name] = _sync_and_hash(path)
    return file_info, owner


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _sync_and_hash(path: Path) -> dict[str, Any]:
    # Hash the written file (normally still in page cache) instead of serialising to bytes in
    # RAM first, which would double the peak memory of a unit.
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    size, sha = _hash_file(path)
    return {"bytes": size, "sha256": sha}


def _hash_file(path: Path) -> tuple[int, str]:
    # Chunked so that hashing a multi-GB file needs only one small buffer.
    h = hashlib.sha256()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _prune(root: Path, keep: int, current: Path) -> None:
    _remove_stale_tmp(root)
    dirs = list_checkpoints(root)
    valid = 0
    for i in range(len(dirs) - 1, -1, -1):
        # Sizes only, no hashing: re-hashing every kept checkpoint on each save would cost
        # minutes for a large model; the one just written is valid by construction.
        if dirs[i] == current or _quick_problem(dirs[i]) is None:
            valid += 1
            if valid == keep:
                for old in dirs[:i]:
                    _remove_dir(old)
                return


def _remove_dir(path: Path) -> None:
    # Rename first so a kill mid-delete leaves a .tmp-* dir (cleaned later), never a
    # half-deleted step_* dir that looks like a checkpoint.
    doomed = path.with_name(f".tmp-pruned-{path.name}-{os.getpid()}")
    os.rename(path, doomed)
    _discard(doomed)
    log.info("pruned old checkpoint %s", path)


# temp dirs of this process whose removal failed (out of file handles): the next save's
# prune removes them (another process's are removed once that process is dead)
_left_behind: set[Path] = set()


def _discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():  # removing needs file handles too; stat does not
        _left_behind.add(tmp)


def _remove_stale_tmp(root: Path) -> None:
    # Pid liveness is per host: on a filesystem shared by several hosts each host should use
    # its own run dir, or a live writer elsewhere could lose its temp dir.
    for entry in root.iterdir():
        m = _TMP_RE.match(entry.name)
        if not m or not entry.is_dir():
            continue
        pid = int(m.group(1))
        if entry in _left_behind:
            _left_behind.discard(entry)
            _discard(entry)  # noted again if it still cannot go
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s left by dead writer pid %d", entry, pid)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:  # os.kill(0, ...) would signal our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists but belongs to another user
        return True
    return True


# ----------------------------------------------------------------------------- reading


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says (step_00000300: 300), None for other names."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(path: Path) -> list[Path]:
    """Step dirs under a run dir or its checkpoints/ dir, oldest to newest."""
    path = Path(path)
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    if not root.is_dir():
        return []
    found = [e for e in root.iterdir() if step_of(e) is not None and e.is_dir()]
    return sorted(found, key=step_of)


def find_latest(path: Path) -> Path:
    """Newest checkpoint under path that verifies (sizes and sha256); corrupt newer ones skipped."""
    return _resolve(Path(path), verify=True)[0]


def load_checkpoint(path: Path, verify: bool = True, fall_back: bool = True) -> Checkpoint:
    """Open a checkpoint: a step dir, or the newest usable one under a run/checkpoints dir.

    verify=True hashes every file (sha256); verify=False only checks meta.json and file sizes,
    which is instant but misses damage that keeps the size. fall_back=False: a run's newest
    checkpoint or nothing (a resume: a damaged newest one is the user's to know of, not to
    be skipped past by training from an older one and setting the damaged one aside).
    """
    return Checkpoint(*_resolve(Path(path), verify, fall_back))


class Checkpoint:
    """An opened checkpoint; tensors are read from disk only when asked for."""

    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.meta = meta
        self.step: int = meta["step"]
        self._owner: dict[str, str] = dict(meta["tensors"])

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, step={self.step}, tensors={len(self._owner)})"

    def names(self) -> list[str]:
        return list(self._owner)

    def get(self, name: str) -> torch.Tensor:
        return self.get_many([name])[name]

    def get_many(self, names: list[str]) -> dict[str, torch.Tensor]:
        by_stem: dict[str, list[str]] = {}
        for name in names:
            stem = self._owner.get(name)
            if stem is None:
                raise CheckpointError(
                    f"checkpoint {self.path} has no tensor {name!r} "
                    f"({len(self._owner)} tensors stored); check the name against names()"
                )
            by_stem.setdefault(stem, []).append(name)
        out: dict[str, torch.Tensor] = {}
        for stem, group in by_stem.items():
            out.update(self._read(stem, group))
        return {name: out[name] for name in names}

    def stem_tensors(self, stem: str) -> dict[str, torch.Tensor]:
        if stem + _SUFFIX not in self.meta["files"]:
            stems = sorted(n.removesuffix(_SUFFIX) for n in self.meta["files"])
            raise CheckpointError(
                f"checkpoint {self.path} has no file {stem + _SUFFIX!r}; stems are {stems}"
            )
        return self._read(stem, [n for n, s in self._owner.items() if s == stem])

    def _read(self, stem: str, names: list[str]) -> dict[str, torch.Tensor]:
        file = self.path / (stem + _SUFFIX)
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                return {name: f.get_tensor(name) for name in names}
        except (SafetensorError, OSError) as e:
            failed = _refusal_behind(e, file)
            if failed is not None:  # the system said no: the file may well be fine
                error = CheckpointError(
                    f"could not read {file} ({failed.strerror}); the checkpoint is intact; "
                    f"{_READ_FIXES[failed.errno]}"
                )
                error.errno = failed.errno
                raise error from e
            if isinstance(e, FileNotFoundError) and file.is_file():
                # safe_open's word for any failure to open, and the file is there: a
                # refusal that passed before our probe, not a reason to delete a checkpoint
                raise CheckpointError(
                    f"could not open {file} (it is there: {_one_line(e)}); the checkpoint is "
                    "not known to be damaged; try again"
                ) from e
            raise _corrupt(self.path, f"cannot read {file.name} ({_one_line(e)})") from e


def _resolve(path: Path, verify: bool, fall_back: bool = True) -> tuple[Path, dict[str, Any]]:
    if path.is_dir() and (_STEP_RE.match(path.name) or (path / META_NAME).exists()):
        return path, _check(path, verify)  # an explicit step dir must itself be usable
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint found in {path}: the path does not exist; "
            "pass a run directory containing checkpoints/"
        )
    candidates = list_checkpoints(path)
    if not candidates:
        raise CheckpointError(
            f"no checkpoint found in {path}; train first or pass a run directory "
            "containing checkpoints/"
        )
    if not fall_back:
        return candidates[-1], _check(candidates[-1], verify)
    newest_error: CheckpointError | None = None
    for d in reversed(candidates):
        try:
            return d, _check(d, verify)
        except CheckpointError as e:
            log.warning("skipping unusable checkpoint: %s", e)
            newest_error = newest_error or e
    raise CheckpointError(
        f"no usable checkpoint in {path}: all {len(candidates)} failed verification; "
        f"newest: {newest_error}"
    )


def _check(d: Path, full: bool) -> dict[str, Any]:
    """Parse meta.json and check every file's size, plus its sha256 when full."""
    doc = _read_meta(d)
    for name, info in doc["files"].items():
        file = d / name
        if not file.is_file():
            raise _corrupt(d, f"{name} is missing")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise _corrupt(d, f"{name} has {size} bytes, expected {info['bytes']}")
        if full:
            _, sha = _hash_file(file)
            if sha != info["sha256"]:
                raise _corrupt(
                    d, f"{name} has sha256 {sha[:16]}..., expected {info['sha256'][:16]}..."
                )
    return doc


def _quick_problem(d: Path) -> str | None:
    try:
        _check(d, full=False)
    except CheckpointError as e:
        return str(e)
    return None


def _read_meta(d: Path) -> dict[str, Any]:
    try:
        text = (d / META_NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _corrupt(d, f"{META_NAME} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _corrupt(d, f"cannot read {META_NAME} ({_one_line(e)})") from e
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _corrupt(d, f"{META_NAME} is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise _corrupt(d, f"{META_NAME} is not a JSON object")
    version = doc.get("format_version")
    if version is None:  # another meta.json: a dataset's (atom prepare) or another tool's
        raise CheckpointError(
            f"{d} is not a checkpoint (its {META_NAME} is not a checkpoint's: a dataset?); "
            "pass a run directory (atom train's --out) or one of its checkpoints/step_* folders"
        )
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {d} has format_version {version!r}, but this atom reads "
            f"format_version {FORMAT_VERSION}; use the atom version that wrote it or resume "
            "from another checkpoint"
        )
    problem = _meta_problem(doc, d)
    if problem:
        raise _corrupt(d, f"{META_NAME} {problem}")
    return doc


def _meta_problem(doc: dict[str, Any], d: Path) -> str | None:
    step, files, tensors = doc.get("step"), doc.get("files"), doc.get("tensors")
    if not isinstance(step, int) or isinstance(step, bool):
        return f"has step {step!r}, expected an integer"
    if step_of(d) not in (None, step):
        return f"says step {step} but the directory is {d.name}"
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        return "lacks the 'files' or 'tensors' table"
    for name, info in files.items():
        # A plain name only: meta.json must not point a reader outside the checkpoint dir.
        if not (name.endswith(_SUFFIX) and _STEM_RE.match(name.removesuffix(_SUFFIX))):
            return f"lists a bad file name {name!r}"
        if not (
            isinstance(info, dict)
            and isinstance(info.get("bytes"), int)
            and isinstance(info.get("sha256"), str)
            and _SHA_RE.match(info["sha256"])
        ):
            return f"has a malformed entry for {name}"
    for tname, stem in tensors.items():
        if not isinstance(stem, str) or stem + _SUFFIX not in files:
            return f"maps tensor {tname!r} to unknown file {stem!r}"
    return None


def _corrupt(d: Path, problem: str) -> CheckpointError:
    step = step_of(d)
    older = (
        [c for c in list_checkpoints(d.parent.parent) if step_of(c) < step]
        if step is not None and d.parent.name == CHECKPOINTS_DIR
        else []
    )
    fix = f"resume from an older one: --resume {older[-1]}" if older else "delete it"
    return CheckpointError(f"checkpoint {d} is corrupt: {problem}; {fix} (nothing was changed)")


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__
