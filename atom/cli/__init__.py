"""`atom` command line: the face. Only this package prints to the user or exits; the
library below it logs and raises.

User-caused errors (bad config, missing file, corrupt checkpoint, bad data) print one
line `atom: error: ...` and exit 2; internal bugs keep their traceback. The peer
commands (keygen, peers, the train flags) are in peers.py, `atom simulate` in
simulate.py.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import sys
from pathlib import Path

from atom.cli import peers as gossip_commands
from atom.cli import simulate as simulate_command
from atom.cli.train_command import cmd_train
from atom.config import config_names
from atom.ground.errors import AtomError, ConfigError, DataError
from atom.run.run_config import load_run_config

USER_ERRORS = (AtomError,)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help=f"YAML file, or a name from configs/ ({', '.join(config_names())}); default: "
        "the built-in tiny model",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=V",
        help="override one config value, e.g. --set train.lr=3e-4 (repeatable)",
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("atom")
    except PackageNotFoundError:  # run from a checkout that was not pip-installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="atom",
        description="Train language models larger than your GPU by streaming "
        "units of layers through it.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"atom {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (default: tiny GPT on a built-in corpus)")
    _add_config_args(t)
    t.add_argument(
        "--model",
        metavar="HF_DIR",
        help="fine-tune a local Hugging Face checkpoint (llama, mistral, qwen2, gpt2): "
        "same as model: hf:HF_DIR in the config",
    )
    t.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    t.add_argument(
        "--out",
        default=None,
        help="run directory: metrics.jsonl, checkpoints/ (default: runs/default, or with "
        "--resume the run being resumed); a new run refuses a directory holding another",
    )
    t.add_argument(
        "--resident",
        action="store_true",
        help="plain PyTorch training with the whole model on the device "
        "(the reference and benchmark baseline)",
    )
    t.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest valid checkpoint in DIR (a run directory or checkpoint)",
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument(
        "--plan",
        metavar="PLAN_JSON",
        help="use the partition, prefetch and micro-batch chosen by `atom profile`",
    )
    gossip_commands.add_train_args(t)

    pf = sub.add_parser(
        "profile", help="measure model and machine, choose the plan that fits, write plan.json"
    )
    _add_config_args(pf)
    pf.add_argument("--out", default="plan.json", help="plan file to write (default plan.json)")
    pf.add_argument(
        "--gpu-mem",
        help="device memory budget, e.g. 12GiB (emulates a smaller card; default: free "
        "device memory less a margin)",
    )
    pf.add_argument("--host-mem", help="host RAM for model state (default: available RAM)")
    pf.add_argument(
        "--hardware",
        metavar="NAME|JSON",
        help="state the hardware instead of measuring it: a preset (rtx2080ti, rtx3060, "
        "rtx4060ti, rtx4070, rtx3090, rtx4090, rtx5090, h200) or a JSON spec; block times "
        "come from FLOPs",
    )
    pf.add_argument(
        "--batch",
        type=int,
        help="sequences per optimizer step (default: train.micro_batch x train.grad_accum)",
    )
    pf.add_argument(
        "--nvme-tbw",
        type=float,
        metavar="TB",
        help="the NVMe drive's rated endurance, TB written, to say what share of it a day of "
        "training uses (default 600: a common 1 TB consumer drive)",
    )
    pf.add_argument(
        "--max-disk-writes",
        metavar="SIZE",
        help="bytes a plan may write to the disk an hour, e.g. 200GB (default: any)",
    )
    pf.add_argument(
        "--tiered",
        action="store_true",
        help="plan the tiered shape (weights, state and activations across RAM and NVMe, "
        "every update on the card; not built yet) even where a plan atom trains fits",
    )
    pf.add_argument("--top", type=int, default=8, help="candidates to show (default 8)")
    pf.add_argument("--refresh", action="store_true", help="re-measure instead of the cache")
    pf.add_argument(
        "--force",
        action="store_true",
        help="replace --out even when it holds another model's plan (refused without it)",
    )

    pr = sub.add_parser("prepare", help="tokenize text files into token shards for training")
    pr.add_argument("inputs", nargs="+", help="text files or directories")
    pr.add_argument("--out", required=True, help="dataset directory to write")
    pr.add_argument(
        "--tokenizer",
        default="byte",
        help="'byte' (default, vocab 256), a local tokenizer.json, or a Hugging Face "
        "checkpoint directory (its tokenizer.json; needs the 'tokenizers' package)",
    )
    pr.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="last fraction of tokens held out for validation (default 0.1)",
    )
    pr.add_argument(
        "--learn-prompts",
        action="store_true",
        help="JSONL records: learn the prompts' tokens too (default: only the assistant "
        "turns, outputs and completions)",
    )

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("run", help="run directory or checkpoint directory")
    g.add_argument("--prompt", default="\n", help="text to continue")
    g.add_argument("--tokens", type=int, default=200, help="most tokens to generate (default 200)")
    g.add_argument(
        "--temperature",
        type=float,
        default=0.8,
        help="sampling temperature: lower is more predictable, 0 always takes the likeliest "
        "token (default 0.8)",
    )
    g.add_argument(
        "--top-k",
        type=int,
        default=50,
        help="sample among the k likeliest tokens only; 0: all (default 50)",
    )
    g.add_argument(
        "--seed", type=int, default=0, help="random seed: the same seed, the same text (default 0)"
    )
    g.add_argument(
        "--no-cache", action="store_true", help="re-run the whole context for every token"
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user's message: laid out with the run's chat template (the "
        "checkpoint's, ChatML otherwise); prints the assistant's reply",
    )
    g.add_argument("--system", help="with --chat: a system message first")

    ex = sub.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    ex.add_argument("run", help="run directory or checkpoint directory")
    ex.add_argument(
        "--hf",
        required=True,
        metavar="OUT",
        help="new directory for config.json, model.safetensors (shards + index past "
        "--max-shard-size), tokenizer files",
    )
    ex.add_argument(
        "--dtype",
        default="source",
        choices=["source", "fp32", "bf16", "fp16"],
        help="weight dtype (default: the source checkpoint's; fp32 for a model trained "
        "from scratch)",
    )
    ex.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB)")
    ev = sub.add_parser("eval", help="loss and perplexity of a run on held-out text")
    ev.add_argument("run", help="run directory or checkpoint directory")
    ev.add_argument(
        "--data", required=True, help="a text file, or a dataset directory (its val split)"
    )
    ev.add_argument("--batch", type=int, help="windows per batch (default: the run's micro-batch)")
    pl = sub.add_parser("plot", help="loss curves of one or more runs as a PNG")
    pl.add_argument("runs", nargs="+", help="run directories (overlaid, one colour each)")
    pl.add_argument("--x", default="step", choices=["step", "tokens", "time"], help="x axis")
    pl.add_argument("--out", help="PNG path (default: loss.png in the first run directory)")
    gossip_commands.add_commands(sub)  # keygen, peers
    simulate_command.add_command(sub)  # atom vs pipeline vs data parallel
    return parser


def cmd_profile(args) -> int:
    from atom.profiler.hardware import parse_bytes
    from atom.profiler.planner import Infeasible, check_replace, describe_host, format_table
    from atom.profiler.profile import run_profile
    from atom.profiler.tiers import DEFAULT_TBW

    cfg = load_run_config(args.config, args.overrides)
    if not args.force:
        check_replace(Path(args.out), cfg)  # before the measurements: refused in a second
    gpu_mem = parse_bytes(args.gpu_mem) if args.gpu_mem else None
    host_mem = parse_bytes(args.host_mem) if args.host_mem else None
    writes = args.max_disk_writes and parse_bytes(args.max_disk_writes, "--max-disk-writes")
    tbw = DEFAULT_TBW if args.nvme_tbw is None else args.nvme_tbw
    if tbw <= 0:
        raise ConfigError("--nvme-tbw must be > 0 (the drive's rated TB written)")
    try:
        plan, ranked, hw = run_profile(
            cfg,
            args.batch,
            gpu_mem,
            host_mem,
            args.hardware,
            args.refresh,
            progress=sys.stderr.isatty(),
            nvme_tbw=tbw,
            max_disk_writes=writes,
            only_tiered=args.tiered,
        )
    except Infeasible as err:
        print(f"atom: error: {err}", file=sys.stderr)
        return 2
    source = "measured" if hw.measured else "stated"
    print(
        f"atom: {hw.name} ({source}): device budget {hw.device_mem / 2**30:.1f} GiB, host "
        f"{hw.host_mem / 2**30:.1f} GiB, H2D {hw.h2d_bps / 1e9:.1f} GB/s; "
        f"{len(ranked)} plans fit; batch {plan.target_batch} x {cfg.model.seq_len} tokens"
    )
    print(format_table(ranked, args.top, clipped=cfg.train.grad_clip > 0))
    best = plan.prediction
    print(
        f"atom: chose #1: {plan.swap['layers_per_unit']} layer(s)/unit, prefetch "
        f"{plan.swap['prefetch']}, micro-batch {plan.micro_batch} x {plan.grad_accum}, "
        f"{plan.swap['order']}-major, {plan.swap['resident_units']} resident unit(s), "
        f"card update {plan.swap['card_update']}, "
        f"checkpoint {plan.swap['checkpoint']}, offload {plan.swap['offload_activations']}, "
        f"{describe_host(plan.swap['state'], plan.disk_tier, plan.tiered)}: "
        f"{best.step_s:.3f} s/step, {best.tokens_per_s:,.0f} tokens/s, "
        f"{best.peak_device_bytes / 2**30:.2f} GiB device peak ({best.bottleneck}-bound)"
    )
    for group in plan.placement:  # where each unit's weights and update live, and why
        print(f"atom: {group['says']}\n        because {group['why']}")
    up, down = best.detail.get("state_up_bytes", 0), best.detail.get("state_down_bytes", 0)
    if up:
        print(
            f"atom: the update on the card moves {up / 1e9:.1f} GB of optimizer state to the "
            f"card and {down / 1e9:.1f} GB back a step, and runs "
            f"{best.detail['card_update_device_s']:.2f} s on the card"
        )
    pinned = best.detail.get("pinned_bytes", 0)
    host = best.host_bytes
    if host:
        print(
            f"atom: host RAM for model state {host / 2**30:.2f} GiB"
            + (f", {pinned / 2**30:.2f} GiB of it pinned (page-locked)" if pinned else "")
        )
    for note in plan.notes:
        print(f"atom: {note}")
    plan.save(Path(args.out))
    if plan.needs:  # a tiered plan: priced, not run (said above)
        print(f"atom: wrote {args.out} (a plan atom train does not run yet)")
    else:
        print(f"atom: wrote {args.out}; train with: atom train --plan {args.out} ...")
    return 0


def cmd_prepare(args) -> int:
    from atom.data.tokens import prepare

    if not 0 < args.val_fraction < 1:
        raise DataError("--val-fraction must be between 0 and 1")
    meta = prepare(
        [Path(p) for p in args.inputs],
        Path(args.out),
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        learn_prompts=args.learn_prompts,
    )
    kind = " in documents (JSONL records)" if meta.documents else ""
    print(
        f"atom: wrote {meta.train_tokens:,} train and {meta.val_tokens:,} val tokens{kind} "
        f"(vocab {meta.vocab_size}) to {args.out}; train with --set train.data={args.out}"
    )
    return 0


def cmd_export(args) -> int:
    from atom.hf import export_hf
    from atom.store.run_dir import claim, enclosing_run

    # an export into a run directory writes it: not while a training there does
    inside = enclosing_run(Path(args.hf).absolute())
    with claim(inside, "export outside it") if inside else contextlib.nullcontext():
        s = export_hf(Path(args.run), Path(args.hf), args.dtype, args.max_shard_size)
    print(
        f"atom: exported step {s.step} as {s.family} ({s.dtype}, {s.shards} shard(s), "
        f"{s.bytes / 2**20:.1f} MiB, tokenizer: {', '.join(s.tokenizer_files) or 'none'}) "
        f"to {s.out}; load it with transformers' AutoModelForCausalLM.from_pretrained"
    )
    return 0


def cmd_eval(args) -> int:
    from atom.commands.evaluate import evaluate_run

    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {args.batch}")
    r = evaluate_run(Path(args.run), Path(args.data), args.batch)
    print(
        f"atom: {args.run} on {r.source}: {r.tokens:,} tokens in {r.windows:,} windows; "
        f"loss {r.loss:.4f}, perplexity {r.perplexity:.2f}"
    )
    return 0


def cmd_plot(args) -> int:
    from atom.commands.plot import plot_runs

    path = plot_runs([Path(r) for r in args.runs], Path(args.out) if args.out else None, args.x)
    print(f"atom: wrote {path}")
    return 0


def cmd_generate(args) -> int:
    from atom.commands.generate import generate

    if args.tokens < 1:
        raise ConfigError(f"--tokens must be >= 1, got {args.tokens}")
    if args.temperature < 0 or args.top_k < 0:
        raise ConfigError("--temperature and --top-k must be >= 0 (0: greedy / no top-k cut)")
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat's system message; add --chat")

    out = generate(
        Path(args.run), args.prompt, args.tokens, args.temperature, args.top_k, args.seed,
        use_cache=not args.no_cache, chat=args.chat, system=args.system,
    )  # fmt: skip
    print(out.reply if args.chat else out.text)
    end = "the end of the turn" if args.chat else "the end-of-text token"
    print(
        f"atom: {out.tokens} tokens in {out.seconds:.2f} s ({out.tokens_per_s:,.0f} tokens/s, "
        f"KV cache {'off' if args.no_cache else 'on'}, {out.threads} CPU thread(s))"
        + (f"; stopped at {end}" if out.stopped_at_eos else ""),
        file=sys.stderr,
    )
    return 0


# the system refused a resource: what the user can do (one line, exit 2, no traceback)
SYSTEM_LIMITS = {
    errno.EMFILE: "raise the open-file limit (ulimit -n 4096) or let fewer peers connect",
    errno.ENFILE: "the system is out of file handles: close other programs",
    errno.ENOSPC: "free space on that disk (or lower train.keep_checkpoints)",
    errno.EDQUOT: "free space in your quota (or lower train.keep_checkpoints)",
}


def raise_open_file_limit(want: int = 65536) -> None:
    """Raise the soft open-file limit towards the hard one: every gossip connection is a
    file descriptor, and 256 (some systems' default) ran out with 400 connections."""
    try:
        import resource
    except ImportError:  # not on this platform
        return
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `atom profile | head -1`: the reader left; so do we, quietly
        # the interpreter flushes stdout again at exit: point it at nothing first
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command a pipe closed on


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers = {
        "train": cmd_train,
        "prepare": cmd_prepare,
        "generate": cmd_generate,
        "profile": cmd_profile,
        "export": cmd_export,
        "plot": cmd_plot,
        "eval": cmd_eval,
        **gossip_commands.HANDLERS,
        **simulate_command.HANDLERS,
    }
    raise_open_file_limit()
    try:
        return handlers[args.command](args)
    except USER_ERRORS as err:
        print(f"atom: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.errno not in SYSTEM_LIMITS:
            raise
        where = f" ({err.filename})" if err.filename else ""
        print(
            f"atom: error: {err.strerror}{where}; {SYSTEM_LIMITS[err.errno]}; checkpoints are "
            "written whole or not at all, so the newest one on disk is intact",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # before training began (profiling, joining peers, ...)
        print(f"atom {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
