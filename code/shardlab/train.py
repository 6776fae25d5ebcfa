"""One training loop for every strategy.

The loop is the ordinary PyTorch one whatever the strategy (`shardlab.strategy` holds the
contract that makes that so):

    wrapped = get_strategy(name)(model, precision, optimizer_spec, options)
    loss = loss_fn(wrapped.model(x), y); loss.backward()
    wrapped.optimizer.step(); wrapped.optimizer.zero_grad()

On top of it:

* `TrainConfig` (`shardlab.config`) names a run, and `validate()` refuses what cannot
  run before any process starts;
* `train_worker(config)` is one rank's run: build the model (`shardlab.models`), wrap
  it, train on this rank's rows of each global batch with the collective ledger
  (`shardlab.comm`) open, measure model states and the last step's peak
  (`shardlab.measure`), and return a `RunReport` (`shardlab.report`);
* `run(config)` launches `config.world` ranks (`shardlab.launch`: spawned processes, or
  this process under torchrun) and returns their reports.

`python -m shardlab train` (`shardlab.cli`) is this loop from the command line.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab import checkpoint
from shardlab.comm import Ledger, all_gather_into, clock_offset
from shardlab.comm.flight import FlightRecorder
from shardlab.launch.recorders import flight_folder
from shardlab.debugging import (check_memory_limit, check_straggler, memory_limit,
                                recompute_units, straggle)
from shardlab.launch import (OWNER, RUN_DIR_PREFIX, RankFailed, launch, placement,
                             rank_device, reaped_with_launches, under_torchrun,
                             whereabouts)
from shardlab.launch.quiet import quiet_stderr
from shardlab.measure import state_bytes, track_peak
from shardlab.modelio import build_on_meta, wrap_on_meta
from shardlab.clock import StepClock
from shardlab.config import TrainConfig, checkpoint_folders_locked, checkpoint_roots
from shardlab.models import build_model, get_batch, global_token_count, micro_batch_loss
from shardlab.precision import get_precision
from shardlab.report import RunReport, ledger_totals, median_step_time
from shardlab.steptime import matmul_rate
from shardlab.strategy import Wrapped, get_strategy, named_full_parameters, optimizer_spec

# ----------------------------------------------------------------------------- the loop


def _ledger_or_nothing(enabled: bool) -> Ledger | None:
    # records every collective inside it on this rank: ours and PyTorch's
    return Ledger() if enabled else None


@contextlib.contextmanager
def _on_the_way_out(action):
    """Run `action` when the block ends, also by an error: a progress bar then ends its
    line, and the error is printed on a line of its own."""
    try:
        yield
    finally:
        action()


def _progress_reporter(progress: str | None, steps: int):
    """rank 0's progress: a live tqdm bar ("tqdm"), or lines appended to a file that the
    launching process reads to draw the bar (ranks' own output only comes back at the
    end), or nothing."""
    if progress is None:
        return lambda step, loss: None, lambda: None  # no .item(): no GPU sync per step
    if progress == "tqdm":
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc="train", unit="step")

        def update(step, loss):
            bar.set_postfix({"loss on rank 0": f"{loss.item():.4f}"})
            bar.update(1)
        return update, bar.close
    path = Path(progress)

    def write(step, loss):
        with path.open("a") as f:
            f.write(f"{step} {loss.item():.6f}\n")
    return write, lambda: None


def train_worker(config: TrainConfig, progress: str | None = None,
                 flight: str | None = None) -> RunReport:
    """One rank's run: build, wrap, train `config.steps` steps, report. Runs inside a
    process group (the launcher's or torchrun's), or alone as world 1. `flight`: a folder
    for this rank's flight recorder (`shardlab.comm.flight`), read if the launch hangs."""
    config.validate()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world != config.world:
        raise ValueError(f"config.world={config.world} but the process group has {world} "
                         f"ranks; set world to the number of ranks launched")
    device = rank_device()
    check_straggler(config.slow_rank, config.slow_seconds, world)
    if config.memory_limit is not None:
        check_memory_limit(config.memory_limit)
    torch.manual_seed(config.seed)
    precision = get_precision(config.precision)
    before_wrap = recompute_units if config.recompute else None  # hooks run inside it
    spec = optimizer_spec(config.optimizer, config.lr, config.clip_norm,
                          config.clip_local_norm)
    tokens = config.batch_size // world * config.seq_len  # this rank's, all micro-batches
    if config.init_from:  # pretrained: built on meta, each rank reads its pieces
        shapes = build_on_meta(config.model, config.model_config)
        psi = sum(p.numel() for p in shapes.parameters() if p.requires_grad)
        # MFU's denominator: milliseconds of the model's own matmuls, every rank at once
        rate = matmul_rate(shapes, tokens // config.grad_accum, device=device)
        wrapped = wrap_on_meta(config.model, config.model_config, config.strategy,
                               precision, spec, config.options, device, config.init_from,
                               before_wrap=before_wrap)
    else:
        model = build_model(config.model, config.seed, config.model_config).to(device)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rate = matmul_rate(model, tokens // config.grad_accum, device=device)
        if before_wrap is not None:
            before_wrap(model)
        wrapped = get_strategy(config.strategy)(model, precision, spec,
                                                dict(config.options))
    load_start = time.perf_counter()
    first_step = _resume(config, wrapped)
    load_seconds = time.perf_counter() - load_start if config.resume else None
    update_progress, close_progress = _progress_reporter(progress if rank == 0 else None,
                                                         config.steps - first_step)
    offset = clock_offset() if distributed and config.record_ledger else 0.0
    ledger = _ledger_or_nothing(config.record_ledger)
    local_losses, step_times, step_starts, phases, saves = [], [], [], [], []
    delay = config.slow_seconds if rank == config.slow_rank else 0.0
    sizes: dict[str, int] = {}
    peak: dict[str, int] = {}
    tracked = watched = None
    recorder = FlightRecorder(flight) if flight else None
    with ledger if ledger is not None else contextlib.nullcontext(), \
            recorder if recorder is not None else contextlib.nullcontext(), \
            _on_the_way_out(close_progress):
        for step in range(first_step, config.steps):
            if step == config.crash_at_step and rank == config.crash_rank:
                raise RuntimeError(f"rank {rank} crashed at step {step} (crash_at_step)")
            last = step == config.steps - 1
            tracking = last and (config.measure_memory or config.memory_limit is not None)
            tracker = (track_peak(*wrapped.holders()) if tracking
                       else contextlib.nullcontext())
            watch = (memory_limit(config.memory_limit)
                     if tracking and config.memory_limit is not None
                     else contextlib.nullcontext())
            clock = StepClock()
            profiler = (_profiler(device) if config.profile_dir is not None
                        and step == max(first_step, config.steps - 2)
                        else contextlib.nullcontext())
            start = time.perf_counter()
            with profiler as profiled, watch as watched, tracker as tracked:
                if delay:
                    with clock.phase("injected delay"):
                        straggle(delay)
                step_loss = torch.zeros((), device=device)
                counted = global_token_count(step, config.batch_size, config.seq_len,
                                             config.seed, config.variable_lengths)
                for micro in range(config.grad_accum):
                    if micro and tracked is not None:
                        tracked.next_forward()
                    x, y = get_batch(step, rank, world, config.batch_size, config.seq_len,
                                     config.seed, micro, config.grad_accum,
                                     config.variable_lengths)
                    x, y = x.to(device), y.to(device)
                    sync = micro == config.grad_accum - 1
                    with contextlib.nullcontext() if sync else wrapped.no_sync():
                        with clock.phase("forward"):
                            loss = micro_batch_loss(wrapped.model(x), y, config.loss_mean,
                                                    world, config.grad_accum, counted)
                        clock.watch_backward(loss)
                        with clock.phase("backward"):
                            wrapped.backward(loss)
                    step_loss += loss.detach()
                with clock.phase("optimizer step"):
                    wrapped.optimizer.step()
                if tracking:
                    sizes = state_bytes(*wrapped.holders())
                wrapped.optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
            if profiled is not None:
                Path(config.profile_dir).mkdir(parents=True, exist_ok=True)
                profiled.export_chrome_trace(str(Path(config.profile_dir) / f"rank{rank}.json"))
            step_starts.append(start)
            phases.append(clock.spans)
            if config.save_every and (step + 1) % config.save_every == 0:
                save_start = time.perf_counter()
                _save(config, step + 1, wrapped, ledger)
                saves.append(time.perf_counter() - save_start)
            for book in (ledger, recorder):
                if book is not None and not last:
                    book.mark_step()
            local_losses.append(step_loss)
            update_progress(step, step_loss)
        if tracked is not None:
            peak = {"total": int(tracked.bytes), **{k: int(v) for k, v in
                                                     tracked.by_category.items()}}
            if tracked.reserved:  # CUDA: the allocator's reserved peak beside allocated
                peak["reserved"] = int(tracked.reserved)
        crossing = watched.crossing if watched is not None else None
        if crossing is not None:
            crossing.step = config.steps - 1
    # The global-batch loss: the mean of the ranks' losses (under loss_mean "tokens" each
    # rank's is its summed loss x N / the global token count, so their mean is the
    # global-token mean; under "per-batch", the mean of the ranks' means). Gathered
    # once, after the ledger has closed, so that the ledger holds the strategy's traffic
    # and nothing else; and summed here in rank order, not by an all-reduce, whose order
    # of addition depends on how many losses there are (a run resumed halfway would then
    # report other last digits than the same steps of the whole run).
    losses = (torch.stack(local_losses) if local_losses
              else torch.zeros(0, device=device)).float()
    if distributed and world > 1:
        everyone = torch.empty(world * losses.numel(), device=device)
        all_gather_into(everyone, losses)
        losses = everyone.view(world, -1).sum(dim=0) / world
    params = None
    if config.keep_params:
        full = wrapped.full_parameters or (lambda: named_full_parameters(wrapped.model))
        params = {k: v.detach().cpu().clone() for k, v in full().items()}
    if config.export_path:
        checkpoint.export_full_state_dict(wrapped, config.export_path)
    here = whereabouts(rank, world)
    return RunReport(rank, world, config.strategy, losses.tolist(), sizes, peak,
                     list(ledger.records) if ledger is not None else [], step_times,
                     params, psi, first_step, placement(),
                     tokens_per_step=tokens,
                     step_starts=step_starts, phases=phases, clock_offset=offset,
                     checkpoint_save_seconds=saves, checkpoint_load_seconds=load_seconds,
                     memory_limit_crossing=None if crossing is None else str(crossing),
                     node=here.node, host=here.host, local_rank=here.local_rank,
                     local_world=here.local_world,
                     model_flops_per_step=6 * psi * tokens, matmul_flops=rate,
                     grad_norms=list(wrapped.clip.norms) if wrapped.clip is not None else [])


@contextlib.contextmanager
def _profiler(device: torch.device):
    """torch.profiler over one step: the CPU's ops (and the GPU's kernels on CUDA), the
    loop's phases as named ranges (`StepClock` marks them), exported as a Chrome trace.
    Kineto announces its start and stop on the process's stderr, below Python, at every
    level of KINETO_LOG_LEVEL: those two moments write to /dev/null instead."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    with quiet_stderr():
        profiler.start()
    try:
        yield profiler
    finally:
        with quiet_stderr():
            profiler.stop()


def _resume(config: TrainConfig, wrapped: Wrapped) -> int:
    """Load the checkpoint `config.resume` names; return the step to continue from."""
    if not config.resume:
        return 0
    for root in checkpoint_roots(config):
        checkpoint.clean_interrupted(root)
    # check_resume, in the launching process, already said which checkpoints it skipped
    folder = (checkpoint.latest(config.checkpoint_dir, say=None) if config.resume is True
              else Path(config.resume))
    if folder is None:
        raise ValueError(f"no complete checkpoint that verifies in {config.checkpoint_dir}: "
                         f"train with save_every first, or resume=False")
    return checkpoint.load(folder, wrapped, trusted=config.trust_checkpoint)


def _save(config: TrainConfig, step: int, wrapped: Wrapped, ledger: Ledger | None) -> None:
    kept = len(ledger.records) if ledger is not None else 0
    checkpoint.save(config.checkpoint_dir, step, wrapped,
                    {"strategy": config.strategy, "model": config.model,
                     "model_config": config.model_config,
                     "precision": config.precision, "optimizer": config.optimizer})
    if ledger is not None:  # the ledger holds the strategy's traffic, not the save's
        del ledger.records[kept:]


def train_many(configs: list[TrainConfig]) -> list[RunReport]:
    """Worker: several runs in one launch (same world size), one after the other. A
    launch costs seconds of process start-up; a notebook comparing strategies pays it once."""
    return [train_worker(c) for c in configs]


def run(config: TrainConfig, *, backend: str = "auto", device: str = "auto",
        timeout: float = 600.0, progress: bool = False) -> list[RunReport]:
    """Train `config` on `config.world` ranks (one for "single", which always runs on one
    process); return the ranks' reports in rank order. Everything that can be checked
    (the config, the placement, the checkpoint to resume) is, before a process starts."""
    if config.strategy == "single":
        config = replace(config, world=1)
    config.validate()
    try:
        with checkpoint_folders_locked(config):  # one writer per folder
            config.check_resume()
            # a hang's diagnosis joins the error; the folder goes with the reaper too
            with flight_folder() as flight, reaped_with_launches(flight):
                return _launch_workers(config, backend, device, timeout, progress, flight)
    except RankFailed as failed:
        # A bad option or a model that differs across ranks is found by the strategy on
        # the ranks, before training: hand it back as the ValueError it is.
        last = failed.rank_traceback.strip().splitlines()[-1]
        kind, _, message = last.partition(": ")
        if kind.rsplit(".", 1)[-1] in ("ValueError", "CheckpointError"):
            raise ValueError(message) from failed
        raise


def _launch_workers(config: TrainConfig, backend: str, device: str, timeout: float,
                    progress: bool, flight: str) -> list[RunReport]:
    where = {"backend": backend, "device": device, "timeout": timeout}
    if under_torchrun():  # no folder that every node sees: no flight recorder
        return launch(train_worker, config.world, config, "tqdm" if progress else None,
                      **where)
    if not progress:
        return launch(train_worker, config.world, config, None, flight, **where)
    # a launch's folder, named as the launcher names its own: if this process is killed,
    # the launch's reaper removes it (and, failing that, the next launch)
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as tmp, \
            reaped_with_launches(tmp):
        (Path(tmp) / OWNER).write_text(str(os.getpid()))
        path = Path(tmp) / "progress"
        path.touch()
        done = threading.Event()
        watcher = threading.Thread(target=_draw_progress, args=(path, config.steps, done),
                                   daemon=True)
        watcher.start()
        try:
            return launch(train_worker, config.world, config, str(path), flight, **where)
        finally:
            done.set()
            watcher.join()


def _draw_progress(path: Path, steps: int, done: threading.Event) -> None:
    from tqdm.auto import tqdm
    with tqdm(total=steps, desc="train", unit="step") as bar:
        seen = 0
        while True:
            finished = done.is_set()
            lines = path.read_text().splitlines()
            for line in lines[seen:]:
                bar.set_postfix({"loss on rank 0": f"{float(line.split()[1]):.4f}"})
                bar.update(1)
            seen = len(lines)
            if finished:
                return
            done.wait(0.2)


__all__ = ["TrainConfig", "train_worker", "train_many", "run", "RunReport", "ledger_totals",
           "median_step_time"]
