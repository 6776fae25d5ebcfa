"""One training loop for every strategy.

The loop is the ordinary PyTorch one whatever the strategy (`shardlab.strategy` holds the
contract that makes that so, `shardlab.step` the step itself):

    wrapped = get_strategy(name)(model, precision, optimizer_spec, options)
    for step in range(steps):
        loss = train_step(wrapped, micro_batches, loss_of)   # forward, backward, step

On top of it:

* `TrainConfig` (`shardlab.config`) names a run, and `validate()` refuses what cannot
  run before any process starts;
* `train_worker(config)` is one rank's run: build the model (`shardlab.models`), wrap
  it, train on this rank's rows of each global batch with the collective ledger
  (`shardlab.comm`) open, measure model states and the last step's peak
  (`shardlab.measure`), and return a `RunReport` (`shardlab.report`). The loop's other
  concerns sit beside it, one line each, in `shardlab.loop_concerns`: the faults
  rehearsed on purpose, the measurement, the checkpoints and the progress bar;
* `run(config)` checks the config and the checkpoint to resume once, in the launching
  process, then launches `config.world` ranks (`shardlab.launch`: spawned processes, or
  this process under torchrun) and returns their reports.

`python -m shardlab train` (`shardlab.cli`) is this loop from the command line.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab import checkpoint
from shardlab.cards import card
from shardlab.comm.compat import all_gather_into
from shardlab.comm.ledger import simulated_network
from shardlab.config import TrainConfig, checkpoint_folders_locked
from shardlab.launch.devices import placement, rank_device
from shardlab.launch.errors import RankFailed, refusal_of
from shardlab.launch.hygiene import OWNER, RUN_DIR_PREFIX, reaped_with_launches
from shardlab.launch.launcher import launch
from shardlab.launch.recorders import flight_folder
from shardlab.launch.torchrun import under_torchrun, whereabouts
from shardlab.loop_concerns import Checkpoints, Measurement, RehearsedFaults, progress_shown
from shardlab.modelio.meta import build_on_meta, wrap_on_meta
from shardlab.models import (GENERATOR_LOCK, build_model, get_batch, global_token_count,
                             micro_batch_loss)
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.report import RunReport
from shardlab.step import train_step
from shardlab.rates import matmul_rate
from shardlab.steptime import datasheet_peak
from shardlab.strategy import Wrapped, get_strategy, named_full_parameters
from shardlab.wrap import describe, recompute_units

# ----------------------------------------------------------------------------- the loop


def train_worker(config: TrainConfig, progress: str | None = None,
                 flight: str | None = None) -> RunReport:
    """One rank's run of a config made on the ranks' side (`launch(train_many, ...)` from
    a notebook, a test): check it, then `train_rank`. `run` checks its config once, in
    the launching process, and launches `train_rank` itself."""
    config.validate()
    return train_rank(config, progress, flight)


def train_rank(config: TrainConfig, progress: str | None = None,
               flight: str | None = None, with_loss: bool = True) -> RunReport:
    """One rank's run: build, wrap, train `config.steps` steps, report. Runs inside a
    process group (the launcher's or torchrun's), or alone as world 1. `progress`: rank
    0's progress ("tqdm", or a file it appends each finished step to, `with_loss` or
    not: `progress_shown`). `flight`: a folder for this rank's flight recorder
    (`shardlab.comm.flight`), read if the launch hangs."""
    rank, world = rank_and_world(config)
    device = rank_device()
    wrapped, psi, rate, tokens, units = build_and_wrap(config, world, device)
    checkpoints = Checkpoints(config, wrapped)
    first_step = checkpoints.resume()
    faults = RehearsedFaults(config, rank)
    measured = Measurement(config, wrapped, first_step, rank, device, flight)
    local_losses = []
    with measured, simulated_network(config.simulated_network), \
            progress_shown(progress if rank == 0 else None, config.steps - first_step,
                           with_loss) as show:
        for step in range(first_step, config.steps):
            faults.crash_if_due(step)
            with measured.step(step) as watch:
                faults.straggle(watch)
                loss = train_step(wrapped, MicroBatches(config, step, rank, world, device),
                                  loss_of(config, step, world), watch)
            checkpoints.after_step(step, measured.ledger)
            measured.mark_step(step)
            local_losses.append(loss)
            show(step, loss)
    losses = global_losses(local_losses, world, device)
    params = None
    if config.keep_params:
        full = wrapped.full_parameters or (lambda: named_full_parameters(wrapped.model))
        params = {k: v.detach().cpu().clone() for k, v in full().items()}
    if config.export_path:
        checkpoint.export_full_state_dict(wrapped, config.export_path)
    here = whereabouts(rank, world)
    precision = get_precision(config.precision)
    return RunReport(rank, world, config.strategy, losses, measured.sizes, measured.peak,
                     list(measured.ledger.records) if measured.ledger is not None else [],
                     measured.step_times, params, psi, first_step, placement(),
                     tokens_per_step=tokens,
                     step_starts=measured.step_starts, phases=measured.phases,
                     clock_offset=measured.offset,
                     checkpoint_save_seconds=checkpoints.saves,
                     checkpoint_load_seconds=checkpoints.load_seconds,
                     memory_limit_crossing=measured.crossing,
                     node=here.node, host=here.host, local_rank=here.local_rank,
                     local_world=here.local_world,
                     model_flops_per_step=6 * psi * tokens, matmul_flops=rate,
                     peak_flops=datasheet_peak(device, precision.param_dtype) or 0.0,
                     grad_norms=list(wrapped.clip.norms) if wrapped.clip is not None else [],
                     units=units,
                     resumed_from=str(checkpoints.folder) if checkpoints.folder else None)


def train_many(configs: list[TrainConfig]) -> list[RunReport]:
    """Worker: several runs in one launch (same world size), one after the other. A
    launch costs seconds of process start-up; a notebook comparing strategies pays it once."""
    return [train_worker(c) for c in configs]


# ----------------------------------------------------------------------------- its parts


def rank_and_world(config: TrainConfig) -> tuple[int, int]:
    """This rank and the world, checked against the config: what only a rank can know
    (the launching process checked the rest)."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world != config.world:
        raise ValueError(f"config.world={config.world} but the process group has {world} "
                         f"ranks; set world to the number of ranks launched")
    return rank, world


