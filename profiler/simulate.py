"""Cost model: tokens/s and time-to-loss of atom, GPipe pipeline parallel and synchronous
data parallel for a group of peers joined by a link matrix. `atom simulate` is its
command line (atom/cli/simulate.py); tools/bench/vs_pipeline.py validates it.

Inputs come from the profiler: per-block forward/backward time at a micro-batch size
(measured, or estimated from FLOPs for a stated GPU), host<->device bandwidth and the host
optimizer's speed (HardwareSpec), bytes per unit (ModelAnalysis). Every peer has the same
machine; `compute_scale` slows its compute (e.g. several processes sharing cores).

atom      each peer trains a full copy at `peer_batch` sequences per step; its step time
          is the profiler's swap model (atom.profiler.cost.predict) for the config's partition
          or the planner's best plan. Gossip never blocks a step: it sets how often each
          unit is averaged. A push-pull of unit u with partner j moves the unit both ways,
          e = 2 * wire_bytes(u) / rate(i, j) + 2 * latency; a peer runs `lanes` exchanges at
          once and starts at most one per `interval_s`, and takes part in about as many
          exchanges started by others, so a unit of peer i is averaged every
              tau = step_rate * n_units / (2 * min(1 / interval_s, lanes / mean e))
          optimizer steps. With an outer optimizer (gossip.strategy diloco or noloco) a
          unit is due for an exchange H = diloco_steps steps after its last one, started
          or served; served ones arrive at random, so a peer starts one when no partner
          did first: with served exchanges arriving as a Poisson stream at the rate a
          peer starts them, r, that happens with probability e^(-rH) = 1/2 (the rate
          started equals the rate served), r = ln 2 / H and tau = H / (2 ln 2) ~ 0.72 H
          (measured 0.78 H at H 30 with 4 peers). NoLoCo's payload is twice the unit
          (outer weights and pseudo-gradient).
pipeline  GPipe, one stage per peer (peer order = stage order): consecutive blocks, the
          embedding on the first stage, the head on the last, blocks balanced so that the
          slowest stage (the head's, often) is as fast as it can be. `chunks` micro-batches of
          peers * peer_batch / chunks sequences; activations (micro x seq x d_model in the
          compute dtype) cross each boundary forward and their gradients cross back, each
          link a FIFO whose transfers overlap compute. The step is simulated event by
          event (gpipe_time); with free links it is (M + S - 1)(t_f + t_b), bubble
          (S - 1)/(M + S - 1). A stage holds its parameters, optimizer state and the
          activations of all M micro-batches on its GPU; when those do not fit, it
          recomputes (activation checkpointing) and when even the parameters do not fit
          the prediction is marked as not fitting.
ddp       every peer runs atom's per-peer step on its own batch, then a ring all-reduce of
          the gradients (compute dtype): 2(N-1)/N * params * bytes at the slowest link,
          + 2(N-1) latencies. DDP buckets of 25 MB overlap the backward except the last.

Time-to-loss: the two synchronous systems are sync SGD at peers * peer_batch sequences
per step; if that needs D tokens to reach a loss, they take D / tokens_per_s. atom's
peers average only every tau steps, so a token is worth less: efficiency
    eta(tau) = 1/N + (1 - 1/N) * tau0 / (tau0 + tau)
(1 with averaging every step, 1/N for N independent runs), and atom takes
D / (tokens_per_s * eta). tau0 is fitted to the measured runs (docs/benchmarks.md): an
assumption that a tiny CPU model's mixing transfers to the model being asked about. The
outer optimizers make an outer step worth more than a plain average, so they have their
own tau0 (OUTER_TAU0), fitted the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from atom.config import Config, replace
from atom.profiler.analysis import ModelAnalysis, dtype_bytes
from atom.profiler.cost import Candidate, Prediction, predict
from atom.profiler.hardware import HardwareSpec
from atom.profiler.timing import PieceTimes

# Fitted to the 2026-11-21 measured runs (tools/bench/vs_pipeline.py report); see
# docs/benchmarks.md. Steps between averagings of a unit at which atom keeps half of the
# gap between N independent runs and sync SGD.
DEFAULT_TAU0 = 5.6
# fitted to the 2026-11-25 shaped-link runs of the outer optimizer (H 30, int8; 1 Gb/s
# and 20 Mb/s); noloco was not run on shaped links and is assumed alike
OUTER_TAU0 = {"diloco": 15.9, "noloco": 15.9}
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
GPU_ADAM_S_PER_PARAM = 3.5e-11  # fused Adam on the GPU: ~32 B/param at ~900 GB/s


@dataclass
class Links:
    """Rates in Mb/s, link i -> j (diagonal unused), and a one-way latency."""

    mbps: list[list[float]]
    latency_s: float = 0.0

    @classmethod
    def uniform(cls, peers: int, mbps: float, latency_s: float = 0.0) -> Links:
        return cls([[mbps] * peers for _ in range(peers)], latency_s)

    def __post_init__(self) -> None:
        n = len(self.mbps)
        if n < 2 or any(len(row) != n for row in self.mbps):
            raise ValueError("the link matrix must be square with at least 2 peers")
        if any(self.mbps[i][j] <= 0 for i in range(n) for j in range(n) if i != j):
            raise ValueError("every link rate must be > 0 Mb/s")
        if self.latency_s < 0:
            raise ValueError("latency must be >= 0")

    @property
    def peers(self) -> int:
        return len(self.mbps)

    def bps(self, i: int, j: int) -> float:
        """Bytes per second on link i -> j."""
        return self.mbps[i][j] * 1e6 / 8

    def slowest_bps(self) -> float:
        n = self.peers
        return min(self.bps(i, j) for i in range(n) for j in range(n) if i != j)


@dataclass
class Workload:
    peers: int
    peer_batch: int  # sequences per peer per optimizer step (atom, ddp)
    chunks: int  # pipeline micro-batches per step (GPipe's M)
    codec_bytes: Callable[[int], int] = lambda n: 4 * n  # gossip wire bytes of n params
    lanes: int = 2
    interval_s: float = 0.1
    tau0: float | None = None  # None: DEFAULT_TAU0, or OUTER_TAU0 of the strategy
    strategy: str = "gossip"  # gossip | diloco | noloco (gossip.strategy)
    inner_steps: int = 30  # H, steps between a unit's outer steps (gossip.diloco_steps)

    @property
    def convergence_tau0(self) -> float:
        if self.tau0 is not None:
            return self.tau0
        return OUTER_TAU0.get(self.strategy, DEFAULT_TAU0)

    @property
    def payload_factor(self) -> int:
        return 2 if self.strategy == "noloco" else 1  # noloco sends [outer; pseudo-grad]

    @property
    def sync_batch(self) -> int:
        return self.peers * self.peer_batch

    @property
    def pipeline_micro(self) -> int:
        if self.sync_batch % self.chunks:
            raise ValueError(f"peers x batch ({self.sync_batch}) must divide into {self.chunks}")
        return self.sync_batch // self.chunks


@dataclass
class Machine:
    """One peer's machine: the hardware, compute dtype, piece times per micro-batch."""

    hw: HardwareSpec
    dtype: torch.dtype
    times: Callable[[int], PieceTimes]
    compute_scale: float = 1.0

    def __post_init__(self) -> None:
        s = self.compute_scale
        if s != 1.0:  # host work (optimizer, copies, per-unit overhead) slows down alike
            self.hw = dataclasses.replace(
                self.hw,
                adam_s_per_param=self.hw.adam_s_per_param * s,
                accum_s_per_param=self.hw.accum_s_per_param * s,
                unit_overhead_s=self.hw.unit_overhead_s * s,
                unit_update_overhead_s=self.hw.unit_update_overhead_s * s,
                h2d_bps=self.hw.h2d_bps / s,
                d2h_bps=self.hw.d2h_bps / s,
                duplex_h2d_bps=self.hw.duplex_h2d_bps / s,
                duplex_d2h_bps=self.hw.duplex_d2h_bps / s,
                host_mem_bps=self.hw.host_mem_bps / s,
            )

    def pieces(self, micro: int) -> PieceTimes:
        t = self.times(micro)
        s = self.compute_scale
        return PieceTimes(t.block_fwd * s, t.block_bwd * s, t.head * s, t.embed * s)

    @property
    def cuda(self) -> bool:
        return self.hw.device == "cuda"


