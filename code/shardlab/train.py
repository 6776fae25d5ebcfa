"""One training loop for every strategy, the strategy registry, and the run report.

A strategy is a function that takes the model every rank built identically and returns
what the loop needs, so the loop stays the ordinary PyTorch one for all of them:

    wrapped = wrap(model, precision, optimizer_spec, options)
    loss = loss_fn(wrapped.model(x), y); loss.backward()
    wrapped.optimizer.step(); wrapped.optimizer.zero_grad()

On top of that contract:

* `TrainConfig` names a run (strategy, world size, model, precision, optimizer, steps,
  batch, gradient accumulation, options) and `validate()` refuses what cannot run before
  any process starts;
* `train_worker(config)` is one rank's run: build the model (`shardlab.models`), wrap
  it, train on this rank's rows of each global batch with the collective ledger
  (`shardlab.comm`) open, measure model states and the last step's peak
  (`shardlab.measure`), and return a `RunReport`;
* `run(config)` launches `config.world` ranks (`shardlab.launch`: spawned processes, or
  this process under torchrun) and returns their reports;
* `main(argv)` is `python -m shardlab train`: a progress bar, a summary table, JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from shardlab.comm import Ledger
from shardlab.launch import RankFailed, launch, rank_device, under_torchrun
from shardlab.measure import state_bytes, track_peak
from shardlab.models import MODEL_NAMES, build_model, check_batch_split, get_batch, loss_fn
from shardlab.precision import MasterWeightOptimizer, Precision, get_precision


@dataclass
class OptimizerSpec:
    """Which torch.optim class to build, and with what arguments, over whatever
    parameters (or shards, or fp32 master copies) a strategy decides to optimize."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def build(self, params) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


@dataclass
class Wrapped:
    """What a strategy hands back to the loop."""

    model: nn.Module
    optimizer: Any  # has step() and zero_grad()
    # Gradient accumulation: micro-batches before the last run under no_sync().
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    # The full (unsharded) parameters by their original names, on every rank: parity
    # tests compare these with the single-process reference.
    full_parameters: Callable[[], dict[str, torch.Tensor]] | None = None


# name -> "module:function"; resolved on use, so that registering a strategy never
# imports every strategy module (and no module needs to import another's internals).
STRATEGIES: dict[str, str] = {
    "single": "shardlab.train:wrap_single",
    "ddp": "shardlab.ddp:wrap_ddp",
    "ddp-naive": "shardlab.ddp:wrap_ddp_naive",
    "torch-ddp": "shardlab.ddp:wrap_torch_ddp",
    "zero1": "shardlab.zero:wrap_zero1",
    "zero2": "shardlab.zero:wrap_zero2",
    "torch-zero1": "shardlab.zero:wrap_torch_zero1",
    "zero3": "shardlab.sharded:wrap_zero3",
    "fsdp2": "shardlab.fsdp:wrap_fsdp2",
    "torch-fsdp2": "shardlab.fsdp:wrap_torch_fsdp2",
}


def get_strategy(name: str) -> Callable[..., Wrapped]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; use one of {sorted(STRATEGIES)}")
    module_name, fn_name = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module_name), fn_name)


# ----------------------------------------------------------------------------- helpers
# shared by every strategy module: the same casting, optimizer and option checks for all


def check_options(strategy: str, options: dict, accepted: dict[str, Any]) -> dict[str, Any]:
    """`accepted` maps each option a strategy takes to its default; return the merged
    options, or raise naming the accepted ones."""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"strategy {strategy!r} got unknown option(s) {unknown}; it accepts "
                         f"{sorted(accepted) if accepted else 'no options'}")
    return {**accepted, **options}


def cast_model(model: nn.Module, precision: Precision) -> nn.Module:
    """Cast parameters and floating-point buffers to the precision's parameter dtype."""
    return model.to(precision.param_dtype)


def build_optimizer(params, precision: Precision, spec: OptimizerSpec):
    """The optimizer over `params`: through fp32 master weights for "bf16-mixed"."""
    params = [p for p in params if p.requires_grad]
    if precision.master_weights:
        return MasterWeightOptimizer(params, spec.cls, **spec.kwargs)
    return spec.build(params)


