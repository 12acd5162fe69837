"""The training loop: data -> engine (swapped or resident) -> metrics, eval, checkpoints.

Everything that differs between swapped and resident training lives in the engines;
this loop only sees train_step / evaluate / state_files / load_state.
"""

from __future__ import annotations

import base64
import binascii
import errno
import json
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from atom.config import Config, ConfigError, model_differences
from atom.data.tokens import TokenData, check_vocab, default_corpus, peer_seed
from atom.ground.atomic_dir import write_text_atomic
from atom.ground.device import resolve_device
from atom.ground.engine_protocol import Engine
from atom.ground.errors import TrainingError
from atom.model.documents import IGNORE
from atom.run.guard import LossWatch, check_weights, gossip_alarm
from atom.run.run_config import check_host_memory, host_bytes_needed  # noqa: F401 (atom.run.train's API)
from atom.run.run_log import RunLog
from atom.run.signals import Interrupts
from atom.store.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from atom.store.run_dir import continue_from

log = logging.getLogger(__name__)
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
MAX_ROLLBACKS = 2  # to the newest checkpoint, when the loss or the weights go bad
SAVE_ATTEMPTS, SAVE_RETRY_S = 4, 2.0
T = TypeVar("T")

if TYPE_CHECKING:
    from atom.profiler.cost import Prediction


def _strerror(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err).split(";")[0]


def build_engine(cfg: Config, resident: bool = False) -> Engine:
    if resident and (cfg.swap.state != "fp32" or cfg.swap.disk_dir is not None):
        raise ConfigError(
            "--resident trains plain PyTorch with fp32 state in RAM; swap.state=compact and "
            "swap.disk_dir are for swapped training: drop --resident or those settings"
        )
    device, dtype = resolve_device(cfg)
    if not resident or device.type == "cpu":
        check_host_memory(cfg, dtype)
    if resident:
        from atom.resident.engine import ResidentEngine

        return ResidentEngine(cfg, device, dtype)
    from atom.swap.backend import CpuBackend, CudaBackend
    from atom.swap.engine import SwapEngine

    # the swap engine sizes the backend's staging pool from its own units
    backend = CudaBackend(device, staging_dtype=dtype) if device.type == "cuda" else CpuBackend()
    # weights from a Hugging Face checkpoint (or a resumed one) replace any random init
    return SwapEngine(cfg, backend, dtype, init=not cfg.model.init_from)


def data_dir_for(cfg: Config) -> Path:
    if cfg.train.data == "default":
        return default_corpus()
    return Path(cfg.train.data)


@dataclass
class RunSummary:
    steps: int = 0
    last_loss: float | None = None
    val_loss: float | None = None
    tokens: int = 0  # trained by this process (steps rolled back included)
    wall_s: float | None = None  # from the first step's start to the last save's end
    tokens_per_s: float | None = None  # tokens over wall_s
    step_tokens_per_s: float | None = None  # tokens over the steps' own time (no eval, saves)
    step_time_s: float | None = None  # median of steady-state steps
    device_peak_bytes: int = 0
    checkpoint: Path | None = None
    history: list[dict] = field(default_factory=list)


def _rng_state() -> dict:
    return {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}


def _set_rng_state(state: dict) -> None:
    if "torch" in state:
        raw = base64.b64decode(state["torch"])
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


