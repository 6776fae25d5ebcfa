"""What the training loop does besides the step, each beside the loop and not around it.

`shardlab.train`'s loop calls each at one line: the faults rehearsed on purpose
(`RehearsedFaults`: a crash at a chosen step, a straggler's sleep), the measurement
(`Measurement`: each step's clock and phases, the ledger and the flight recorder, the last
step's model states and peak memory with the memory limit's watch, a profiler trace), the
checkpoints (`Checkpoints`: the resume, the saves, the ledger kept to the strategy's
traffic) and the progress bar (`progress_shown`). The report's fields are read from
them after the loop.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from shardlab import checkpoint
from shardlab.clock import StepClock
from shardlab.comm.flight import FlightRecorder
from shardlab.comm.ledger import Ledger, clock_offset
from shardlab.config import DATA_FIELDS, TrainConfig, resume_folder
from shardlab.faults import memory_limit, straggle
from shardlab.launch.quiet import quiet_stderr
from shardlab.measure import track_peak
from shardlab.step import HeldAfterStep, StepWatch
from shardlab.strategy import Wrapped

# ----------------------------------------------------------------------------- faults


class RehearsedFaults:
    """The faults a run causes on purpose (`shardlab.faults`): rank `crash_rank`
    raises at the start of step `crash_at_step`; rank `slow_rank` sleeps `slow_seconds`
    before every forward (a straggler), timed as the step's "injected delay"."""

    def __init__(self, config: TrainConfig, rank: int):
        self.rank = rank
        self.crash_at = config.crash_at_step if rank == config.crash_rank else None
        self.delay = config.slow_seconds if rank == config.slow_rank else 0.0

    def crash_if_due(self, step: int) -> None:
        if step == self.crash_at:
            raise RuntimeError(f"rank {self.rank} crashed at step {step} (crash_at_step)")

    def straggle(self, watch: StepWatch) -> None:
        if self.delay:
            with watch.phase("injected delay"):
                straggle(self.delay)


# ----------------------------------------------------------------------------- measurement


class Measurement:
    """What the run report measures, beside the loop: each step's clock (its start, its
    time, its phases), the ledger of collectives and the flight recorder (while the
    block runs; one mark a step), and on the last step the model states and the peak
    memory (with the memory limit's watch); a profiler trace of one steady step."""

    def __init__(self, config: TrainConfig, wrapped: Wrapped, first_step: int, rank: int,
                 device: torch.device, flight: str | None):
        self.config, self.wrapped, self.rank, self.device = config, wrapped, rank, device
        # the next to last step (a steady one), or a resumed run's first if it is later
        self.profiled_step = (max(first_step, config.steps - 2)
                              if config.profile_dir is not None else None)
        distributed = dist.is_available() and dist.is_initialized()
        self.offset = clock_offset() if distributed and config.record_ledger else 0.0
        # records every collective inside the block on this rank: ours and PyTorch's
        self.ledger = Ledger() if config.record_ledger else None
        self.recorder = FlightRecorder(flight) if flight else None
        self.step_times, self.step_starts, self.phases = [], [], []
        self.sizes: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.crossing: str | None = None

    def __enter__(self) -> "Measurement":
        self._books = contextlib.ExitStack()
        for book in (self.ledger, self.recorder):
            if book is not None:
                self._books.enter_context(book)
        return self

    def __exit__(self, *exc) -> bool:
        # an error reaches both: the flight recorder writes it down, the ledger stops
        return self._books.__exit__(*exc)

    @contextlib.contextmanager
    def step(self, step: int):
        """Around one step: yields the `StepWatch` that `train_step` reports to."""
        config = self.config
        tracking = step == config.steps - 1 and (config.measure_memory
                                                 or config.memory_limit is not None)
        watch = _Watched(self.wrapped, tracking)
        nothing = contextlib.nullcontext()
        profiler = _profiler(self.device) if step == self.profiled_step else nothing
        limit = (memory_limit(config.memory_limit)
                 if tracking and config.memory_limit is not None else nothing)
        tracker = track_peak(*self.wrapped.holders()) if tracking else nothing
        start = time.perf_counter()
        with profiler as profiled, limit as limit_watch, tracker as watch.tracked:
            yield watch
            if profiled is not None:
                self.wrapped.settle()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.step_times.append(time.perf_counter() - start)
        if profiled is not None:
            folder = Path(config.profile_dir)
            folder.mkdir(parents=True, exist_ok=True)
            profiled.export_chrome_trace(str(folder / f"rank{self.rank}.json"))
        self.step_starts.append(start)
        self.phases.append(watch.clock.spans)
        if tracking:
            self.sizes = watch.held
            self._keep_peak(watch.tracked, limit_watch, step)

    def _keep_peak(self, tracked, limit_watch, step: int) -> None:
        self.peak = {"total": int(tracked.bytes),
                     **{k: int(v) for k, v in tracked.by_category.items()}}
        if tracked.reserved:  # CUDA: the allocator's reserved peak beside allocated
            self.peak["reserved"] = int(tracked.reserved)
        if tracked.between:  # gradient accumulation: held across micro-batches
            self.peak["between_micro_batches"] = int(tracked.between)
        if limit_watch is not None and limit_watch.crossing is not None:
            limit_watch.crossing.step = step
            self.crossing = str(limit_watch.crossing)

    def mark_step(self, step: int) -> None:
        """The ledger's and the flight recorder's records after this are the next step's."""
        if step == self.config.steps - 1:
            return
        for book in (self.ledger, self.recorder):
            if book is not None:
                book.mark_step()