def build_and_wrap(config: TrainConfig, world: int, device: torch.device
                   ) -> tuple[Wrapped, int, float, int, str | None]:
    """The model wrapped for the strategy, what MFU needs (Ψ, the trainable parameters;
    the rate of the model's own matmuls on this rank; this rank's tokens a step), and for
    a strategy that takes units, which units its wrap policy made (`shardlab.wrap.describe`)."""
    takes_units = card(config.strategy).takes_units
    policy = config.options.get("wrap", "auto")
    with GENERATOR_LOCK:  # ranks that are threads share one generator
        torch.manual_seed(config.seed)
    precision = get_precision(config.precision)
    before_wrap = recompute_units if config.recompute else None  # hooks run inside it
    spec = optimizer_spec(config.optimizer, config.lr, config.clip_norm,
                          config.clip_local_norm)
    tokens = config.batch_size // world * config.seq_len  # this rank's, all micro-batches
    if config.init_from:  # pretrained: built on meta, each rank reads its pieces
        shapes = build_on_meta(config.model, config.model_config)
        psi = sum(p.numel() for p in shapes.parameters() if p.requires_grad)
        # matmul utilization's denominator: milliseconds of the model's own matmuls,
        # every rank at once (MFU's is the GPU's datasheet peak)
        rate = matmul_rate(shapes, tokens // config.grad_accum, device=device)
        units = describe(shapes, policy) if takes_units else None
        wrapped = wrap_on_meta(config.model, config.model_config, config.strategy,
                               precision, spec, config.options, device, config.init_from,
                               before_wrap=before_wrap)
    else:
        model = build_model(config.model, config.seed, config.model_config).to(device)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rate = matmul_rate(model, tokens // config.grad_accum, device=device)
        units = describe(model, policy) if takes_units else None
        if before_wrap is not None:
            before_wrap(model)
        wrapped = get_strategy(config.strategy)(model, precision, spec,
                                                dict(config.options))
    return wrapped, psi, rate, tokens, units


class MicroBatches(Sequence):
    """This rank's micro-batches of one step, each read when the step reaches it."""

    def __init__(self, config: TrainConfig, step: int, rank: int, world: int,
                 device: torch.device):
        self.config, self.step, self.rank, self.world = config, step, rank, world
        self.device = device

    def __len__(self) -> int:
        return self.config.grad_accum

    def __getitem__(self, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= micro < len(self):
            raise IndexError(micro)
        c = self.config
        x, y = get_batch(self.step, self.rank, self.world, c.batch_size, c.seq_len, c.seed,
                         micro, c.grad_accum, c.variable_lengths)
        return x.to(self.device), y.to(self.device)


def loss_of(config: TrainConfig, step: int, world: int):
    """Each micro-batch's loss in step `step`, scaled so that the ranks' averaged
    gradients are the gradient of the step's loss (`micro_batch_loss`)."""
    counted = global_token_count(step, config.batch_size, config.seq_len, config.seed,
                                 config.variable_lengths)
    return functools.partial(micro_batch_loss, loss_mean=config.loss_mean, world=world,
                             micro_steps=config.grad_accum, global_tokens=counted)


def global_losses(local: list[torch.Tensor], world: int,
                  device: torch.device) -> list[float]:
    """The global-batch loss of each step: the mean of the ranks' losses (under loss_mean
    "tokens" each rank's is its summed loss x N / the global token count, so their mean is
    the global-token mean; under "per-batch", the mean of the ranks' means). Gathered
    once, after the ledger has closed, so that the ledger holds the strategy's traffic
    and nothing else; and summed here in rank order, not by an all-reduce, whose order
    of addition depends on how many losses there are (a run resumed halfway would then
    report other last digits than the same steps of the whole run)."""
    losses = (torch.stack(local) if local else torch.zeros(0, device=device)).float()
    if world > 1:
        everyone = torch.empty(world * losses.numel(), device=device)
        all_gather_into(everyone, losses)
        losses = everyone.view(world, -1).sum(dim=0) / world
    return losses.tolist()


# ----------------------------------------------------------------------------- launching


def run(config: TrainConfig, *, backend: str = "auto", device: str = "auto",
        timeout: float = 600.0, progress: bool = False) -> list[RunReport]:
    """Train `config` on `config.world` ranks (one for "single", which always runs on one
    process); return the ranks' reports in rank order. Everything that can be checked
    (the config, the placement, the checkpoint to resume) is, once, here, before a
    process starts; the ranks check only what only they know (`rank_and_world`)."""
    if card(config.strategy).one_process:
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
        refusal = refusal_of(failed)
        if refusal is not None:
            raise refusal from failed
        raise


def _launch_workers(config: TrainConfig, backend: str, device: str, timeout: float,
                    progress: bool, flight: str) -> list[RunReport]:
    where = {"backend": backend, "device": device, "timeout": timeout}
    if under_torchrun():  # no folder that every node sees: no flight recorder
        return launch(train_rank, config.world, config, "tqdm" if progress else None,
                      **where)
    # Rank 0 appends each finished step to a file here: the bar is drawn from it, and a
    # run stopped by Ctrl-C or SIGTERM says which step it reached (`steps_done` on the
    # exception). The folder is named as the launcher names its own: if this process is
    # killed, the launch's reaper removes it (and, failing that, the next launch).
    with tempfile.TemporaryDirectory(prefix=RUN_DIR_PREFIX) as tmp, \
            reaped_with_launches(tmp):
        (Path(tmp) / OWNER).write_text(str(os.getpid()))
        path = Path(tmp) / "progress"
        path.touch()
        done = threading.Event()
        watcher = threading.Thread(target=_draw_progress, args=(path, config.steps, done),
                                   daemon=True)
        if progress:
            watcher.start()
        try:
            return launch(train_rank, config.world, config, str(path), flight, progress,
                          **where)
        except (KeyboardInterrupt, SystemExit) as stopped:
            lines = path.read_text().splitlines()
            stopped.steps_done = int(lines[-1].split()[0]) + 1 if lines else None
            raise
        finally:
            done.set()
            if progress:
                watcher.join()


def _draw_progress(path: Path, steps: int, done: threading.Event) -> None:
    from tqdm.auto import tqdm
    with tqdm(total=steps, desc="train", unit="step") as bar:
        seen = 0
        while True:
            finished = done.is_set()
            lines = path.read_text().splitlines()
            for line in lines[seen:]:
                # rank 0's rows only: the table's loss is the global batch's
                bar.set_postfix({"loss (rank 0's rows)": f"{float(line.split()[1]):.4f}"})
                bar.update(1)
            seen = len(lines)
            if finished:
                return
            done.wait(0.2)


__all__ = ["train_worker", "train_rank", "train_many", "run"]
