"""`atom train`: resolve what the run will be (config, plan, run directory: every refusal
before anything slow), then train it and report what happened."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from atom.cli import peers as gossip_commands
from atom.ground.errors import ConfigError
from atom.run.run_config import load_run_config, resume_changes, resume_run_config


def _terminate_like_ctrl_c(signum, frame) -> None:
    """SIGTERM (docker stop, systemd, kill) stops training the way Ctrl+C does: at the
    next step boundary, with a checkpoint and a goodbye to the peers."""
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:
        raise KeyboardInterrupt


def _peer_flags(args) -> str:
    """A peer's own flags, for the advice a refused restart gives (so it says what works)."""
    flags = [f"--listen {args.listen}"] if args.listen else []
    flags += [f"--group-key {args.group_key}"] if args.group_key else []
    flags += [f"--join {j}" for j in args.join]
    return "".join(" " + f for f in flags)


def resolve_run(args):
    """What `atom train` will do, before anything slow: the config (saved in the resumed
    run, or loaded, with --set, --max-steps and the plan on top), the plan, and the run
    directory. Each refusal is one line, the data's first (the commonest slip)."""
    from atom.data.tokens import TokenData
    from atom.run.train import data_dir_for
    from atom.store import run_dir  # torch: loaded only once a command needs it

    overrides = args.overrides + gossip_commands.train_overrides(args)
    if args.max_steps is not None and args.max_steps < 1:
        raise ConfigError("--max-steps must be >= 1")
    resumed = None
    if args.resume:
        if args.config or args.model:
            raise ConfigError(
                "--resume continues with the config saved in the run: drop --config/--model "
                "(change how it trains with --set train.KEY=VALUE)"
            )
        from atom.store.checkpoint import load_checkpoint

        resumed = load_checkpoint(Path(args.resume), verify=False, fall_back=False)
    saved = resumed.meta.get("config") if resumed is not None else None
    if saved is not None:
        cfg = resume_run_config(saved, overrides, args.max_steps)
    else:
        cfg = load_run_config(args.config, overrides, model=args.model)
        if args.max_steps is not None:
            cfg.train.max_steps = args.max_steps
    plan = None
    if args.plan:
        from atom.profiler.planner import Plan

        plan = Plan.load(Path(args.plan))
        cfg = plan.apply(cfg)
    changes = resume_changes(saved, cfg) if saved is not None else []  # refuses another model
    TokenData(data_dir_for(cfg), cfg.model.seq_len, cfg.train.seed)  # before the run dir's clash
    if resumed is not None and not cfg.gossip.join and resumed.step >= cfg.train.max_steps:
        raise ConfigError(
            f"{resumed.path} is at step {resumed.step}, the run's train.max_steps is "
            f"{cfg.train.max_steps}: nothing to train; continue it with --max-steps N "
            f"(N > {resumed.step})"
        )
    claim = run_dir.choose(args.out, args.resume, _peer_flags(args))  # held until the end
    for change in changes:
        print(f"atom: resuming with {change}", flush=True)
    if saved is not None and cfg.gossip.enabled and not (args.listen or args.join):
        print(
            f"atom: resuming as a peer (saved in the run: gossip.listen {cfg.gossip.listen}, "
            f"gossip.join {cfg.gossip.join or 'none'}); --alone continues it without peers",
            flush=True,
        )
    if saved is None and plan is None and not args.resident:  # a resumed run keeps its own
        print(
            "atom: no --plan: using the config's swap settings "
            f"(layers_per_unit {cfg.swap.layers_per_unit}, prefetch {cfg.swap.prefetch}, "
            f"checkpoint {cfg.swap.checkpoint}); run `atom profile` to choose them for "
            "this machine",
            flush=True,
        )
    return cfg, plan, claim


def cmd_train(args) -> int:
    cfg, plan, claim = resolve_run(args)
    with claim:  # one process writes a run directory at a time (atom/store/run_dir.py RunLock)
        return _train(args, cfg, plan, claim.path)


def _train(args, cfg, plan, out: Path) -> int:
    from atom.run.run_config import host_bytes_needed
    from atom.run.train import Trainer

    trainer = Trainer(
        cfg,
        out,
        resident=args.resident,
        resume=Path(args.resume) if args.resume else None,
        progress=not args.no_progress and sys.stderr.isatty(),
        prediction=plan.prediction if plan else None,
    )
    info = trainer.engine.info()
    n_params = sum(t.numel() for t in trainer.engine.named_parameters().values())
    host = host_bytes_needed(cfg, trainer.engine.dtype)[1]
    if cfg.model.init_from:  # a Qwen2 or Mistral checkpoint runs as atom's llama blocks
        from atom.hf import checkpoint_name

        what = checkpoint_name(cfg.model.init_from)
    else:
        what = cfg.model.arch
    print(
        f"atom: training {what} ({n_params / 1e6:.1f}M parameters, "
        f"{cfg.model.n_layer} layers, d={cfg.model.d_model}) on {trainer.data_dir} "
        f"[{info.mode}] from step {trainer.start_step}; host RAM for model state "
        f"{host / 2**30:.2f} GiB"
        + (f" ({info.pinned_bytes / 2**30:.2f} GiB of it pinned)" if info.pinned_bytes else "")
        + (f", {cfg.swap.state} state" if cfg.swap.state != "fp32" else "")
        + (f"; {info.disk}" if info.disk else ""),
        flush=True,
    )
    main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, _terminate_like_ctrl_c) if main_thread else None
    try:
        summary = trainer.run()
    except KeyboardInterrupt:
        saved = trainer.interrupt_checkpoint
        if saved is not None:
            print(f"atom: interrupted; checkpoint saved: {saved}")
        else:
            from atom.store.checkpoint import list_checkpoints

            kept = list_checkpoints(out)
            print(
                "atom: interrupted; no new checkpoint"
                + (f" (the newest is {kept[-1]})" if kept else "")
            )
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous_term)
    if summary.history:
        first = summary.history[0]["loss"]
        print(
            f"atom: {summary.steps} steps; loss {first:.4f} -> {summary.last_loss:.4f}; "
            f"val loss {summary.val_loss:.4f}; {summary.tokens:,} tokens in "
            f"{summary.wall_s:.1f} s: {summary.tokens_per_s:,.0f} tokens/s "
            f"({summary.step_tokens_per_s:,.0f} over the steps' own time); "
            f"device peak {summary.device_peak_bytes / 2**20:.1f} MiB"
        )
    if plan is not None and summary.step_time_s is not None:
        pred = plan.prediction
        print(
            f"atom: plan predicted {pred.step_s:.3f} s/step and "
            f"{pred.peak_device_bytes / 2**20:.1f} MiB device peak; measured "
            f"{summary.step_time_s:.3f} s/step (median; "
            f"{summary.step_time_s / pred.step_s:.2f}x) and "
            f"{summary.device_peak_bytes / 2**20:.1f} MiB "
            f"({summary.device_peak_bytes / max(pred.peak_device_bytes, 1):.2f}x)"
        )
    saved_to = f"checkpoint {summary.checkpoint}" if summary.checkpoint else "no checkpoint written"
    print(f"atom: {saved_to}; metrics {out / 'metrics.jsonl'}")
    return 0
