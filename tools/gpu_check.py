"""One command that proves the CUDA path on this machine and writes what it measured.

    python3 -m tools.gpu_check OUT_DIR                 # on a CUDA machine, < 9 minutes
    python3 -m tools.gpu_check OUT_DIR --dry-run       # CPU: the same sections, tiny shapes

Needs only torch and the project's pure-Python dependencies (no pyzmq, no DeepSpeed: those
sections say they were skipped). Wheels carried in the checkout's .whl/ folder (copied from
../shared/wheels, which does not travel) are installed under OUT/site first when pyzmq or
DeepSpeed does not import, so the DeepSpeed baseline runs on a machine without network.
Every section but `env` runs in a child process (a crash
or hang cannot take the rest down), all of them within one time budget (`--budget`,
default 540 s: each child's timeout is what is left of it, and a section that would start
with less than its minimum is skipped with a line saying so), and each is written to
OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md as soon as it ends, so a report survives a
section that fails or a run that is cut short. On a card with less memory than
`--gpu-mem`, `big` and `deepspeed` run under the card's own (less a margin) and say so.

Sections:
  env          device, torch/CUDA versions, memory
  bandwidth    pinned (and pageable) host<->device GB/s at 256 MiB
  tests        the gpu-marked tests (swap == resident in fp32 on CUDA, bf16 tracks fp32)
  attention    llama/mistral/qwen2 attention (GQA, packed documents, windows) runs forward
               and backward with SDPA restricted to its fused kernels
  equivalence  swapped vs resident on CUDA, fp32 and bf16, every schedule knob
  fits         a model that fits the card: swapped vs resident step time, side by side
  big          `atom profile` then training steps of a model that does not fit the
               --gpu-mem cap: tokens/s, step / max(compute, bus floor), the H2D copies'
               own GB/s (CUDA events around each) over the pinned peak of `bandwidth`,
               device peak vs predicted, bytes moved per step
  tiers        host state on this device: compact vs fp32 (loss tracks), the NVMe tier vs RAM
               (bit-identical), step times side by side
  deepspeed    ZeRO-2 with the optimizer offloaded and ZeRO-3 with parameters and optimizer
               offloaded, on the same model, cap, batch, micro-batch and recompute as
               `big`'s plan (only where DeepSpeed imports)
  torchtune    torchtune's single-device full fine-tune (bf16 weights on the card, the
               optimizer stepped in the backward, 8-bit paged AdamW where bitsandbytes
               imports) on `big`'s model, cap and batch, without accumulation
  compile      train.compile_blocks: a LLaMA slice's swapped steps with compiled blocks
               and eager ones: whether they compiled, the compile's seconds, step times,
               the losses' drift
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from tools.gpu.compile import compile_section
from tools.gpu.proc import DEADLINE_ENV, PROFILE_ENV, ROOT, SkipSection, run_child, seconds_left
from tools.gpu.sections import (
    attention_section,
    bandwidth_section,
    big_section,
    deepspeed_section,
    env_section,
    equivalence_section,
    fits_section,
    tests_section,
    tiers_section,
    torchtune_section,
)
from tools.gpu.steps import train_child


class Report:
    def __init__(self, out: Path, dry_run: bool):
        self.out = out
        self.data: dict = {
            "dry_run": dry_run,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sections": {},
        }

    def section(self, name: str, result: dict) -> None:
        self.data["sections"][name] = result
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=2) + "\n")
        lines = [f"# gpu_check ({'dry run, CPU' if self.data['dry_run'] else 'CUDA'})", ""]
        for name, res in self.data["sections"].items():
            status = res.get("status", "?")
            lines.append(f"## {name}: {status} ({res.get('seconds', 0):.1f} s)")
            for key, value in res.items():
                if key in ("status", "seconds", "traceback", "log"):
                    continue
                text = value if isinstance(value, str) else json.dumps(value)
                lines.append(f"- {key}: {text}")
            if res.get("traceback"):
                lines += ["", "```", res["traceback"][-3000:], "```"]
            if res.get("log"):
                lines += ["", "```", res["log"][-3000:], "```"]
            lines.append("")
        (self.out / "gpu_check.md").write_text("\n".join(lines))


# The least time (s) a section needs to say anything useful; with less left it is skipped.
MIN_SECONDS = {"env": 5, "bandwidth": 20, "tests": 60, "attention": 20, "equivalence": 60,
               "fits": 60, "tiers": 60, "big": 120, "deepspeed": 90, "torchtune": 45,
               "compile": 120}  # fmt: skip


def call_section(fn, *args) -> dict:
    """One section's result: what it returns, or skipped / FAILED with why."""
    try:
        result = fn(*args) or {}
        result.setdefault("status", "ok")
    except SkipSection as skip:
        result = {"status": "skipped", "why": str(skip)}
    except Exception as err:  # a failing section is a finding, not the end of the check
        result = {
            "status": "FAILED",
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
    return result


def _isolated(name: str, args: tuple) -> dict:
    """Run section `name` in a child process bounded by the budget; its result."""
    out = Path(os.environ["GPU_CHECK_OUT"])
    result_file = out / "sections" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    code, log = run_child(["-m", "tools.gpu_check", "--section-child", name, json.dumps(args)],
                       timeout=seconds_left() - 2)  # fmt: skip
    if result_file.exists():
        return json.loads(result_file.read_text())
    return {"status": "FAILED", "error": f"the section's process ended ({code}) with no result",
            "log": log}  # fmt: skip


def run_section(report: Report, name: str, fn, *args, isolate: bool = True) -> dict:
    print(f"gpu_check: {name} ...", flush=True)
    t0 = time.perf_counter()
    left = seconds_left()
    if left < MIN_SECONDS.get(name, 30):
        result = {"status": "skipped",
                  "why": f"out of the time budget ({left:.0f} s left; it needs "
                         f"{MIN_SECONDS.get(name, 30)}): raise --budget or use --only"}  # fmt: skip
    elif isolate:
        result = _isolated(name, args)
    else:
        result = call_section(fn, *args)
    result["seconds"] = time.perf_counter() - t0
    print(f"gpu_check: {name}: {result['status']} ({result['seconds']:.1f} s)", flush=True)
    if result["status"] == "FAILED":
        print(result.get("traceback", "")[-2000:], flush=True)
    report.section(name, result)
    return result


def carried_wheels(out: Path) -> str | None:
    """The GPU machine has no pyzmq or DeepSpeed and no network: wheels carried in the
    checkout's .whl/ (../shared/wheels/README.md) are installed under OUT/site when what
    they provide does not import, and put on the path of this process and its children.
    The folder installed into, or None."""
    import importlib.util

    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if not wheels or all(importlib.util.find_spec(m) for m in ("zmq", "deepspeed")):
        return None
    site = out / "site"
    code, log = run_child(["-m", "pip", "install", "-q", "--no-index", "--no-deps",
                           "--no-compile", "--upgrade", "--target", str(site),
                           *map(str, wheels)], timeout=120)  # fmt: skip
    if code != 0:
        print(f"gpu_check: installing the carried wheels failed:\n{log[-1500:]}", flush=True)
        return None
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p
    )
    return str(site)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--train-child":
        plan, config, gpu_mem, steps, dry = argv[1:6]
        train_child(plan, config, gpu_mem, int(steps), dry == "--dry-run", argv[6:])
        return 0
    if argv and argv[0] == "--section-child":  # one section, its result to a file
        if "GPU_CHECK_OUT" not in os.environ or len(argv) < 3:
            print("gpu_check: --section-child is gpu_check's own; run python -m "
                  "tools.gpu_check OUT_DIR", file=sys.stderr)  # fmt: skip
            return 2
        name, args = argv[1], json.loads(argv[2])
        result = call_section(SECTIONS[name], *args)
        path = Path(os.environ["GPU_CHECK_OUT"]) / "sections" / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        return 0
    p = argparse.ArgumentParser(
        prog="python -m tools.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("out", help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (CI)")
    p.add_argument("--config", default="gpt3-2.7b", help="the model that must not fit")
    p.add_argument("--gpu-mem", default="24GiB", help="device cap to emulate (default 24GiB)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step for `big`")
    p.add_argument("--steps", type=int, default=3, help="timed training steps for `big`")
    p.add_argument("--only", nargs="*", help="run only these sections")
    p.add_argument(
        "--host-mem",
        default=None,
        help="host RAM cap for `big`'s profile (e.g. 48GiB; default: this machine's)",
    )
    p.add_argument("--tiered", action="store_true",
                   help="`big` profiles the tiered plan (weights, state and unit inputs across "
                        "RAM and an NVMe tier in OUT/tier) and trains it (issue 43)")  # fmt: skip
    p.add_argument("--budget", type=float, default=540.0,
                   help="seconds for the whole check (default 540: under 9 minutes)")  # fmt: skip
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=V",
        help="config override for `big`, e.g. --set swap.update=eager (repeatable)",
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    os.environ["GPU_CHECK_OUT"] = str(out)
    os.environ[DEADLINE_ENV] = str(time.time() + args.budget)
    os.environ.setdefault("ATOM_CACHE", str(out / "cache"))
    # `atom profile`'s own flags for `big` (its children read them from here)
    profile = ["--host-mem", args.host_mem] * bool(args.host_mem) + ["--tiered"] * args.tiered
    os.environ[PROFILE_ENV] = json.dumps(profile)
    report = Report(out, args.dry_run)
    if not args.dry_run:
        report.data["wheels"] = carried_wheels(out)
    # the model, cap and batch that `big` trains and the DeepSpeed baseline runs
    model_args = (args.config, args.gpu_mem, args.batch, args.steps, args.overrides)
    failed = []
    for name, fn in SECTIONS.items():
        if args.only and name not in args.only:
            continue
        with_model = name in ("big", "deepspeed", "torchtune")
        fargs = (args.dry_run, *model_args) if with_model else (args.dry_run,)
        # env in this process (it is quick, and says what the machine is even if all else
        # fails); big and deepspeed spawn their own bounded children
        isolate = name not in ("env", "big", "deepspeed", "torchtune", "tests")
        if run_section(report, name, fn, *fargs, isolate=isolate)["status"] == "FAILED":
            failed.append(name)
    report.data["failed"] = failed
    report.write()
    print(f"gpu_check: report in {out}/gpu_check.md; failed: {', '.join(failed) or 'none'}")
    return 1 if failed else 0


SECTIONS = {
    "env": env_section,
    "bandwidth": bandwidth_section,
    "tests": tests_section,
    "attention": attention_section,
    "equivalence": equivalence_section,
    "fits": fits_section,
    "tiers": tiers_section,
    "big": big_section,
    "deepspeed": deepspeed_section,
    "torchtune": torchtune_section,
    "compile": compile_section,
}

if __name__ == "__main__":
    sys.exit(main())