@dataclass
class SystemPrediction:
    system: str  # atom | pipeline | ddp
    step_s: float
    tokens_per_step: int  # across the group
    tokens_per_s: float
    comm_s: float  # network time per step not hidden under compute
    sent_bytes_per_step: float  # bytes one peer puts on the network per optimizer step
    efficiency: float  # convergence per token relative to sync SGD at the group's batch
    fits: bool = True
    note: str = ""
    detail: dict = field(default_factory=dict)

    def time_to(self, sync_tokens: float) -> float:
        """Seconds to reach the loss sync SGD reaches after sync_tokens tokens."""
        return sync_tokens / (self.tokens_per_s * self.efficiency)

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------ arithmetic
def allreduce_s(nbytes: float, peers: int, bps: float, latency_s: float = 0.0) -> float:
    """Ring all-reduce: each peer sends and receives 2(N-1)/N of the buffer."""
    if peers < 2:
        return 0.0
    return 2 * (peers - 1) / peers * nbytes / bps + 2 * (peers - 1) * latency_s


def exposed_allreduce_s(total_s: float, backward_s: float, n_buckets: int) -> float:
    """What of the all-reduce the backward cannot hide: all buckets but the last can start
    while the backward still runs; the last starts when it ends."""
    n_buckets = max(1, n_buckets)
    last = total_s / n_buckets
    return max(last, total_s - backward_s * (n_buckets - 1) / n_buckets)


