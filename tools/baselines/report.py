"""Report of tools/bench/vs_pipeline.py: the measured table, the simulator's prediction of
the same runs with its error, atom's measured convergence per token, and the figures.

    .venv/bin/python -m tools.bench.vs_pipeline report --work runs/bench_vs_pipeline

Writes WORK/report.json, WORK/report.md (the tables docs/benchmarks.md quotes) and
DOCS/bench_vs_pipeline_loss.png, DOCS/bench_vs_pipeline_throughput.png.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path

from tools.baselines import analysis as an
from tools.baselines.settings import ATOM_VARIANTS

log = logging.getLogger(__name__)


def predictions(work: Path, profile: dict, rates: list[float], peers: int, chunks: int,
                tau0: dict[str, float], scale: float) -> dict:  # fmt: skip
    """The simulator's view of every run: fed the one-thread profile, compute slowed by
    `scale` (4 processes took turns on 2 cores in every run); each atom variant with its
    own gossip settings (strategy, H, codec) and fitted tau0."""
    import torch

    from atom.config import load_config
    from atom.gossip.net.codecs import get_codec
    from atom.profiler.cost import Candidate
    from atom.profiler.hardware import HardwareSpec
    from atom.profiler.simulate import Links, Machine, Workload, simulate
    from atom.profiler.timing import PieceTimes, scaled_times
    from tools.baselines.settings import ATOM_ONLY, overrides

    hw = HardwareSpec.from_dict(profile["hardware"])
    table = {int(k): PieceTimes(**v) for k, v in profile["pieces"].items()}
    m = Machine(hw, torch.float32, scaled_times(table), scale)
    out = {}
    for variant, settings in ATOM_VARIANTS.items():
        extra = [f"swap.checkpoint={ATOM_ONLY['swap.checkpoint']}"]
        extra += [f"{k}={v}" for k, v in settings.items()]
        cfg = load_config(None, overrides() + extra)
        g, s = cfg.gossip, cfg.swap
        plan = Candidate(s.layers_per_unit, s.prefetch, cfg.train.micro_batch, 1, s.checkpoint,
                         s.offload_activations)  # fmt: skip
        w = Workload(peers, cfg.train.micro_batch, chunks, get_codec(g.codec).wire_bytes,
                     g.lanes, g.interval_s, tau0.get(variant), g.strategy,
                     g.diloco_steps)  # fmt: skip
        for r in rates:
            for p in simulate(cfg, m, Links.uniform(peers, r), w, plan):
                out[(variant if p.system == "atom" else p.system, r)] = p
    return {"scale": scale, "by_run": out}


SHOWN = (*ATOM_VARIANTS, "pipeline", "ddp")  # the order of tables and figures


def _pct(pred: float, meas: float) -> str:
    return f"{(pred / meas - 1) * 100:+.0f}%"


def report(work: Path, docs: Path, target_loss: float | None = None) -> dict:
    from atom.profiler.analysis import ModelAnalysis

    index = [e for e in json.loads((work / "runs.json").read_text()) if not e.get("error")]
    if not index:
        raise SystemExit(f"no finished runs in {work}/runs.json; run `bench_vs_pipeline run`")
    peers, chunks = index[0]["peers"], index[0]["chunks"]
    profile = json.loads((work / "profile.json").read_text())
    ev = an.Evaluator(work)
    n_units = sum(1 for u in ModelAnalysis.of(ev.cfg).units if u.n_owned > 0)
    runs: dict[tuple[str, float], dict] = {}
    for e in index:
        run = work / e["dir"]
        if e["system"] in ATOM_VARIANTS:
            res = an.atom_run(ev, run, peers, n_units)
        else:
            res = an.baseline_run(ev, run, e["system"], peers)
        res["foreign_cpu_share"] = e.get("foreign_cpu_share")
        runs[(e["system"], e["mbps"])] = res
        ev.save()
    ref = an.reference_curve(ev, work) if (work / "reference").exists() else []
    ev.save()
    rates = sorted({r for _, r in runs}, reverse=True)
    # each atom variant's convergence per token against the sync reference, and its tau0
    # fitted to it (None: the simulator's default for the variant's strategy)
    pairs: dict[str, list] = {}
    etas: dict[tuple[str, float], float | None] = {}
    for (system, r), res in runs.items():
        if system in ATOM_VARIANTS and ref:
            eta = etas[(system, r)] = an.measured_eta(ref, res["curve"])
            if eta is not None and res["tau_steps"] < float("inf"):
                pairs.setdefault(system, []).append((res["tau_steps"], eta))
    tau0 = {v: an.fit_tau0(p, peers) for v, p in pairs.items()}
    # the compute scale: measured (trainers sharing the cores, no network) when the sweep
    # measured it, else assumed processes / cores; both errors are reported
    assumed = max(1.0, peers / profile["cores"])
    measured = profile.get("contention", {}).get("compute_scale")
    pred_assumed = predictions(work, profile, rates, peers, chunks, tau0, assumed)
    pred = (
        pred_assumed
        if measured is None
        else predictions(work, profile, rates, peers, chunks, tau0, measured)
    )
    if target_loss is None:  # the lowest loss every atom run and the reference reached
        finals = [runs[k]["curve"][-1]["val_loss"] for k in runs if k[0] in ATOM_VARIANTS]
        target_loss = round(max(finals + [ref[-1][1] if ref else 0]) + 0.005, 2)
    need = an.sync_tokens(ref, target_loss) if ref else None
    rows = []
    for r in rates:
        for system in SHOWN:
            res = runs.get((system, r))
            if res is None or not res["curve"]:
                continue
            p = pred["by_run"][(system, r)]
            t_meas = an.time_to_loss(res["curve"], target_loss)
            extrapolated = t_meas is None and bool(need) and system not in ATOM_VARIANTS
            if extrapolated:
                # sync SGD at the reference's batch: it needs the reference's tokens, at
                # the measured tokens/s (a run too short to get there on a slow link)
                t_meas = need / res["tokens_per_s"]
            t_pred = p.time_to(need) if need else None
            rows.append({
                "mbps": r, "system": system, "steps": res["steps"], "wall_s": res["wall_s"],
                "tokens_per_s": res["tokens_per_s"], "pred_tokens_per_s": p.tokens_per_s,
                "final_val_loss": res["curve"][-1]["val_loss"],
                "time_to_target_s": t_meas, "pred_time_to_target_s": t_pred,
                "time_to_target_extrapolated": extrapolated,
                "tau_steps": res.get("tau_steps"), "pred_tau_steps": p.detail.get("tau_steps"),
                "eta": etas.get((system, r), 1.0), "pred_eta": p.efficiency,
                "sent_bytes_per_step": res.get("sent_bytes_per_step"),
                "pred_sent_bytes_per_step": p.sent_bytes_per_step,
                "foreign_cpu_share": res["foreign_cpu_share"],
            })  # fmt: skip
    errs = [abs(x["pred_tokens_per_s"] / x["tokens_per_s"] - 1) for x in rows]
    errs_assumed = [
        abs(pred_assumed["by_run"][(x["system"], x["mbps"])].tokens_per_s / x["tokens_per_s"] - 1)
        for x in rows
    ]
    t_errs = [
        abs(x["pred_time_to_target_s"] / x["time_to_target_s"] - 1)
        for x in rows
        if x["time_to_target_s"]
        and not x["time_to_target_extrapolated"]
        and x["pred_time_to_target_s"]
    ]
    summary = {
        "date": index[0].get("date"),
        "peers": peers,
        "chunks": chunks,
        "seconds": index[0]["seconds"],
        "compute_scale": pred["scale"],
        "compute_scale_assumed": assumed,
        "throughput_error_mean_abs_assumed_scale": (
            statistics.mean(errs_assumed) if errs_assumed else None
        ),
        "target_loss": target_loss,
        "reference_tokens_to_target": need,
        "tau0": tau0,
        "tau_eta_pairs": pairs,
        "throughput_error_mean_abs": statistics.mean(errs) if errs else None,
        "throughput_error_max_abs": max(errs) if errs else None,
        "time_error_mean_abs": statistics.mean(t_errs) if t_errs else None,
        "rows": rows,
        "curves": {f"{s}@{r:g}": runs[(s, r)]["curve"] for s, r in runs},
        "reference": ref,
    }
    (work / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
    (work / "report.md").write_text(markdown(summary) + "\n")
    figures(summary, runs, rates, docs)
    print(markdown(summary))
    return summary


def _t(s: float | None, extrapolated: bool = False) -> str:
    if s is None:
        return "not reached"
    return f"~{s:.0f} s (extrapolated)" if extrapolated else f"{s:.0f} s"


def markdown(s: dict) -> str:
    lines = [
        f"Target loss {s['target_loss']:.2f} (the sync-SGD reference needs "
        f"{(s['reference_tokens_to_target'] or 0) / 1e6:.2f}M tokens); fitted tau0 "
        f"{', '.join(f'{v} {t:.2f}' for v, t in s['tau0'].items()) or '-'} steps; "
        f"compute scale {s['compute_scale']:.2f} "
        f"({'measured' if s['compute_scale'] != s['compute_scale_assumed'] else 'assumed'}"
        f"; processes / cores would be {s['compute_scale_assumed']:g}).",
        "",
        "| link | system | steps | tokens/s | val loss at end | time to target | "
        "sent per peer per step | other users' CPU |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        share = r["foreign_cpu_share"]
        sent = r["sent_bytes_per_step"]  # measured (atom), else the model's arithmetic
        sent_s = (f"{sent / 1e3:,.0f} kB" if sent is not None
                  else f"{r['pred_sent_bytes_per_step'] / 1e3:,.0f} kB (model)")  # fmt: skip
        took = _t(r["time_to_target_s"], r["time_to_target_extrapolated"])
        lines.append(
            f"| {r['mbps']:g} Mb/s | {an.LABEL[r['system']]} | {r['steps']:.0f} | "
            f"{r['tokens_per_s']:,.0f} | {r['final_val_loss']:.3f} | "
            f"{took} | {sent_s} | {'-' if share is None else f'{share:.0%}'} |"
        )
    lines += [
        "",
        "| link | system | tokens/s measured | predicted | error | tau measured | predicted "
        "| eta measured | predicted | time to target measured | predicted |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in s["rows"]:
        tau, ptau, eta = r["tau_steps"], r["pred_tau_steps"], r["eta"]
        lines.append(
            f"| {r['mbps']:g} Mb/s | {r['system']} | {r['tokens_per_s']:,.0f} | "
            f"{r['pred_tokens_per_s']:,.0f} | "
            f"{_pct(r['pred_tokens_per_s'], r['tokens_per_s'])} | "
            f"{'' if tau is None else f'{tau:.1f}'} | "
            f"{'' if ptau is None else f'{ptau:.1f}'} | "
            f"{'' if eta is None else f'{eta:.2f}'} | {r['pred_eta']:.2f} | "
            f"{_t(r['time_to_target_s'], r['time_to_target_extrapolated'])} | "
            f"{_t(r['pred_time_to_target_s'])} |"
        )
    if s["throughput_error_mean_abs"] is not None:
        lines += [
            "",
            f"Throughput prediction error: mean |error| "
            f"{s['throughput_error_mean_abs']:.0%}, max {s['throughput_error_max_abs']:.0%}"
            + (
                f"; time-to-target mean |error| {s['time_error_mean_abs']:.0%}"
                if s["time_error_mean_abs"] is not None
                else ""
            )
            + "."
            + (
                f" With the assumed compute scale: mean |error| "
                f"{s['throughput_error_mean_abs_assumed_scale']:.0%}."
                if s["compute_scale"] != s["compute_scale_assumed"]
                else ""
            ),
        ]
    return "\n".join(lines)


def figures(s: dict, runs: dict, rates: list[float], docs: Path) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib.pyplot as plt

    docs.mkdir(parents=True, exist_ok=True)
    cols = min(len(rates), 4)
    fig, axes = plt.subplots(1, cols, figsize=(4 * cols, 3.6), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rates, strict=False):
        for system in SHOWN:
            res = runs.get((system, r))
            if not res or not res["curve"]:
                continue
            xs = [0.0] + [p["wall_s"] for p in res["curve"]]
            ys = [s["reference"][0][1] if s["reference"] else None] + [
                p["val_loss"] for p in res["curve"]
            ]
            if ys[0] is None:
                xs, ys = xs[1:], ys[1:]
            ax.plot(xs, ys, marker="o", ms=3, color=an.COLOR[system], label=an.LABEL[system])
        ax.axhline(s["target_loss"], color="grey", lw=0.8, ls=":")
        ax.set_title(f"{r:g} Mb/s links")
        ax.set_xlabel("training wall time (s)")
        ax.grid(alpha=0.3)
    lows = [p["val_loss"] for res in runs.values() for p in res["curve"]]
    if lows:
        axes[0][0].set_ylim(min(lows) - 0.05, min(3.2, max(lows) + 0.05))
    axes[0][0].set_ylabel("validation loss")
    axes[0][0].legend(fontsize=8)
    title = f"{s['peers']} peers / stages / ranks, one namespace each, on 2 CPU cores"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(docs / "bench_vs_pipeline_loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for system in SHOWN:
        pts = [(r["mbps"], r["tokens_per_s"], r["pred_tokens_per_s"])
               for r in s["rows"] if r["system"] == system]  # fmt: skip
        if not pts:
            continue
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=an.COLOR[system],
                label=f"{an.LABEL[system]} measured")  # fmt: skip
        ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=an.COLOR[system],
                alpha=0.7, label="predicted (atom simulate)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate (Mb/s)")
    ax.set_ylabel("group tokens/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(docs / "bench_vs_pipeline_throughput.png", dpi=110)
    plt.close(fig)