class Trainer:
    def __init__(
        self,
        cfg: Config,
        out_dir: Path,
        resident: bool = False,
        resume: Path | None = None,
        progress: bool = True,
        prediction: Prediction | None = None,
    ):
        self.cfg = cfg
        self.prediction = prediction  # from a plan: step_s and peak_device_bytes
        self.out = Path(out_dir)
        self.progress = progress
        self.resident = resident
        from atom.run.loggers import check_available

        check_available(cfg.train.logger)  # before the slow part: engine, weights, peers
        data_dir = data_dir_for(cfg)
        self.data = TokenData(data_dir, cfg.model.seq_len, cfg.train.seed)
        check_vocab(self.data.meta, cfg.model.vocab_size, data_dir)
        self.data_dir = data_dir
        ckpt = self._open_resume(resume) if resume is not None else None
        torch.manual_seed(cfg.train.seed)
        # what the run holds (engine, peers, loggers), released by close() in reverse: one
        # shutdown path, whether setup fails, the run ends, or it is interrupted
        self._resources = ExitStack()
        self.interrupt_checkpoint = None  # what an interrupted run saved (the CLI says it)
        self._rollbacks = 0
        self._skipped_saves = 0  # in a row, for a full disk (_periodic_save)
        self._saved_step: int | None = None  # the step the newest save of this run holds
        self._untold = None  # a counted step whose record is not yet told (train_step)
        self.gossip = None
        self.run_log: RunLog | None = None
        self.loggers: list = []
        try:
            self._set_up(ckpt)
        except BaseException:
            self.close()
            raise

    def _set_up(self, ckpt) -> None:
        """The engine and its weights (resumed, or a Hugging Face checkpoint's), the peers,
        the run directory and the loggers; each registered for close() as it exists."""
        cfg = self.cfg
        self.engine = build_engine(cfg, self.resident)
        self._resources.callback(self.engine.close)
        self.start_step = 0
        self._saved_at = time.monotonic()  # the state a rollback returns to (_restore too)
        if ckpt is not None:
            self._restore(ckpt)
        elif cfg.model.init_from:
            from atom.hf import load_weights  # fine-tuning: weights from a Hugging Face dir

            load_weights(self.engine, cfg, tokenizer=self.data.meta.tokenizer)
        if cfg.gossip.enabled:  # peers: listen, join, copy the group's weights and step
            from atom.gossip.peer import attach_gossip

            self.gossip = attach_gossip(cfg, self.engine.shared_units(), self.out, self.start_step)
            self._resources.callback(self._stop_gossip)  # goodbye before the engine goes
            if ckpt is not None and not self.gossip.joined_from:  # its own state, not pulled
                self._restore_gossip(ckpt)
            if cfg.gossip.own_seed:
                self._seed_as_peer(fresh=ckpt is None)
            self.start_step = self.gossip.step
            if self.start_step >= cfg.train.max_steps:  # a group at (or claiming) step 2^62
                raise ConfigError(
                    f"the group is at step {self.start_step}, at or past this run's "
                    f"train.max_steps ({cfg.train.max_steps}): nothing to train; raise "
                    "--max-steps, or join another group"
                )
        self.metrics_path = self.out / "metrics.jsonl"
        self._needing_files("opening the run directory", self._open_run_dir)
        self._resources.callback(self._close_log)

    def _seed_as_peer(self, fresh: bool) -> None:
        """A peer's own batches and random stream, from train.seed and its name: with one
        seed, peers trained on the same batches as each other (and as a run alone). A
        resumed peer's random stream is its checkpoint's, which already is its own."""
        seed = peer_seed(self.cfg.train.seed, self.gossip.id)
        self.data.reorder(seed)
        if fresh:
            torch.manual_seed(seed)
        log.info("peer %s draws its own batches: seed %d (train.seed %d and its name; "
                 "--set gossip.own_seed=false shares train.seed's)", self.gossip.id, seed,
                 self.cfg.train.seed)  # fmt: skip

    def _open_run_dir(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        continue_from(self.out, self.start_step)  # later records and checkpoints: not this run's
        # whole or not at all: peers' benches and `atom peers` read it while the run starts
        config = json.dumps(self.cfg.to_dict(), indent=2) + "\n"
        write_text_atomic(self.out / "config.json", config)
        from atom.run.loggers import make_loggers

        self.loggers = make_loggers(self.cfg.train.logger, self.out, self.start_step,
                                    self.cfg.to_dict())  # fmt: skip

    def close(self) -> None:
        """Release what the run holds, in reverse: the metrics file and loggers, the peers
        (goodbye), the engine. Idempotent."""
        self._resources.close()

    def _close_log(self) -> None:
        if self.run_log is not None:
            self.run_log.close()  # the metrics file and every logger
        else:
            for logger in self.loggers:
                logger.close()

    # ------------------------------------------------------------ checkpoints
    def _open_resume(self, path: Path):
        ckpt = load_checkpoint(Path(path), fall_back=False)  # a damaged newest: refused
        said = model_differences(ckpt.meta.get("config", {}).get("model"), self.cfg, "saved")
        if said:
            raise CheckpointError(
                f"checkpoint {ckpt.path} was trained with a different model config ({said}); "
                "resume with the same --config/--set model.* values it was saved with"
            )
        return ckpt

    def _restore(self, ckpt) -> None:
        meta = ckpt.meta
        names = set(ckpt.names())

        def get(name: str) -> torch.Tensor:
            if name not in names:
                raise CheckpointError(
                    f"checkpoint {ckpt.path} has no tensor {name!r}; it does not match this model"
                )
            return ckpt.get(name)

        try:  # meta.json's small state: damage there is a one-line refusal, not a traceback
            steps = int(meta.get("optimizer_steps", 0))
            rng = meta.get("rng", {})
            _set_rng_state(rng if isinstance(rng, dict) else {"torch": rng})
            self.engine.load_run_state({k: meta.get(k) for k in ("loss_scale", "clip")})
        except (ValueError, TypeError, RuntimeError, binascii.Error) as err:
            older = [p for p in list_checkpoints(ckpt.path.parent) if p != ckpt.path]
            fix = f"resume from an older one: --resume {older[-1]}" if older else "start anew"
            raise CheckpointError(
                f"checkpoint {ckpt.path} has a corrupt state in meta.json ({err}); {fix}"
            ) from None
        self.engine.load_state(get, steps > 0, steps)
        self.start_step = ckpt.step
        self._saved_at = time.monotonic()  # what a rollback returns to is this state
        log.info("resumed from %s at step %d", ckpt.path, self.start_step)

    def _restore_gossip(self, ckpt) -> None:
        if self.gossip.load_state(ckpt.get, set(ckpt.names()), ckpt.meta):
            log.info("resumed gossip's %s state from %s", self.gossip.merge.name, ckpt.path)
        elif self.gossip.merge.name != "gossip":
            log.info("%s holds no %s state: it starts from the resumed weights", ckpt.path,
                     self.gossip.merge.name)  # fmt: skip

    def _newest_checkpoint(self) -> Path | None:
        found = list_checkpoints(self.out) if self.out.exists() else []
        return found[-1] if found else None

    def save(self, step: int) -> Path:
        """Write a checkpoint (tried again if it ran out of open files: _needing_files)."""
        return self._needing_files(f"step {step}: saving", lambda: self._save(step),
                                   SAVE_ATTEMPTS)  # fmt: skip

    def _needing_files(self, what: str, write: Callable[[], T], attempts: int = 2) -> T:
        """write(); if it ran out of open files, again (attempts in all, SAVE_RETRY_S
        apart) with the gossip listener closed meanwhile. Every gossip connection holds a
        file descriptor, and a flooder reconnects as fast as the server sheds them: a
        save, or opening the run's files, must not lose that race (a run ended at a save)."""
        try:
            return write()
        except (OSError, CheckpointError) as err:
            if getattr(err, "errno", None) not in OUT_OF_FILES:
                raise
        log.warning(
            "%s: out of open files; trying again%s",
            what,
            " with the gossip listener closed" if self.gossip is not None else "",
        )
        freed = self.gossip.listener_closed() if self.gossip is not None else nullcontext()
        with freed:
            for attempt in range(2, attempts):
                try:
                    return write()
                except (OSError, CheckpointError) as err:
                    if getattr(err, "errno", None) not in OUT_OF_FILES:
                        raise
                log.warning("%s: still out of open files; trying again in %.0fs (%d of %d)",
                            what, SAVE_RETRY_S, attempt, attempts)  # fmt: skip
                time.sleep(SAVE_RETRY_S)
            return write()  # the last attempt: its failure is the run's

    def _save(self, step: int) -> Path:
        # never over a good checkpoint with diverged or poisoned weights
        check_weights(step, self.engine.named_parameters(), self.cfg.train.max_abs_weight,
                      self._newest_checkpoint())  # fmt: skip
        meta = {
            "config": self.cfg.to_dict(),
            "engine": "resident" if self.resident else "swap",
            "data": {
                "dir": str(self.data_dir),
                "position": step,
                "tokenizer": self.data.meta.tokenizer,
            },
            "optimizer_steps": self.engine.optimizer_steps(),
            "rng": _rng_state(),
            **self.engine.run_state(),  # loss_scale, clip
        }
        files = self.engine.state_files()
        if self.gossip is not None:  # its own state (DiLoCo's outer optimizer) resumes too
            gossip_files, gossip_meta = self.gossip.checkpoint()
            files = [*files, *gossip_files]
            meta.update(gossip_meta)
        path = save_checkpoint(
            self.out, step, files, meta, keep=max(1, self.cfg.train.keep_checkpoints)
        )
        self._saved_at = time.monotonic()  # a rollback distrusts peers merged after this
        return path

    # ------------------------------------------------------------ loop
    def evaluate(self) -> float:
        batches = self.data.val_batches(self.cfg.train.eval_batches, self.cfg.train.micro_batch)
        if batches and len(batches[0]) > 2:  # documents: each batch weighs its learned tokens
            weights = [float((b[1] != IGNORE).sum()) for b in batches]
            if sum(weights) > 0:
                return self.engine.evaluate(batches, weights)
        return self.engine.evaluate(batches)

    def _stop_gossip(self) -> None:
        if self.gossip is not None:
            self.gossip.close()  # idempotent: goodbye, threads joined, sockets closed

    def estimated_step_s(self) -> float:
        """A step's time from its FLOPs and this device's measured matmul rate (a plan's
        prediction when there is one): to warn before a step of minutes starts."""
        if self.prediction is not None:
            return float(self.prediction.step_s)
        from atom.profiler.analysis import ModelAnalysis

        m, tc = self.cfg.model, self.cfg.train
        per_token = ModelAnalysis.of(self.cfg).flops_per_token()
        fwd = m.n_layer * per_token["block"] + per_token["head"]
        recompute = 4 if self.cfg.swap.checkpoint and not self.resident else 3
        flops = recompute * fwd * tc.micro_batch * tc.grad_accum * m.seq_len
        return flops / _matmul_flops(self.engine.device, self.engine.dtype)

    def run(self, max_steps: int | None = None) -> RunSummary:
        tc = self.cfg.train
        end = min(max_steps if max_steps is not None else tc.max_steps, tc.max_steps)
        summary = RunSummary(steps=self.start_step)
        try:
            step_s = self.estimated_step_s()
            if step_s > LONG_STEP_WARN_S:
                log.warning(
                    "each step will take about %.0f min here (%s, %.0f tokens a step): "
                    "progress shows once a step ends; Ctrl+C stops within seconds between units",
                    step_s / 60,
                    self.engine.device,
                    tc.micro_batch * tc.grad_accum * self.cfg.model.seq_len,
                )
            self.run_log = self._needing_files(
                "opening metrics.jsonl",
                lambda: RunLog(self.out, self.start_step, end, self.progress, self.loggers,
                               tc.log_interval, self._tokens_per_step()),
            )  # fmt: skip
        except BaseException:
            # Ctrl+C (or SIGTERM) before the loop: the same shutdown. Left to atexit, the
            # peers' server threads once ran into pyzmq's own exit (a traceback in the log)
            self.close()
            raise
        step_times: list[float] = []  # every step this process trains
        t0 = time.perf_counter()
        with Interrupts(hold=lambda: self.engine.committed) as interrupts:
            try:
                self._loop(summary, end, interrupts, step_times)
            except KeyboardInterrupt:
                try:
                    with interrupts.saving("writing the last step's record"):
                        self._tell_cut_short(summary)
                    self.run_log.close_bar()
                    self._stop_gossip()  # goodbye first: no merge lands while it is written
                    if self._saved_step == summary.steps:  # stopped right after a save
                        self.interrupt_checkpoint = summary.checkpoint
                    elif summary.steps > self.start_step and not interrupts.save_abandoned:
                        log.warning("interrupted: saving a checkpoint at step %d", summary.steps)
                        with interrupts.saving():
                            self.interrupt_checkpoint = self.save(summary.steps)
                        summary.checkpoint = self.interrupt_checkpoint
                finally:  # however it ends (another Ctrl+C too): the disk tier is removed
                    self.close()
                raise
            except BaseException:
                self.close()
                raise
            self.run_log.close_bar()
            self._stop_gossip()
            if summary.steps > self.start_step and self._saved_step != summary.steps:
                with interrupts.saving():
                    summary.checkpoint = self.save(summary.steps)
        # tokens over time, never a mean of per-step rates (a few fast steps inflated it)
        summary.wall_s = time.perf_counter() - t0
        summary.tokens = len(step_times) * self._tokens_per_step()
        if step_times:
            summary.tokens_per_s = summary.tokens / summary.wall_s
            summary.step_tokens_per_s = summary.tokens / sum(step_times)
        times = sorted(r["step_time_s"] for r in summary.history[1:] or summary.history)
        summary.step_time_s = times[len(times) // 2] if times else None
        summary.device_peak_bytes = self.engine.device_peak_bytes()
        self.close()
        return summary

    def _tokens_per_step(self) -> int:
        tc = self.cfg.train
        return tc.micro_batch * tc.grad_accum * self.cfg.model.seq_len

    def _loop(self, summary: RunSummary, end: int, interrupts: Interrupts, times) -> None:
        """Steps start_step..end, one `train_step` each; a loss that stopped being finite or
        a save that found bad weights (TrainingError) rolls back to the newest checkpoint."""
        losses = LossWatch()
        step = self.start_step
        self._t_prev = time.perf_counter()
        while step < end:
            interrupts.at_step_boundary()
            try:
                step = self.train_step(step, end, summary, interrupts, losses, times)
            except TrainingError as err:
                step, losses = self._roll_back(err, summary, interrupts), LossWatch()
                self._t_prev = time.perf_counter()

    def train_step(self, step: int, end: int, summary: RunSummary, interrupts: Interrupts,
                   losses: LossWatch, times: list[float]) -> int:  # fmt: skip
        """Step `step` + 1: the engine's step, its record (told by the run log: file,
        loggers, terminal), the peers' turn, evaluation and a checkpoint on their cadence.
        Returns the step done."""
        from atom.optim import lr_at

        tc = self.cfg.train
        batches = [self.data.train_batch(step, m, tc.micro_batch) for m in range(tc.grad_accum)]
        lr = lr_at(step, tc)
        result = self.engine.train_step(batches, lr, stop=interrupts.abandon_step)
        done = step + 1
        # The weights hold step `done` from here: it is counted at once (a Ctrl+C saves
        # summary.steps), before anything a second press can cut short. Counted after
        # evaluation and logging, as it was, a press in between saved this step's weights
        # labelled done - 1 and --resume trained its batch again. No call before it: a
        # pending signal's handler runs at a call, not between these assignments.
        summary.steps, summary.last_loss, self._untold = done, result.loss, (done, result, lr)
        if self.gossip is not None:
            self.gossip.after_step(done)
        now = time.perf_counter()
        dt, self._t_prev = now - self._t_prev, now
        times.append(dt)
        record = self._untold = self._record(done, result, lr, dt)
        losses.see(done, result.loss, self._newest_checkpoint)  # atom/run/guard.py
        if self.gossip is not None:  # a unit gossip collapsed or blew up: rolled back too
            gossip_alarm(done, self.gossip.take_alarm(), self._newest_checkpoint)
        if self.gossip is not None:
            record["gossip"] = self.gossip.record()
        if (tc.eval_interval and done % tc.eval_interval == 0) or done == end:
            record["val_loss"] = summary.val_loss = self.evaluate()
            self._t_prev = time.perf_counter()  # eval time is not step time
        self.run_log.step(record, self.gossip.postfix() if self.gossip is not None else {})
        self._untold = None
        summary.history.append(record)
        if tc.ckpt_interval and done % tc.ckpt_interval == 0:
            with interrupts.saving():
                self._periodic_save(done, summary)  # may roll back
            self._t_prev = time.perf_counter()
        return done

    def _tell_cut_short(self, summary: RunSummary) -> None:
        """A step counted but not yet told when Ctrl+C stopped the run: its record goes to
        metrics.jsonl and the loggers now (without what was cut short, e.g. its val loss),
        so the file holds every step the interrupt's checkpoint holds, and a resume's
        records continue it as an unbroken run's would."""
        untold, self._untold = self._untold, None
        if untold is None:
            return
        if isinstance(untold, tuple):  # cut before its record was made
            done, result, lr = untold
            untold = self._record(done, result, lr, time.perf_counter() - self._t_prev)
        if self.run_log.told < untold["step"]:  # not if cut after the file had it
            self.run_log.step(untold, {})
            summary.history.append(untold)

    def _periodic_save(self, step: int, summary: RunSummary) -> None:
        """A checkpoint on the interval. A full disk skips it (the newest checkpoint on disk
        is whole, and the next interval tries again): a disk that fills and is freed must
        not end a run that can go on. The last save of a run still fails loudly."""
        try:
            summary.checkpoint, self._saved_step = self.save(step), step
        except (OSError, CheckpointError) as err:
            if getattr(err, "errno", None) not in NO_SPACE:
                raise
            self._skipped_saves += 1
            if self._skipped_saves == 1:  # one line a spell, not one a save
                newest = self._newest_checkpoint()
                log.warning("step %d: no checkpoint: %s; training goes on (newest on disk: "
                            "%s) and each save tries again", step, _strerror(err),
                            newest.name if newest else "none")  # fmt: skip
            return
        if self._skipped_saves:
            log.info("step %d: saving again, after %d saves skipped for lack of space", step,
                     self._skipped_saves)  # fmt: skip
            self._skipped_saves = 0

    def _roll_back(self, err: TrainingError, summary: RunSummary, interrupts: Interrupts) -> int:
        """The loss stopped being finite, or a save found bad weights: reload the newest
        checkpoint, stop mixing with every peer merged since it was written, and go on
        from its step. After MAX_ROLLBACKS, or with no checkpoint, the run stops (err)."""
        newest = self._newest_checkpoint()
        if newest is None or self._rollbacks >= MAX_ROLLBACKS:
            if self._rollbacks:
                what, _, rest = str(err).partition("; ")
                n = self._rollbacks
                raise TrainingError(f"{what} again after {n} rollback(s); {rest}") from None
            raise err
        self._rollbacks += 1
        dropped = self.gossip.distrust_since(self._saved_at) if self.gossip is not None else []
        peers = f"; not mixing with {', '.join(dropped)} for now" if dropped else ""
        log.warning("%s; rolling back to %s (%d of %d)%s", str(err).partition("; ")[0],
                    newest, self._rollbacks, MAX_ROLLBACKS, peers)  # fmt: skip
        # not cut short by Ctrl+C: half-restored weights would be saved by the interrupt
        # handler; the third Ctrl+C abandons it and nothing is saved
        with interrupts.saving("rolling back to the newest checkpoint"):
            ckpt = load_checkpoint(newest)
            self._restore(ckpt)
            if self.gossip is not None:  # the outer optimizer's state of that moment too
                self._restore_gossip(ckpt)
        step = self.start_step
        self.run_log.rewind(step)
        summary.history = [r for r in summary.history if r["step"] <= step]
        summary.steps, self._untold = step, None
        if self.gossip is not None:
            self.gossip.after_step(step)
        return step

    def _record(self, done: int, result, lr: float, dt: float) -> dict:
        record = {
            "step": done,
            "loss": result.loss,
            "lr": lr,
            "tokens_per_s": self._tokens_per_step() / dt,  # this step's, over its own time
            "step_time_s": dt,
            "device_peak_bytes": self.engine.device_peak_bytes(),
        }
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm
        if self.prediction is not None:
            record["predicted_step_s"] = self.prediction.step_s
            record["predicted_peak_bytes"] = self.prediction.peak_device_bytes
        if result.skipped:
            record["skipped"] = True
        return record


LONG_STEP_WARN_S = 60.0


def _matmul_flops(device, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of a 1024^2 matmul in the compute dtype on `device` (a few ms): about what
    the model's matmuls reach, a little under (small shape), so an estimate errs long."""
    from atom.profiler.timing import matmul_rate

    return matmul_rate(device, dtype, n=1024)