class _Watched(HeldAfterStep):
    """What the loop watches inside a step: the clock's phases, and on the tracked step
    the memory tracker's forwards and the model states before zero_grad frees the
    gradients."""

    def __init__(self, wrapped: Wrapped, tracking: bool):
        super().__init__(wrapped)
        self.clock, self.tracking = StepClock(), tracking
        self.tracked = None  # the memory tracker's Peak, once the tracked step began

    def phase(self, what: str):
        return self.clock.phase(what)

    def watch_backward(self, loss: torch.Tensor) -> None:
        self.clock.watch_backward(loss)

    def next_forward(self) -> None:
        if self.tracked is not None:
            self.tracked.next_forward()

    def stepped(self) -> None:
        if self.tracking:
            super().stepped()


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


# ----------------------------------------------------------------------------- checkpoints


class Checkpoints:
    """The run's checkpoints: the resume before the first step (its seconds timed), a
    save after every `save_every` steps (each timed), the ledger kept to the strategy's
    traffic."""

    def __init__(self, config: TrainConfig, wrapped: Wrapped):
        self.config, self.wrapped = config, wrapped
        self.saves: list[float] = []
        self.load_seconds: float | None = None
        self.folder: Path | None = None  # the checkpoint resumed from

    def resume(self) -> int:
        """Load the checkpoint `config.resume` names; return the step to continue from."""
        if not self.config.resume:
            return 0
        start = time.perf_counter()
        # check_resume, in the launching process, already said which checkpoints it skipped
        self.folder = resume_folder(self.config, say=None)
        if checkpoint.is_complete(self.folder):  # a run launched without `run` is checked here
            self.config.check_same_data(checkpoint.info(self.folder), self.folder.name)
        step = checkpoint.load(self.folder, self.wrapped, trusted=self.config.trust_checkpoint)
        self.load_seconds = time.perf_counter() - start
        return step

    def after_step(self, step: int, ledger: Ledger | None) -> None:
        config = self.config
        if not config.save_every or (step + 1) % config.save_every:
            return
        start = time.perf_counter()
        kept = len(ledger.records) if ledger is not None else 0
        checkpoint.save(config.checkpoint_dir, step + 1, self.wrapped,
                        {"strategy": config.strategy, "model": config.model,
                         "model_config": config.model_config,
                         "precision": config.precision, "optimizer": config.optimizer,
                         **data_position(config, step + 1)})
        if ledger is not None:  # the ledger holds the strategy's traffic, not the save's
            del ledger.records[kept:]
        self.saves.append(time.perf_counter() - start)


def data_position(config: TrainConfig, step: int) -> dict:
    """Where the data stands after `step` steps: the samples read (step x the global
    batch: `shardlab.models.sample_ids` numbers them) and what draws the next ones. The
    global batch of a step is drawn from (seed, step) whatever the number of ranks, so a
    resume on any N reads the next samples exactly when these are the same
    (`TrainConfig.check_resume` refuses a resume where they are not)."""
    return {"samples_seen": step * config.batch_size,
            "data": {name: getattr(config, name) for name in DATA_FIELDS}}


# ----------------------------------------------------------------------------- progress


@contextlib.contextmanager
def progress_shown(progress: str | None, steps: int, with_loss: bool = True):
    """rank 0's progress: a live tqdm bar ("tqdm"), or lines appended to a file that the
    launching process reads (to draw the bar, as ranks' own output only comes back at the
    end; to say which step a stopped run reached), or nothing. Yields `show(step, loss)`;
    the bar ends its line when the block ends, also by an error, so that the error is
    printed on a line of its own. The loss shown is rank 0's rows' (the global batch's
    would need a collective every step); without `with_loss` the file gets the step
    alone: no .item(), no GPU sync per step."""
    if progress is None:
        yield lambda step, loss: None
    elif progress == "tqdm":
        from tqdm.auto import tqdm
        bar = tqdm(total=steps, desc="train", unit="step")

        def update(step, loss):
            bar.set_postfix({"loss (rank 0's rows)": f"{loss.item():.4f}"})
            bar.update(1)
        try:
            yield update
        finally:
            bar.close()
    else:
        path = Path(progress)

        def write(step, loss):
            with path.open("a") as f:
                f.write(f"{step} {loss.item():.6f}\n" if with_loss else f"{step}\n")
        yield write
