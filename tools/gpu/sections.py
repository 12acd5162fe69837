"""The sections of tools/gpu_check: each a function of (dry, ...) returning a dict of
findings, raising SkipSection to say why it did not run."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from tools.gpu.proc import PROFILE_ENV, SkipSection, run_child, seconds_left
from tools.gpu.steps import random_batches, time_steps


def env_section(dry: bool) -> dict:
    import torch

    from atom.ground.device import cuda_has_bf16

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        info.update(
            device=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=round(total / 2**30, 1),
            free_gib=round(free / 2**30, 1),
            bf16=cuda_has_bf16(),  # in hardware: what atom trains in
            bf16_emulated=torch.cuda.is_bf16_supported() and not cuda_has_bf16(),
        )
    elif not dry:
        raise RuntimeError("no CUDA device visible; use --dry-run on a CPU machine")
    for mod in ("zmq", "deepspeed", "pytest"):
        try:
            __import__(mod)
            info[mod] = "present"
        except ImportError:
            info[mod] = "absent"
    return info


def bandwidth_section(dry: bool) -> dict:
    import torch

    if dry:
        raise SkipSection("no CUDA device (dry run)")
    dev = torch.device("cuda", 0)
    numel = 128 * 2**20  # 256 MiB of bf16
    res = {}
    for pinned in (True, False):
        host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pinned)
        back = torch.empty(numel, dtype=torch.bfloat16, pin_memory=pinned)
        d = torch.empty(numel, dtype=torch.bfloat16, device=dev)
        for direction, fn in (
            ("h2d", lambda d=d, host=host: d.copy_(host, non_blocking=True)),
            ("d2h", lambda d=d, back=back: back.copy_(d, non_blocking=True)),
        ):
            fn()
            torch.cuda.synchronize(dev)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            res[f"{direction}_{'pinned' if pinned else 'pageable'}_gbps"] = round(
                host.nbytes / min(times) / 1e9, 2
            )
    return res


def tests_section(dry: bool) -> dict:
    try:
        import pytest  # noqa: F401
    except ImportError:
        raise SkipSection("pytest is not installed") from None
    if dry:
        raise SkipSection("gpu-marked tests need CUDA (dry run)")
    code, log = run_child(
        ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"],
        timeout=240,
    )
    return {"status": "ok" if code == 0 else "FAILED", "exit": code, "log": log}


def _tiny(device: str, **sections):
    from atom.config import Config

    data = {
        "model": {
            "arch": "gpt",
            "n_layer": 3,
            "n_head": 4,
            "d_model": 64,
            "seq_len": 32,
            "vocab_size": 256,
        },
        "train": {
            "micro_batch": 4,
            "grad_accum": 1,
            "max_steps": 5,
            "warmup_steps": 2,
            "device": device,
            "dtype": "fp32",
            # eager blocks: equal to the resident engine's to 1e-5, and no compile per
            # engine (the `compile` section measures compiled blocks)
            "compile_blocks": "off",
        },
        "swap": {"layers_per_unit": 1, "prefetch": 1},
    }
    for section, values in sections.items():
        data[section].update(values)
    return Config.from_dict(data)


def equivalence_section(dry: bool) -> dict:
    """Swapped == resident on this device for a grid of schedule knobs (fp32), and bf16
    swapped training tracks fp32 resident."""
    import torch

    from atom.ground.device import resolve_device
    from atom.optim import lr_at
    from atom.resident.engine import ResidentEngine
    from atom.run.train import build_engine

    device = "cpu" if dry else "cuda"
    if not dry:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    grid = [
        dict(layers_per_unit=1, prefetch=1, checkpoint=True, grad_accum=1),
        dict(layers_per_unit=2, prefetch=2, checkpoint=False, grad_accum=3),
        dict(layers_per_unit=1, prefetch=0, checkpoint=True, grad_accum=2),
        dict(layers_per_unit=1, prefetch=1, checkpoint=True, grad_accum=2, offload=True),
        dict(layers_per_unit=3, prefetch=1, checkpoint=False, grad_accum=1, arch="llama"),
    ]
    rows, worst = [], 0.0
    for knobs in grid:
        swap = {k: knobs[k] for k in ("layers_per_unit", "prefetch", "checkpoint")}
        swap["offload_activations"] = knobs.get("offload", False)
        model = {"arch": knobs.get("arch", "gpt")}
        for dtype in ("fp32",) if dry else ("fp32", "bf16"):
            cfg = _tiny(
                device,
                swap=swap,
                model=model,
                train={"grad_accum": knobs["grad_accum"], "dtype": dtype},
            )
            ref_cfg = _tiny(
                device, swap=swap, model=model, train={"grad_accum": knobs["grad_accum"]}
            )
            swapped = build_engine(cfg)
            dev, _ = resolve_device(ref_cfg)
            resident = ResidentEngine(ref_cfg, dev, torch.float32)
            errs = []
            try:
                for step in range(4):
                    lr = lr_at(step, cfg.train)
                    a = swapped.train_step(random_batches(cfg, step), lr).loss
                    b = resident.train_step(random_batches(cfg, step), lr).loss
                    errs.append(abs(a - b) / abs(b))
                mine = swapped.named_parameters()
                p_err = max(
                    float((mine[n] - p.float().cpu()).norm() / (p.float().norm() + 1e-12))
                    for n, p in resident.named_parameters().items()
                )
                bound_ok = swapped.slots.max_resident <= swap["prefetch"] + 1
            finally:
                swapped.close()
            tol = 1e-5 if dtype == "fp32" else 2e-2
            ok = max(errs) <= tol and (dtype != "fp32" or p_err <= 1e-5) and bound_ok
            if dtype == "fp32":
                worst = max(worst, max(errs), p_err)
            rows.append(
                {
                    **knobs,
                    "dtype": dtype,
                    "loss_rel_err": max(errs),
                    "param_rel_err": p_err,
                    "resident_bound": bound_ok,
                    "ok": ok,
                }
            )
    failed = [r for r in rows if not r["ok"]]
    return {"status": "FAILED" if failed else "ok", "worst_fp32_rel_err": worst, "rows": rows}


def fits_section(dry: bool) -> dict:
    """A model that fits: swapped / resident median step time, interleaved, both with and
    without recompute, grad_accum 1 and 8."""
    import torch

    from atom.config import Config
    from atom.ground.device import resolve_device
    from atom.resident.engine import ResidentEngine
    from atom.run.train import build_engine

    if dry:
        model = {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 32, "vocab_size": 256}
        shapes = [(2, 1)]
    else:
        model = {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 256}
        shapes = [(8, 1), (2, 4)]
    rows = []
    for micro, accum in shapes:
        for ckpt in (False, True):
            train = {"micro_batch": micro, "grad_accum": accum, "device": "cpu" if dry else "cuda"}
            swap = {"layers_per_unit": 1, "prefetch": 1, "checkpoint": ckpt}
            cfg = Config.from_dict({"model": dict(model), "train": train, "swap": swap})
            dev, dtype = resolve_device(cfg)
            resident = ResidentEngine(cfg, dev, dtype, recompute=ckpt)
            r = statistics.median(time_steps(resident, cfg, 4))
            del resident
            if not dry:
                torch.cuda.empty_cache()
            swapped = build_engine(cfg)
            try:
                for update in ("exact", "eager"):
                    swapped.set_schedule(update=update)
                    s = statistics.median(time_steps(swapped, cfg, 4))
                    rows.append(
                        {
                            "micro_batch": micro,
                            "grad_accum": accum,
                            "recompute": ckpt,
                            "update": update,
                            "swapped_s": round(s, 4),
                            "resident_s": round(r, 4),
                            "ratio": round(s / r, 3),
                        }
                    )
            finally:
                swapped.close()
    return {"rows": rows, "note": "the resident baseline recomputes when the swapped run does"}


def tiers_section(dry: bool) -> dict:
    """Where the host state lives (swap.state, swap.disk_dir), with this device's compute:
    the NVMe tier must train bit-identically to RAM, compact state must track fp32."""
    import tempfile

    import torch

    from atom.optim import lr_at
    from atom.run.train import build_engine

    device = "cpu" if dry else "cuda"
    shape = {"n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 128}
    rows, ref, ok = [], None, True
    with tempfile.TemporaryDirectory() as tier:
        for state in ("fp32", "compact"):
            for disk in (None, tier):
                cfg = _tiny(
                    device,
                    model=shape,
                    train={"dtype": "fp32" if dry else "bf16"},
                    swap={"state": state, "disk_dir": disk},
                )
                engine = build_engine(cfg)
                try:
                    losses, times = [], []
                    for step in range(6):
                        t0 = time.perf_counter()
                        losses.append(
                            engine.train_step(
                                random_batches(cfg, step), lr_at(step, cfg.train)
                            ).loss
                        )
                        engine.wait_idle()
                        if not dry:
                            torch.cuda.synchronize()
                        times.append(time.perf_counter() - t0)
                    params = engine.named_parameters()
                finally:
                    engine.close()
                row = {"state": state, "disk": bool(disk), "losses": losses,
                       "step_s": statistics.median(times[1:])}  # fmt: skip
                if ref is None:
                    ref = (losses, params)
                elif state == "fp32":  # the tier moves host state bit for bit
                    row["bit_identical"] = losses == ref[0] and all(
                        torch.equal(params[n], p) for n, p in ref[1].items()
                    )
                    # On CUDA two runs differ by the device's own nondeterminism (flash
                    # attention's backward accumulates in a racy order): what is
                    # guaranteed is agreement to rounding, not bits. On CPU: bits.
                    row["max_param_rel_err_vs_ram"] = max(
                        float((params[n] - p).norm() / (p.norm() + 1e-12))
                        for n, p in ref[1].items()
                    )
                    ok &= row["bit_identical"] or (
                        not dry
                        and max(abs(a - b) / b for a, b in zip(losses, ref[0], strict=True)) < 1e-3
                        and row["max_param_rel_err_vs_ram"] < 1e-3
                    )
                else:
                    row["max_loss_rel_err_vs_fp32"] = max(
                        abs(a - b) / b for a, b in zip(losses, ref[0], strict=True)
                    )
                    ok &= row["max_loss_rel_err_vs_fp32"] < 0.02
                rows.append(row)
    compact_ram = next(r for r in rows if r["state"] == "compact" and not r["disk"])["losses"]
    compact_disk = next(r for r in rows if r["state"] == "compact" and r["disk"])["losses"]
    ok &= compact_ram == compact_disk or (
        not dry
        and max(abs(a - b) / b for a, b in zip(compact_disk, compact_ram, strict=True)) < 1e-3
    )
    return {"status": "ok" if ok else "FAILED", "rows": rows}


def attention_section(dry: bool) -> dict:
    """Every attention call of the LLaMA family (llama, mistral's window, qwen2's biases
    and window; grouped-query heads) with packed documents and with a window shorter than
    the sequence runs on a fused kernel: forward and backward under `sdpa_kernel`
    restricted to flash, memory-efficient and cuDNN attention, where a call only the math
    kernel could serve raises."""
    if dry:
        raise SkipSection("fused attention kernels need CUDA (dry run)")
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from atom.config import Config
    from atom.model import build_model, materialize
    from atom.model.documents import Documents, positions_in_documents

    dev = torch.device("cuda", 0)
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.CUDNN_ATTENTION]  # fmt: skip
    family = {"llama": {}, "mistral": {"sliding_window": 256},
              "qwen2": {"qkv_bias": True, "sliding_window": 300}}  # fmt: skip
    g = torch.Generator().manual_seed(0)
    starts = torch.rand(2, 1024, generator=g) < 0.01  # ~10 documents a row
    rows = []
    for name, extra in family.items():
        model = {"arch": "llama", "n_layer": 2, "n_head": 8, "n_kv_head": 2, "d_model": 512,
                 "seq_len": 1024, "vocab_size": 256, **extra}  # fmt: skip
        cfg = Config.from_dict({"model": model})
        net = materialize(build_model(cfg.model), 0, device=dev, dtype=torch.bfloat16)
        x = torch.randint(0, 256, (2, 1024), generator=g).to(dev)
        for case in ("packed documents", "one stream"):
            docs = (
                Documents.on(positions_in_documents(starts), dev) if case != "one stream" else None
            )
            row = {"model": name, "case": case}
            try:
                with sdpa_kernel(fused):
                    net(x, x.roll(-1, 1), docs=docs)[1].backward()
                torch.cuda.synchronize()
                row["ok"] = True
            except RuntimeError as err:  # "No available kernel": the math kernel's alone
                row.update(ok=False, error=str(err)[:400])
            rows.append(row)
        del net
    failed = [r for r in rows if not r["ok"]]
    return {"status": "FAILED" if failed else "ok", "rows": rows}


def card_cap(gpu_mem: str, dry: bool) -> tuple[str, str | None]:
    """The cap to emulate, lowered to the card's memory less a margin when the card has
    less than asked; (cap, a note when lowered)."""
    if dry:
        return gpu_mem, None
    import torch

    from atom.ground.sizes import parse_bytes

    total = torch.cuda.get_device_properties(0).total_memory
    usable = int(total * 0.92)  # the CUDA context and the allocator's slack
    if parse_bytes(gpu_mem) <= usable:
        return gpu_mem, None
    cap = f"{usable / 2**30:.1f}GiB"
    return cap, f"the card has {total / 2**30:.1f} GiB: capped at {cap}, not {gpu_mem}"


def _pinned_peak_gbps() -> float | None:
    """bandwidth's pinned H2D figure, from the report written so far."""
    path = Path(os.environ["GPU_CHECK_OUT"]) / "gpu_check.json"
    if not path.exists():
        return None
    sections = json.loads(path.read_text()).get("sections", {})
    return sections.get("bandwidth", {}).get("h2d_pinned_gbps")