def gpipe_time(
    fwd: Sequence[float],
    bwd: Sequence[float],
    send_fwd: Sequence[float],
    send_bwd: Sequence[float],
    chunks: int,
) -> float:
    """One GPipe step (all forwards, then all backwards), event by event.

    fwd[s], bwd[s]: stage s's compute per micro-batch; send_fwd[s]: the activation
    transfer s -> s+1, send_bwd[s]: the gradient transfer s+1 -> s. Each link carries one
    transfer at a time in order; sends overlap the sender's next compute (as
    torch.distributed.pipelining's isend); a stage starts its backward after its own
    forwards and their sends are done."""
    S, M = len(fwd), chunks
    if len(bwd) != S or len(send_fwd) != S - 1 or len(send_bwd) != S - 1 or M < 1:
        raise ValueError("gpipe_time: need S fwd/bwd times, S-1 transfers each way, M >= 1")
    arrive = [0.0] * M  # arrival of micro-batch m's input at the current stage
    fwd_end, sends_done = [0.0] * S, [0.0] * S
    for s in range(S):
        t, link, nxt = 0.0, 0.0, [0.0] * M
        for m in range(M):
            t = max(t, arrive[m]) + fwd[s]
            if s < S - 1:
                link = max(link, t) + send_fwd[s]
                nxt[m] = link
        fwd_end[s], sends_done[s] = t, link
        arrive = nxt
    grad = [0.0] * M  # arrival of micro-batch m's output gradient at the current stage
    end = 0.0
    for s in reversed(range(S)):
        t, link, nxt = max(fwd_end[s], sends_done[s]), 0.0, [0.0] * M
        for m in range(M):
            t = max(t, grad[m]) + bwd[s]
            if s > 0:
                link = max(link, t) + send_bwd[s - 1]
                nxt[m] = link
        end = max(end, t, link)
        grad = nxt
    return end


def efficiency(tau: float, peers: int, tau0: float) -> float:
    """Convergence per token relative to sync SGD: 1 at tau 0, 1/N without mixing."""
    if peers < 2:
        return 1.0
    floor = 1.0 / peers
    if tau0 <= 0:
        return floor
    return floor + (1 - floor) * tau0 / (tau0 + max(tau, 0.0))


def split_layers(n_layer: int, stages: int, block_s: float = 1.0, first_s: float = 0.0,
                 last_s: float = 0.0) -> list[int]:  # fmt: skip
    """Blocks per stage that minimise the slowest stage, given a block's time and the extra
    time of the first (embedding) and last (head) stage; every stage gets at least one.
    Without extras this is the even split tools/baselines/pipeline.py uses. Greedy (each
    block to the stage that stays fastest) is optimal for identical blocks."""
    if stages > n_layer:
        raise ValueError(f"{stages} pipeline stages need at least {stages} layers")
    extra = [0.0] * stages
    extra[0] += first_s
    extra[-1] += last_s
    counts = [1] * stages
    for _ in range(n_layer - stages):
        k = min(range(stages), key=lambda s: (extra[s] + (counts[s] + 1) * block_s, s))
        counts[k] += 1
    return counts