def named_full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of a (replicated, unsharded) model's parameters by name."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- "single"


def wrap_single(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                options: dict) -> Wrapped:
    """The reference: the model as it is, one process, the whole global batch."""
    check_options("single", options, {})
    model = cast_model(model, precision)
    return Wrapped(model, build_optimizer(model.parameters(), precision, optimizer),
                   full_parameters=lambda: named_full_parameters(model))


# ----------------------------------------------------------------------------- the config

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
}


def optimizer_spec(name: str, lr: float) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    return OptimizerSpec(cls, {"lr": lr, **kwargs})


@dataclass
class TrainConfig:
    strategy: str = "single"
    world: int = 1
    model: str = "gpt-tiny"
    precision: str = "fp32"
    optimizer: str = "adamw"
    lr: float = 1e-3
    steps: int = 10
    batch_size: int = 8  # the global batch of one optimizer step, split among ranks
    seq_len: int = 32
    grad_accum: int = 1  # micro-batches per step (each rank's rows split this many ways)
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    measure_memory: bool = True
    record_ledger: bool = True
    keep_params: bool = False
    # Checkpoints (shardlab.checkpoint): save after every `save_every` steps into
    # `checkpoint_dir`; `resume`: True for the newest complete checkpoint there, or the
    # path of one (it may come from another world size); then train up to `steps`.
    save_every: int = 0
    checkpoint_dir: str | None = None
    resume: bool | str = False
    # A full, unsharded state dict written by rank 0 after training (torch.save).
    export_path: str | None = None
    # To rehearse a failure: rank `crash_rank` raises at the start of step `crash_at_step`.
    crash_at_step: int | None = None
    crash_rank: int = 0

    def validate(self) -> "TrainConfig":
        """Raise, before any process starts, on anything that cannot run."""
        get_strategy(self.strategy)
        get_precision(self.precision)
        optimizer_spec(self.optimizer, self.lr)
        if self.model not in MODEL_NAMES:
            raise ValueError(f"unknown model {self.model!r}; use one of {list(MODEL_NAMES)}")
        for name in ("world", "steps", "batch_size", "seq_len", "grad_accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        check_batch_split(self.batch_size, self.world, self.grad_accum)
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict, got {type(self.options).__name__}")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) \
                or self.save_every < 0:
            raise ValueError(f"save_every must be a whole number >= 0 (0: never), got "
                             f"{self.save_every!r}")
        if (self.save_every or self.resume is True) and not self.checkpoint_dir:
            raise ValueError("save_every and resume=True need checkpoint_dir, the folder "
                             "that holds the checkpoints")
        if self.crash_at_step is not None and not 0 <= self.crash_rank < self.world:
            raise ValueError(f"crash_rank must be a rank of the run (0..{self.world - 1}), "
                             f"got {self.crash_rank!r}")
        return self


@dataclass
class RunReport:
    """What one rank did. `losses` are global-batch losses, the same on every rank.

    `state_bytes` is measured after the last step's `optimizer.step()` and before its
    `zero_grad()`, when parameters, gradients and optimizer states all exist. `peak` is
    the peak of the last step (tracked, which slows that step: `step_times[-1]` is not a
    timing to use; neither is `step_times[0]`, which pays for warm-up).
    """

    rank: int
    world: int
    strategy: str
    losses: list[float]
    state_bytes: dict[str, int]
    peak: dict[str, int]
    ledger: list[Any]
    step_times: list[float]
    params: dict[str, torch.Tensor] | None = None
    psi: int = 0  # trainable parameters of the model (each tied weight once)
    first_step: int = 0  # > 0 when resumed: losses[i] is the loss of step first_step + i


# ----------------------------------------------------------------------------- the loop


def _ledger_or_nothing(enabled: bool) -> Ledger | None:
    # records every collective inside it on this rank: ours and PyTorch's
    return Ledger() if enabled else None


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


def train_worker(config: TrainConfig, progress: str | None = None) -> RunReport:
    """One rank's run: build, wrap, train `config.steps` steps, report. Runs inside a
    process group (the launcher's or torchrun's), or alone as world 1."""
    config.validate()
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    if world != config.world:
        raise ValueError(f"config.world={config.world} but the process group has {world} "
                         f"ranks; set world to the number of ranks launched")
    device = rank_device()
    torch.manual_seed(config.seed)
    model = build_model(config.model, config.seed).to(device)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    precision = get_precision(config.precision)
    wrapped = get_strategy(config.strategy)(model, precision,
                                            optimizer_spec(config.optimizer, config.lr),
                                            dict(config.options))
    first_step = _resume(config, wrapped)
    update_progress, close_progress = _progress_reporter(progress if rank == 0 else None,
                                                         config.steps - first_step)
    ledger = _ledger_or_nothing(config.record_ledger)
    local_losses, step_times = [], []
    sizes: dict[str, int] = {}
    peak: dict[str, int] = {}
    tracked = None
    with ledger if ledger is not None else contextlib.nullcontext():
        for step in range(first_step, config.steps):
            if step == config.crash_at_step and rank == config.crash_rank:
                raise RuntimeError(f"rank {rank} crashed at step {step} (crash_at_step)")
            last = step == config.steps - 1
            tracker = (track_peak(wrapped.model, wrapped.optimizer)
                       if last and config.measure_memory else contextlib.nullcontext())
            start = time.perf_counter()
            with tracker as tracked:
                step_loss = torch.zeros((), device=device)
                for micro in range(config.grad_accum):
                    x, y = get_batch(step, rank, world, config.batch_size, config.seq_len,
                                     config.seed, micro, config.grad_accum)
                    x, y = x.to(device), y.to(device)
                    sync = micro == config.grad_accum - 1
                    with contextlib.nullcontext() if sync else wrapped.no_sync():
                        loss = loss_fn(wrapped.model(x), y) / config.grad_accum
                        loss.backward()
                    step_loss += loss.detach()
                wrapped.optimizer.step()
                if last and config.measure_memory:
                    sizes = state_bytes(wrapped.model, wrapped.optimizer)
                wrapped.optimizer.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
            if config.save_every and (step + 1) % config.save_every == 0:
                _save(config, step + 1, wrapped, ledger)
            if ledger is not None and not last:
                ledger.mark_step()
            local_losses.append(step_loss)
            update_progress(step, step_loss)
        if tracked is not None:
            peak = {"total": int(tracked.bytes), **{k: int(v) for k, v in
                                                     tracked.by_category.items()}}
    close_progress()
    # The global-batch loss: the mean of the ranks' means (equal row counts). Reduced
    # once, after the ledger has closed, so that the ledger holds the strategy's traffic
    # and nothing else.
    losses = (torch.stack(local_losses) if local_losses else torch.zeros(0)).float()
    if distributed and world > 1:
        dist.all_reduce(losses)
        losses /= world
    params = None
    if config.keep_params:
        full = wrapped.full_parameters or (lambda: named_full_parameters(wrapped.model))
        params = {k: v.detach().cpu().clone() for k, v in full().items()}
    if config.export_path:
        from shardlab.checkpoint import export_full_state_dict
        export_full_state_dict(wrapped, config.export_path, config.model, config.seed)
    return RunReport(rank, world, config.strategy, losses.tolist(), sizes, peak,
                     list(ledger.records) if ledger is not None else [], step_times,
                     params, psi, first_step)


def _resume(config: TrainConfig, wrapped: Wrapped) -> int:
    """Load the checkpoint `config.resume` names; return the step to continue from."""
    if not config.resume:
        return 0
    from shardlab import checkpoint
    folder = (checkpoint.latest(config.checkpoint_dir) if config.resume is True
              else Path(config.resume))
    if folder is None:
        raise ValueError(f"no complete checkpoint in {config.checkpoint_dir}: train with "
                         f"save_every first, or resume=False")
    return checkpoint.load(folder, wrapped)


def _save(config: TrainConfig, step: int, wrapped: Wrapped, ledger: Ledger | None) -> None:
    from shardlab import checkpoint
    kept = len(ledger.records) if ledger is not None else 0
    checkpoint.save(config.checkpoint_dir, step, wrapped,
                    {"strategy": config.strategy, "model": config.model,
                     "precision": config.precision})
    if ledger is not None:  # the ledger holds the strategy's traffic, not the save's
        del ledger.records[kept:]


def train_many(configs: list[TrainConfig]) -> list[RunReport]:
    """Worker: several runs in one launch (same world size), one after the other. A
    launch costs seconds of process start-up; a notebook comparing strategies pays it once."""
    return [train_worker(c) for c in configs]


def run(config: TrainConfig, *, backend: str = "auto", timeout: float = 600.0,
        progress: bool = False) -> list[RunReport]:
    """Train `config` on `config.world` ranks (one for "single", which always runs on one
    process); return the ranks' reports in rank order."""
    if config.strategy == "single":
        config = replace(config, world=1)
    config.validate()
    try:
        return _launch_workers(config, backend, timeout, progress)
    except RankFailed as failed:
        # A bad option or a model that differs across ranks is found by the strategy on
        # the ranks, before training: hand it back as the ValueError it is.
        last = failed.rank_traceback.strip().splitlines()[-1]
        if last.startswith("ValueError: "):
            raise ValueError(last[len("ValueError: "):]) from failed
        raise


def _launch_workers(config: TrainConfig, backend: str, timeout: float,
                    progress: bool) -> list[RunReport]:
    if under_torchrun():
        return launch(train_worker, config.world, config, "tqdm" if progress else None,
                      backend=backend, timeout=timeout)
    if not progress:
        return launch(train_worker, config.world, config, None, backend=backend,
                      timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="shardlab-train-") as tmp:
        path = Path(tmp) / "progress"
        path.touch()
        done = threading.Event()
        watcher = threading.Thread(target=_draw_progress, args=(path, config.steps, done),
                                   daemon=True)
        watcher.start()
        try:
            return launch(train_worker, config.world, config, str(path), backend=backend,
                          timeout=timeout)
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


# ----------------------------------------------------------------------------- the CLI


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option takes key=value, got {text!r}")
    key, value = text.split("=", 1)
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    lowered = value.lower()
    return key, {"true": True, "false": False}.get(lowered, value)


def ledger_totals(report: RunReport) -> dict[str, float]:
    """Collectives per step of a report: calls and bytes (steps after the first; the first
    can carry one-off set-up traffic)."""
    steps = len(report.step_times)
    if steps > 1:
        later, n = [r for r in report.ledger if r.step > 0], steps - 1
    else:
        later, n = list(report.ledger), 1
    return {"calls": sum(1 for _ in later) / n,
            "logical_bytes": sum(r.logical_bytes for r in later) / n,
            "sent_bytes": sum(r.sent_bytes for r in later) / n}


def median_step_time(report: RunReport) -> float:
    """Median of the step times, leaving out the first (warm-up) and the last (memory
    tracking) step when there are enough steps."""
    times = report.step_times[1:-1] if len(report.step_times) > 2 else report.step_times
    return statistics.median(times)


def summary_table(reports: list[RunReport]) -> str:
    """One line per rank: final loss, median step time, model states, peak, traffic."""
    mib = 1024 * 1024
    head = (f"{'rank':>4} {'loss':>8} {'step ms':>8} {'params MiB':>11} {'grads MiB':>10} "
            f"{'optim MiB':>10} {'peak MiB':>9} {'sent MiB/step':>14} {'colls/step':>11}")
    lines = [head, "-" * len(head)]
    for r in reports:
        s, t = r.state_bytes, ledger_totals(r)
        lines.append(f"{r.rank:>4} {r.losses[-1]:>8.4f} {1e3 * median_step_time(r):>8.1f} "
                     f"{s.get('params', 0) / mib:>11.3f} {s.get('grads', 0) / mib:>10.3f} "
                     f"{s.get('optimizer', 0) / mib:>10.3f} "
                     f"{r.peak.get('total', 0) / mib:>9.3f} {t['sent_bytes'] / mib:>14.3f} "
                     f"{t['calls']:>11.1f}")
    return "\n".join(lines)


def report_to_json(config: TrainConfig, reports: list[RunReport]) -> dict:
    def record(r) -> dict:
        fields = r.__dict__ if hasattr(r, "__dict__") else r._asdict()
        return {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in fields.items()}

    return {"config": {**config.__dict__},
            "ranks": [{"rank": r.rank, "world": r.world, "strategy": r.strategy,
                       "psi": r.psi, "losses": r.losses, "state_bytes": r.state_bytes,
                       "peak": r.peak, "step_times": r.step_times,
                       "collectives_per_step": ledger_totals(r),
                       "ledger": [record(x) for x in r.ledger]} for r in reports]}


def build_parser() -> argparse.ArgumentParser:
    from shardlab.precision import PRECISIONS
    p = argparse.ArgumentParser(
        prog="python -m shardlab train",
        description="Train a small GPT with any strategy, through the launcher "
                    "(--world N) or under torchrun (torchrun --nproc-per-node=N -m "
                    "shardlab train ...).")
    defaults = TrainConfig()
    p.add_argument("--strategy", default=defaults.strategy, choices=sorted(STRATEGIES))
    p.add_argument("--world", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun: its WORLD_SIZE)")
    p.add_argument("--model", default=defaults.model, choices=list(MODEL_NAMES))
    p.add_argument("--precision", default=defaults.precision, choices=sorted(PRECISIONS))
    p.add_argument("--optimizer", default=defaults.optimizer, choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help="global batch of one step, split among the ranks")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--option", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="a strategy option, e.g. bucket_mb=4 (repeatable)")
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--no-ledger", action="store_true", help="skip recording collectives")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a sharded checkpoint every N steps (0: never)")
    p.add_argument("--checkpoint-dir", default="checkpoints", metavar="DIR",
                   help="where checkpoints go, one folder per step (default: checkpoints)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="FOLDER",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, "
                        "or from FOLDER; train up to --steps")
    p.add_argument("--resume-world", type=int, default=None, metavar="N",
                   help="resume on N ranks, whatever world size saved the checkpoint "
                        "(the same as --world N with --resume)")
    p.add_argument("--export", metavar="PATH",
                   help="after training, write the full unsharded state dict (torch.save)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torchrun = under_torchrun()
    if args.resume_world is not None and args.world is not None \
            and args.resume_world != args.world:
        print("error: --resume-world and --world disagree; give one of them",
              file=sys.stderr)
        return 2
    if args.resume_world is not None and not args.resume:
        args.resume = True
    world = args.resume_world or args.world or (int(os.environ["WORLD_SIZE"]) if torchrun
                                                else 1)
    if args.strategy == "single" and (world != 1 or (torchrun and
                                                     int(os.environ["WORLD_SIZE"]) != 1)):
        print("error: strategy 'single' runs on one process: use --world 1 "
              "(or torchrun --nproc-per-node=1)", file=sys.stderr)
        return 2
    config = TrainConfig(strategy=args.strategy, world=world, model=args.model,
                         precision=args.precision, optimizer=args.optimizer, lr=args.lr,
                         steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                         grad_accum=args.grad_accum, seed=args.seed,
                         options=dict(args.option), measure_memory=not args.no_memory,
                         record_ledger=not args.no_ledger, save_every=args.save_every,
                         checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                         export_path=args.export)
    try:
        reports = run(config, backend=args.backend, progress=not args.no_progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0
    if reports[0].first_step:
        print(f"\nresumed at step {reports[0].first_step}")
    print(f"\n{config.strategy} on {world} rank(s): {config.model} "
          f"({reports[0].psi:,} parameters), {config.precision}, {config.optimizer}, "
          f"{config.steps} steps of {config.batch_size} x {config.seq_len} tokens")
    print(summary_table(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(report_to_json(config, reports), indent=1))
        print(f"report written to {args.json}")
    return 0