def big_section(
    dry: bool, config: str, gpu_mem: str, batch: int, steps: int, overrides: list[str]
) -> dict:
    """`atom profile` under the cap, then training steps of the chosen plan in a child
    process that cannot use more than the cap."""
    out = Path(os.environ["GPU_CHECK_OUT"])
    plan = out / "plan.json"
    (out / "big_train.json").unlink(missing_ok=True)  # an earlier check's is not this one's
    if dry:
        config, gpu_mem, batch = "tiny", "1GiB", 8
    gpu_mem, lowered = card_cap(gpu_mem, dry)
    profile_flags = [] if dry else json.loads(os.environ.get(PROFILE_ENV, "[]"))
    if "--tiered" in profile_flags:  # the tiered plan's NVMe tiers, in the check's folder
        (out / "tier").mkdir(exist_ok=True)
        overrides = [*overrides, f"swap.disk_dir={out / 'tier'}"]
    sets = [a for kv in ["model.vocab_size=256", *overrides] for a in ("--set", kv)]
    code, log = run_child(
        [
            "-m",
            "atom.cli",
            "profile",
            "--config",
            config,
            "--gpu-mem",
            gpu_mem,
            "--batch",
            str(batch),
            "--out",
            str(plan),
            "--top",
            "5",
            *profile_flags,
            *sets,
        ],
        timeout=200,
    )
    result: dict = {"gpu_mem": gpu_mem, "profile_exit": code, "profile_log": log[-2500:]}
    if lowered:
        result["note"] = lowered
    if code != 0:
        result["status"] = "FAILED"
        return result
    code, log = run_child(
        [
            "-m",
            "tools.gpu_check",
            "--train-child",
            str(plan),
            config,
            gpu_mem,
            str(steps),
            "--dry-run" if dry else "--no-dry-run",
            *sets,
        ],
        timeout=330,
    )
    result["train_exit"] = code
    result["log"] = log
    child = out / "big_train.json"
    if child.exists():
        result.update(json.loads(child.read_text()))
    peak = _pinned_peak_gbps()
    if peak and result.get("h2d_copy_gbps"):
        result["h2d_copy_over_pinned_peak"] = round(result["h2d_copy_gbps"] / peak, 3)
    if code != 0:
        result["status"] = "FAILED"
    return result