# ------------------------------------------------------------------ systems
def atom_step(cfg: Config, m: Machine, micro: int, accum: int, plan: Candidate | None
              ) -> tuple[Prediction, Candidate]:  # fmt: skip
    """The per-peer swapped step: the given partition, or the planner's fastest that fits."""
    if plan is None:
        from atom.profiler.planner import choose, search

        target = micro * accum
        ranked = choose(search(cfg, m.hw, m.dtype, target, lambda b, a: m.pieces(b)),
                        m.hw, cfg, m.dtype)  # fmt: skip
        return ranked[0].prediction, ranked[0].candidate
    a = ModelAnalysis.of(replace(cfg, swap={"layers_per_unit": plan.layers_per_unit}))
    return predict(a, plan, m.hw, m.pieces(plan.micro_batch), m.dtype), plan


def simulate_atom(cfg: Config, m: Machine, links: Links, w: Workload,
                  step: Prediction, plan: Candidate) -> SystemPrediction:  # fmt: skip
    a = ModelAnalysis.of(replace(cfg, swap={"layers_per_unit": plan.layers_per_unit}))
    units = [u.n_owned for u in a.units if u.n_owned > 0]
    n = links.peers
    wire = [w.codec_bytes(w.payload_factor * u) for u in units]
    # mean exchange time over units and partners (uniform choice of both)
    e = sum(
        2 * b / links.bps(i, j) + 2 * links.latency_s
        for b in wire
        for i in range(n)
        for j in range(n)
        if i != j
    ) / (len(wire) * n * (n - 1))
    started = min(1.0 / w.interval_s if w.interval_s > 0 else math.inf, w.lanes / e)
    if w.strategy != "gossip":  # a unit is due H steps after its last exchange
        started = min(started, math.log(2) * len(units) / (w.inner_steps * step.step_s))
    involved = 2 * started  # ours, and about as many started by others
    tau = (1.0 / step.step_s) * len(units) / involved
    eta = efficiency(tau, n, w.convergence_tau0)
    tokens = w.peer_batch * cfg.model.seq_len
    return SystemPrediction(
        system="atom",
        step_s=step.step_s,
        tokens_per_step=n * tokens,
        tokens_per_s=n * tokens / step.step_s,
        comm_s=0.0,
        sent_bytes_per_step=involved * sum(wire) / len(wire) * step.step_s,
        efficiency=eta,
        note=f"{w.strategy}, {plan.layers_per_unit} layer(s)/unit, prefetch {plan.prefetch}, "
        f"micro {plan.micro_batch} x {plan.grad_accum}, checkpoint {plan.checkpoint}",
        detail={
            "tau_steps": tau,
            "exchange_s": e,
            "exchanges_per_s": involved,
            "units": len(units),
            "bottleneck": step.bottleneck,
        },  # fmt: skip
    )


def simulate_ddp(cfg: Config, m: Machine, links: Links, w: Workload,
                 step: Prediction) -> SystemPrediction:  # fmt: skip
    n = links.peers
    a = ModelAnalysis.of(cfg)
    grad_bytes = a.n_params * dtype_bytes(m.dtype)
    total = allreduce_s(grad_bytes, n, links.slowest_bps(), links.latency_s)
    buckets = math.ceil(grad_bytes / DDP_BUCKET_BYTES)
    exposed = exposed_allreduce_s(total, step.detail.get("backward_s", 0.0), buckets)
    step_s = step.step_s + exposed
    tokens = n * w.peer_batch * cfg.model.seq_len
    return SystemPrediction(
        system="ddp",
        step_s=step_s,
        tokens_per_step=tokens,
        tokens_per_s=tokens / step_s,
        comm_s=exposed,
        sent_bytes_per_step=2 * (n - 1) / n * grad_bytes,
        efficiency=1.0,
        note=f"ring all-reduce {grad_bytes / 2**20:.0f} MiB in {buckets} bucket(s)",
        detail={"allreduce_s": total, "compute_s": step.step_s},
    )