def deepspeed_section(
    dry: bool, config: str, gpu_mem: str, batch: int, steps: int, overrides: list[str]
) -> dict:
    """The DeepSpeed configurations a user would pick, on the model, cap, batch,
    micro-batch and recompute of `big`'s plan: ZeRO-2 with the optimizer offloaded (when
    the bf16 weights and gradients fit the card) and ZeRO-3 with parameters and optimizer
    offloaded; tokens/s next to atom's. A micro-batch that runs out of memory is halved
    (the batch kept by accumulation) and the one used is reported."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise SkipSection("DeepSpeed does not import here; baseline not measured") from None
    if dry:
        raise SkipSection("the DeepSpeed baseline needs CUDA (dry run)")
    out = Path(os.environ["GPU_CHECK_OUT"])
    gpu_mem, lowered = card_cap(gpu_mem, dry)
    big = (
        json.loads((out / "big_train.json").read_text())
        if (out / "big_train.json").exists()
        else {}
    )
    micro = big.get("plan", {}).get("micro_batch", 1)
    recompute = bool(big.get("plan", {}).get("swap", {}).get("checkpoint", True))
    sets = [a for kv in ["model.vocab_size=256", *overrides] for a in ("--set", kv)]
    result: dict = {"gpu_mem": gpu_mem, "micro_batch_asked": micro, "recompute": recompute}
    if lowered:
        result["note"] = lowered
    for stage, label in ((2, "zero2_offload_optimizer"), (3, "zero3_offload_all")):
        if seconds_left() < 60:
            result[label] = {"skipped": "out of the time budget"}
            continue
        code, log = run_child(
            ["-m", "tools.baselines.deepspeed_baseline", "--config", config, "--gpu-mem", gpu_mem,
             "--batch", str(batch), "--micro-batch", str(micro), "--stage", str(stage),
             "--steps", str(max(2, steps - 1)), *(["--recompute"] if recompute else []),
             *sets],
            timeout=300,
            # DeepSpeed refuses to JIT-build its CPU Adam when nvcc's CUDA version differs
            # from the one torch was built with; the op is CPU code, so the check is moot
            env={"DS_SKIP_CUDA_CHECK": "1"},
        )  # fmt: skip
        lines = [line for line in log.splitlines() if line.startswith("{")]
        ds = json.loads(lines[-1]) if lines else {"exit": code, "log": log[-2000:]}
        result[label] = ds
        if ds.get("tokens_per_s") and big.get("tokens_per_s"):
            result[f"atom_over_{label.split('_')[0]}"] = round(
                big["tokens_per_s"] / ds["tokens_per_s"], 2
            )
    if not any("tokens_per_s" in result.get(k, {}) for k in ("zero2_offload_optimizer",
                                                            "zero3_offload_all")):  # fmt: skip
        result["status"] = "FAILED"
    return result


def torchtune_section(
    dry: bool, config: str, gpu_mem: str, batch: int, steps: int, overrides: list[str]
) -> dict:
    """torchtune's single-device full fine-tune (tools/baselines/torchtune_baseline.py: bf16 weights
    on the card, every block recomputed, the optimizer stepped in the backward, 8-bit
    paged AdamW where bitsandbytes imports) on `big`'s model, cap and batch, as one step
    without accumulation; tokens/s next to atom's. Where it does not fit the cap, that is
    the finding (issue 27 (a): the largest model it fits)."""
    out = Path(os.environ["GPU_CHECK_OUT"])
    if dry:  # the plumbing, on the CPU at tiny shapes
        config, gpu_mem, batch = "tiny", "1GiB", 2
    gpu_mem, lowered = card_cap(gpu_mem, dry)
    big = (
        json.loads((out / "big_train.json").read_text())
        if (out / "big_train.json").exists()
        else {}
    )
    sets = [a for kv in ["model.vocab_size=256", *overrides] for a in ("--set", kv)]
    code, log = run_child(
        ["-m", "tools.baselines.torchtune_baseline", "--config", config, "--gpu-mem", gpu_mem,
         "--batch", str(batch), "--steps", str(max(2, steps)),
         *(["--device", "cpu"] if dry else []), *sets],
        timeout=300,
    )  # fmt: skip
    lines = [line for line in log.splitlines() if line.startswith("{")]
    result: dict = json.loads(lines[-1]) if lines else {"exit": code, "log": log[-2000:]}
    result["gpu_mem"] = gpu_mem
    if lowered:
        result["note"] = lowered
    if result.get("tokens_per_s") and big.get("tokens_per_s"):
        result["atom_over_torchtune"] = round(big["tokens_per_s"] / result["tokens_per_s"], 2)
    if code != 0 or not (result.get("tokens_per_s") or "out of device memory" in str(result)):
        result["status"] = "FAILED"
    return result