def simulate_pipeline(cfg: Config, m: Machine, links: Links, w: Workload) -> SystemPrediction:
    n = links.peers
    mc = cfg.model
    micro, M = w.pipeline_micro, w.chunks
    a = ModelAnalysis.of(replace(cfg, swap={"layers_per_unit": 1}))
    dt = dtype_bytes(m.dtype)
    t = m.pieces(micro)
    layers = split_layers(mc.n_layer, n, t.block_fwd + t.block_bwd, t.embed, t.head)
    embed_p = a.units[0].n_owned
    head_p = a.units[-1].n_owned
    block_p = a.block_params()
    act = micro * mc.seq_len * mc.d_model * dt
    fwd, bwd, recompute, short = [], [], [], []
    state_per_param = 16 + (dt if dt != 4 else 0)  # fp32 master, grads, Adam, compute copy
    opt = []
    for s, nb in enumerate(layers):
        params = nb * block_p + (embed_p if s == 0 else 0) + (head_p if s == n - 1 else 0)
        f = nb * t.block_fwd + (t.embed / 3 if s == 0 else 0) + (t.head / 3 if s == n - 1 else 0)
        b = nb * t.block_bwd + (t.embed * 2 / 3 if s == 0 else 0)
        b += t.head * 2 / 3 if s == n - 1 else 0
        kept = M * nb * a.block_activation_bytes(micro, m.dtype)
        if s == n - 1:
            kept += M * a.head_activation_bytes(micro, m.dtype)
        state = params * state_per_param
        if state + kept > m.hw.device_mem:
            # activation checkpointing: keep stage inputs, recompute in the backward
            kept = M * act + nb * a.block_activation_bytes(micro, m.dtype)
            b += nb * t.block_fwd
            recompute.append(s)
            if state + kept > m.hw.device_mem:
                short.append((state + kept) / 2**30)
        fwd.append(f)
        bwd.append(b)
        adam = GPU_ADAM_S_PER_PARAM if m.cuda else m.hw.adam_s_per_param
        opt.append(params * adam)
    send_f = [act / links.bps(s, s + 1) + links.latency_s for s in range(n - 1)]
    send_b = [act / links.bps(s + 1, s) + links.latency_s for s in range(n - 1)]
    sched = gpipe_time(fwd, bwd, send_f, send_b, M)
    free = gpipe_time(fwd, bwd, [0.0] * (n - 1), [0.0] * (n - 1), M)
    clip = 2 * (n - 1) * links.latency_s  # the global grad-norm all-reduce (one scalar)
    step_s = sched + max(opt) + clip
    tokens = w.sync_batch * mc.seq_len
    notes = [f"{M} x {micro} sequences, {min(layers)}-{max(layers)} layers/stage"]
    if recompute:
        notes.append(f"{len(recompute)} of {n} stages recompute activations")
    if short:
        notes.append(f"a stage needs up to {max(short):.1f} GiB of device memory")
    return SystemPrediction(
        system="pipeline",
        step_s=step_s,
        tokens_per_step=tokens,
        tokens_per_s=tokens / step_s,
        comm_s=sched - free + clip,
        sent_bytes_per_step=M * act,
        efficiency=1.0,
        fits=not short,
        note="; ".join(notes),
        detail={"bubble": (n - 1) / (M + n - 1), "free_links_s": free, "activation_bytes": act},
    )


def simulate(cfg: Config, m: Machine, links: Links, w: Workload,
             plan: Candidate | None = None) -> list[SystemPrediction]:  # fmt: skip
    """The three systems for one group. `plan` fixes atom's partition (None: the planner's
    fastest that fits this machine); ddp uses the same per-peer step."""
    if links.peers != w.peers:
        raise ValueError(f"{w.peers} peers but a {links.peers} x {links.peers} link matrix")
    step, cand = atom_step(cfg, m, w.peer_batch if plan is None else plan.micro_batch,
                           1 if plan is None else plan.grad_accum, plan)  # fmt: skip
    return [
        simulate_atom(cfg, m, links, w, step, cand),
        simulate_pipeline(cfg, m, links, w),
        simulate_ddp(cfg, m, links, w, step),
    ]
