"""DeepSpeed's ZeRO beside ours: stages 1, 2 and 3 as ZeRO's authors ship them.

`deepspeed-zero1`, `deepspeed-zero2` and `deepspeed-zero3` hand the model to
`deepspeed.initialize` with a config that asks for that stage, and give back the contract
every strategy gives (`shardlab.strategy.Wrapped`), so the course's loop drives DeepSpeed
unchanged:

    loss = loss_fn(wrapped.model(x), y)   # the DeepSpeedEngine's forward (stage 3 gathers)
    wrapped.backward(loss)                # loss.backward(): DeepSpeed's hooks reduce
    wrapped.optimizer.step()              # engine.step(): reduce (stage 1), step, gather
    wrapped.optimizer.zero_grad()         # nothing left: engine.step() freed the gradients

DeepSpeed's own loop is `engine.backward(loss); engine.step()`. DeepSpeed 0.19 also
accepts autograd's plain `loss.backward()` (hooks on the forward's output run its backward
prologue and epilogue), so `Wrapped.backward` stays autograd's own, as for every other
strategy. Three settings of the config make it the same *training* as the loop's, and
each one is a fact worth knowing about DeepSpeed:

* `gradient_clipping: 0`. DeepSpeed clips the global gradient norm to 1.0 unless told
  otherwise; plain AdamW, PyTorch's references and the course's strategies do not clip,
  and with DeepSpeed's default its losses leave single-process training's by step 3.
* `managed_gradient_accumulation: false`. DeepSpeed normally counts micro-batches itself
  (`gradient_accumulation_steps`), divides every gradient by that count and treats every
  k-th backward as the boundary that reduces and steps. Here the loop owns accumulation
  (it divides the loss and calls `step()` once per global batch), so every `step()` is the
  boundary. `no_sync` then has nothing to do: stage 1 reduces in `step()` anyway, and
  stages 2 and 3 reduce each micro-batch's buckets during backward, by design (DeepSpeed's
  own `engine.no_sync()` refuses stages 2 and 3).
* `reduce_bucket_size`: DeepSpeed allocates its gradient bucket whole, at its configured
  size: the default, 5e8 elements, is 2 GB of fp32 per rank whatever the model. These
  strategies default to the course's bucket (`bucket_numel`, 65,536 elements).

What DeepSpeed holds differs from the ZeRO paper's formulas in ways a reader can see in the
measured bytes; `predicted_state_bytes` writes down each term:

* an fp32 master copy of this rank's partition even when training in fp32 (the fp32 flat
  buffer the optimizer steps is a copy, not the parameters), so the optimizer holds
  (4 + 8) Ψ/N for AdamW where the course's fp32 ZeRO holds 8 Ψ/N;
* stages 1 and 2 pad the flat buffer to a multiple of 2N (a 4-byte alignment of each
  partition's start, for fp16), where the course pads to N;
* stage 3 partitions each parameter on its own (`param.ds_tensor`, ceil(numel/N) elements,
  defragmented into one flat buffer), and keeps every parameter of at most
  `stage3_param_persistence_threshold` elements (1e5 by default) whole on every rank as
  well, in the padded buffer its all-gather fills; its gradient partitions and its reduce
  bucket stay allocated between steps;
* stages 1 and 2 free the gradients inside `step()`, so after a step they hold none.

DeepSpeed's checkpoints are its engine's to write (`wrapped.model.save_checkpoint(dir)`,
`load_checkpoint`); `shardlab.checkpoint` reads only declared layouts and refuses these.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardlab.launch import rank_device
from shardlab.models import build_model
from shardlab.precision import InnerOptimizerFace, Precision, get_precision
from shardlab.strategy import (OPTIMIZERS, OptimizerSpec, Wrapped, cast_model, check_options,
                               named_full_parameters)

# The loop relies on the engine accepting a plain `loss.backward()` (in 0.19.0, not in
# 0.18.0) and on `managed_gradient_accumulation` (in 0.19.4); 0.19.8 is the one tested.
MINIMUM_VERSION = "0.19.8"
MISSING = ("DeepSpeed is not installed: pip install 'shardlab[deepspeed]' "
           f"(or pip install 'deepspeed>={MINIMUM_VERSION}')")
CHECKPOINT_REFUSAL = ("DeepSpeed writes its own checkpoints: call "
                      "wrapped.model.save_checkpoint(folder) and load_checkpoint(folder) "
                      "(wrapped.model is the DeepSpeedEngine); shardlab.checkpoint saves "
                      "the course's strategies and PyTorch's")

# The options: DeepSpeed's own `zero_optimization` keys (so a reader learns its names),
# with DeepSpeed's defaults but one: `reduce_bucket_size` (see the module's docstring).
BUCKET_NUMEL = 1 << 16
_COMMON = {"reduce_bucket_size": BUCKET_NUMEL, "contiguous_gradients": True,
           "offload_optimizer": False}
OPTIONS: dict[int, dict[str, Any]] = {
    1: {**_COMMON, "allgather_bucket_size": 500_000_000},
    2: {**_COMMON, "allgather_bucket_size": 500_000_000, "overlap_comm": False},
    3: {**_COMMON, "overlap_comm": True, "offload_param": False,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000},
}
_FLAGS = ("contiguous_gradients", "overlap_comm", "offload_optimizer", "offload_param")

# DeepSpeed tests ZeRO with Adam, AdamW and Adagrad and asks for this flag with any other
# optimizer. SGD is elementwise like Adam; the parity tests are the test it asks for.
_UNTESTED_OPTIMIZER_WARNING = "You are using ZeRO with an untested optimizer"


def deepspeed_missing() -> str | None:
    """None when DeepSpeed can be imported, else the line that says how to install it
    (found without importing it: importing DeepSpeed picks its accelerator for good)."""
    return None if importlib.util.find_spec("deepspeed") is not None else MISSING


# ----------------------------------------------------------------------------- importing


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


@contextlib.contextmanager
def _quiet_stderr():
    """Send what is written to stderr, by Python or by C code and subprocesses (file
    descriptor 2), to /dev/null.

    DeepSpeed checks once which of its C++ ops could be built here, and the check for
    NVMe offload links a test program against libaio: on a machine without libaio the
    linker prints "cannot find -laio" on the process's stderr, which a notebook would
    show under the cell. Nothing the course runs depends on it."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for a rank that computes on `device`, quietly, and return it.

    DeepSpeed picks its accelerator once, when it is first imported: on a machine with no
    GPU it guesses the CPU and warns that it did. `DS_ACCELERATOR=cpu` says so instead,
    and must be set before the import; a rank on a GPU lets DeepSpeed find CUDA itself.
    """
    if deepspeed_missing():
        raise ValueError(MISSING)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version(MINIMUM_VERSION):
        raise ValueError(f"the deepspeed-* strategies need DeepSpeed >= {MINIMUM_VERSION}, "
                         f"found {deepspeed.__version__}: pip install -U "
                         f"'deepspeed>={MINIMUM_VERSION}'")

    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise ValueError(f"DeepSpeed runs on {accelerator!r} in this process "
                         f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}) but this "
                         f"rank computes on {device.type!r}: unset DS_ACCELERATOR, or set it "
                         f"to {device.type!r} before anything imports deepspeed")
    if accelerator == "cpu":
        # On the CPU, DeepSpeed's communication backend compiles a shared-memory all-reduce
        # (a C++ extension, built by each rank at start-up) that only its inference engine
        # calls. Training never does; marking it unavailable spares the compiler. (Reading
        # `__compatible_ops__` the first time probes every op, NVMe offload's with a
        # test program linked against libaio.)
        with _quiet_stderr():
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed 0.19 calls torch.distributed's collectives by their old names, which
    # torch >= 2.10 renamed (`all_gather_single`, `reduce_scatter_single`) and warns about
    # on every call. The course calls the new names (through `shardlab.comm`).
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                    r"reduce_scatter_tensor)` is deprecated")
    ds_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessage) for f in ds_logger.filters):
        ds_logger.addFilter(_DropMessage(_UNTESTED_OPTIMIZER_WARNING))
    return deepspeed


# ----------------------------------------------------------------------------- the config


def check_deepspeed_options(stage: int, options: dict, device: torch.device) -> dict[str, Any]:
    """The options of `deepspeed-zero{stage}` merged with their defaults, or a ValueError
    that says what to change."""
    opts = check_options(f"deepspeed-zero{stage}", options, OPTIONS[stage])
    for key, value in opts.items():
        if key in _FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"option {key} takes true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) \
                or value != int(value) or value < 0:
            raise ValueError(f"option {key} takes a whole number of elements >= 0, "
                             f"got {value!r}")
        else:
            opts[key] = int(value)
    if opts["reduce_bucket_size"] < 1:
        raise ValueError("option reduce_bucket_size must be at least 1 element")
    offload = [k for k in ("offload_optimizer", "offload_param") if opts.get(k)]
    if offload and device.type != "cuda":
        raise ValueError(f"{', '.join(offload)} moves state from GPU memory to the CPU; "
                         f"this rank computes on the CPU already: leave it off")
    return opts


def deepspeed_config(stage: int, precision: Precision, opts: dict[str, Any],
                     optimizer: OptimizerSpec) -> dict[str, Any]:
    """DeepSpeed's JSON config for one of these strategies (see the module's docstring)."""
    zero: dict[str, Any] = {"stage": stage}
    for key, value in opts.items():
        if key in ("offload_optimizer", "offload_param"):
            if value:
                zero[key] = {"device": "cpu", "pin_memory": True}
        else:
            zero[key] = value
    config: dict[str, Any] = {
        # The loop owns the batch: these two only count samples in DeepSpeed's logs.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": precision.name == "bf16-mixed"},
    }
    if optimizer.cls not in (torch.optim.Adam, torch.optim.AdamW):
        config["zero_allow_untested_optimizer"] = True
    if opts.get("offload_optimizer"):
        # the course's torch.optim optimizer steps the fp32 partition on the CPU, where
        # DeepSpeed would otherwise insist on its own DeepSpeedCPUAdam
        config["zero_force_ds_cpu_optimizer"] = False
    return config


# ----------------------------------------------------------------------------- the contract


class EngineStep(InnerOptimizerFace):
    """The optimizer the loop sees: `step()` is the engine's. `self.optimizer` is
    DeepSpeed's ZeRO optimizer (whose own `.optimizer` is the torch.optim one), so
    `param_groups` and `state` are the ones DeepSpeed steps."""

    def __init__(self, engine):
        self.engine = engine
        self.optimizer = engine.optimizer

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: `engine.step()` has already freed every gradient."""


class DeepSpeedState:
    """The tensors DeepSpeed's ZeRO optimizer keeps for this rank, declared to
    `shardlab.measure` (they are nobody's `.grad` and, for stage 3's flat partitions and
    the fp32 masters, no module's parameters either)."""

    def __init__(self, engine, stage: int):
        self.engine, self.stage = engine, stage

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        zero = self.engine.optimizer
        module = self.engine.module
        if self.stage < 3:
            params = list(zero.bit16_groups_flat)
            masters = list(zero.single_partition_of_fp32_groups)
            grads = [zero.grads_in_partition]
        else:
            # each parameter's partition (a view of the defragmented flat buffer, or a
            # tensor of its own for a frozen one); persistent or gathered parameters also
            # hold their whole data, which `measure` finds in the module
            params = [p.ds_tensor for p in module.parameters()]
            masters = list(zero.fp32_partitioned_groups_flat)
            grads = [zero.grad_partitions_flat_buffer]
        grads += [m.grad for m in masters]
        grads += [t for group in getattr(zero, "averaged_gradients", {}).values()
                  if group is not None for t in group]
        for bucket in getattr(zero, "ipg_buckets", {}).values():
            buffer = bucket.buffer
            grads += [buffer] if isinstance(buffer, torch.Tensor) else list(buffer)
        states = [t for per_param in zero.optimizer.state.values()
                  for t in per_param.values() if isinstance(t, torch.Tensor)]
        return {"params": params, "grads": [g for g in grads if g is not None],
                "optimizer": masters + states}


def wrap_deepspeed(stage: int, model: nn.Module, precision: Precision,
                   optimizer: OptimizerSpec, options: dict) -> Wrapped:
    """ZeRO stage `stage` by DeepSpeed, behind the course's contract.

    options: DeepSpeed's `zero_optimization` keys (`OPTIONS[stage]` lists them with their
    defaults): reduce_bucket_size, allgather_bucket_size (stages 1, 2), overlap_comm
    (stages 2, 3), contiguous_gradients, stage3_prefetch_bucket_size,
    stage3_param_persistence_threshold, stage3_max_live_parameters,
    stage3_max_reuse_distance (stage 3), offload_optimizer and offload_param (stage 3) on
    a GPU. Precisions: "fp32" and "bf16-mixed" (DeepSpeed's `bf16`: bf16 parameters and
    gradients, fp32 master partitions); "bf16" without master weights is refused.
    """
    missing = deepspeed_missing()
    if missing:
        raise ValueError(missing)
    device = rank_device()
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"deepspeed-zero{stage} needs a process group: run it with "
                         f"shardlab.train.run or shardlab.launch.launch")
    if precision.name == "bf16":
        raise ValueError("DeepSpeed's ZeRO keeps fp32 master weights of its partitions: use "
                         "precision 'bf16-mixed' (its `bf16` config) or 'fp32'")
    opts = check_deepspeed_options(stage, options, device)
    deepspeed = import_deepspeed(device)
    os.environ.setdefault("LOCAL_RANK", str(device.index if device.type == "cuda"
                                            else dist.get_rank()))
    # An existing process group is reused: DeepSpeed's communication wraps it.
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    model = cast_model(model, precision)
    client = optimizer.build([p for p in model.parameters() if p.requires_grad])
    engine, *_ = deepspeed.initialize(model=model, optimizer=client,
                                      config=deepspeed_config(stage, precision, opts,
                                                              optimizer))
    module = engine.module

    def full_parameters() -> dict[str, torch.Tensor]:
        if stage < 3:  # every rank's parameters are whole after each step
            return named_full_parameters(module)
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return named_full_parameters(module)

    return Wrapped(engine, EngineStep(engine), no_sync=contextlib.nullcontext,
                   full_parameters=full_parameters, pieces=None,
                   checkpoint_refusal=CHECKPOINT_REFUSAL,
                   extra_state=(DeepSpeedState(engine, stage),), module=module)


def wrap_deepspeed_zero1(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 1 (optimizer states partitioned)."""
    return wrap_deepspeed(1, model, precision, optimizer, options)


def wrap_deepspeed_zero2(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 2 (optimizer states and gradients partitioned)."""
    return wrap_deepspeed(2, model, precision, optimizer, options)


def wrap_deepspeed_zero3(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 3 (parameters partitioned too)."""
    return wrap_deepspeed(3, model, precision, optimizer, options)


# ----------------------------------------------------------------------------- prediction


def _state_bytes(numel: int, optimizer: str) -> int:
    """What a torch.optim optimizer keeps for one fp32 tensor of `numel` elements that it
    steps: Adam's m and v and its step counter (a 0-dim fp32 tensor), SGD's momentum."""
    return {"adamw": 8 * numel + 4, "sgd": 0, "sgd-momentum": 4 * numel}[optimizer]


def predicted_state_bytes(model: nn.Module, stage: int, world: int, precision: str = "fp32",
                          optimizer: str = "adamw", options: dict | None = None
                          ) -> dict[str, int]:
    """The bytes each rank of `deepspeed-zero{stage}` holds after a step, by category
    (those of `shardlab.measure.state_bytes`), from DeepSpeed's own rules; every rank holds
    the same, padding included.

    With Ψ the trainable elements, N = world, e the parameter's element size (4, or 2 in
    bf16-mixed), P = ceil(Ψ / 2N) · 2N (stages 1 and 2 pad the flat buffer so that each
    of the N partitions starts 4-byte aligned) and S = Σ ceil(n_i / N) over the trainable
    parameters (stage 3 pads each parameter on its own):

        stage   params                           grads               optimizer (AdamW)
        1, 2    e·P                              0 (freed in step)   (4 + 8)·P/N + 4
        3       e·S + e·N·Σ_p ceil(n_i / N)      e·S + e·bucket      (4 + 8)·S + 4

    where Σ_p runs over the persistent parameters (n_i <= the persistence threshold),
    held whole as DeepSpeed all-gathers them: into a buffer of N padded partitions. Add
    the frozen parameters (whole in stages 1 and 2; partitioned, and whole if persistent,
    in stage 3) and the buffers. The 4 of the optimizer is the fp32 master copy, kept
    even in fp32; the + 4 bytes, Adam's step counter.
    """
    if stage not in OPTIONS:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a whole number of ranks >= 1, got {world!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZERS)}")
    prec = get_precision(precision)
    if prec.name == "bf16":
        raise ValueError("DeepSpeed's ZeRO has no 'bf16' without master weights: use "
                         "'bf16-mixed' or 'fp32'")
    opts = check_options(f"deepspeed-zero{stage}", dict(options or {}), OPTIONS[stage])
    elem = torch.empty(0, dtype=prec.param_dtype, device="cpu").element_size()
    params = list(model.parameters())  # each tied parameter once
    trainable = [p.numel() for p in params if p.requires_grad]
    frozen = [p.numel() for p in params if not p.requires_grad]
    buffers = sum(b.numel() * (elem if b.is_floating_point() else b.element_size())
                  for b in model.buffers())
    if stage < 3:
        align = 2 * world
        padded = math.ceil(sum(trainable) / align) * align
        partition = padded // world
        return {"params": elem * (padded + sum(frozen)), "grads": 0,
                "optimizer": 4 * partition + _state_bytes(partition, optimizer),
                "buffers": buffers}
    threshold = opts["stage3_param_persistence_threshold"]

    def held(n: int) -> int:
        # a parameter's partition and, if persistent, the whole parameter as DeepSpeed
        # all-gathers it: into a buffer of N partitions (padding included)
        partition = -(-n // world)
        return partition + (world * partition if n <= threshold else 0)

    partitions = sum(-(-n // world) for n in trainable)
    bucket = opts["reduce_bucket_size"] if opts["contiguous_gradients"] else 0
    return {"params": elem * sum(held(n) for n in trainable + frozen),
            "grads": elem * (partitions + bucket),
            "optimizer": 4 * partitions + _state_bytes(partitions, optimizer),
            "buffers": buffers}


def predicted_for(model_name: str, stage: int, world: int, precision: str = "fp32",
                  optimizer: str = "adamw", options: dict | None = None,
                  model_config: dict | None = None) -> dict[str, int]:
    """`predicted_state_bytes` for a model of `shardlab.models` by name."""
    return predicted_state_bytes(build_model(model_name, 0, model_config), stage, world,
                                 precision, optimizer, options)


# ----------------------------------------------------------------------------- chapter workers

# Each ZeRO stage by its three implementations: the course's, PyTorch's, DeepSpeed's.
# PyTorch has no ZeRO-2 of its own (FSDP shards the parameters too); its stage-3 is
# `fully_shard`.
STAGE_TRIOS: dict[int, tuple[str, str | None, str]] = {
    1: ("zero1", "torch-zero1", "deepspeed-zero1"),
    2: ("zero2", None, "deepspeed-zero2"),
    3: ("zero3", "torch-fsdp2", "deepspeed-zero3"),
}


def beside_deepspeed(strategies: list[str], model: str = "gpt-tiny", steps: int = 5,
                     batch_size: int = 8, seq_len: int = 32, precision: str = "fp32",
                     options: dict[str, dict] | None = None) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): train each strategy `steps` steps
    of AdamW on the same data with the course's loop, and return for each what a table of
    "ours, PyTorch's, DeepSpeed's" shows: the global-batch losses, the bytes this rank
    holds after the last step (DeepSpeed's predicted bytes beside them for its stages),
    the peak of the last step, the collectives of a step (calls and bytes by operation,
    steps after the first) and the median step time (first and last left out)."""
    import statistics
    import time

    from shardlab.comm import Ledger
    from shardlab.measure import state_bytes, track_peak
    from shardlab.models import get_batch, loss_fn
    from shardlab.strategy import get_strategy, optimizer_spec

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    results = []
    for strategy in strategies:
        torch.manual_seed(0)
        net = build_model(model, 0).to(device)
        psi = sum(p.numel() for p in net.parameters() if p.requires_grad)
        wrapped = get_strategy(strategy)(net, get_precision(precision),
                                         optimizer_spec("adamw", 1e-3),
                                         dict((options or {}).get(strategy, {})))
        losses, times, held, peak = [], [], {}, None
        with Ledger() as ledger:
            for step in range(steps):
                x, y = (t.to(device) for t in get_batch(step, rank, world, batch_size,
                                                         seq_len))
                last = step == steps - 1
                dist.barrier()  # start together: a step's time is the schedule's
                start = time.perf_counter()
                with (track_peak(*wrapped.holders()) if last
                      else contextlib.nullcontext()) as peak:
                    loss = loss_fn(wrapped.model(x), y)
                    wrapped.backward(loss)
                    wrapped.optimizer.step()
                    if last:
                        held = state_bytes(*wrapped.holders())
                    wrapped.optimizer.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                losses.append(loss.detach().float())
                ledger.mark_step()
        per_step: dict[str, dict[str, float]] = {}
        for record in ledger.records:
            if 0 < record.step < steps:
                op = per_step.setdefault(record.op, {"calls": 0, "logical_bytes": 0,
                                                     "sent_bytes": 0})
                op["calls"] += 1 / (steps - 1)
                op["logical_bytes"] += record.logical_bytes / (steps - 1)
                op["sent_bytes"] += record.sent_bytes / (steps - 1)
        mean_losses = torch.stack(losses)
        dist.all_reduce(mean_losses)
        stage = next((s for s, trio in STAGE_TRIOS.items() if strategy in trio), None)
        results.append({
            "strategy": strategy, "stage": stage, "world": world, "psi": psi,
            "losses": (mean_losses / world).tolist(), "state_bytes": held,
            "predicted_bytes": (predicted_state_bytes(build_model(model, 0), stage, world,
                                                      precision, "adamw",
                                                      (options or {}).get(strategy))
                                if strategy.startswith("deepspeed-") else None),
            "peak_bytes": int(peak.bytes), "collectives": per_step,
            "step_seconds": statistics.median(times[1:-1] if steps > 2 else times),
        })
    return results


def side_by_side_table(results: list[dict]) -> str:
    """`beside_deepspeed`'s results (one rank's) as a text table, one line a strategy."""
    mib = 2**20
    head = (f"{'stage':>5} {'strategy':<16} {'last loss':>9} {'params MiB':>10} "
            f"{'grads MiB':>9} {'optim MiB':>9} {'peak MiB':>8} {'sent MiB/step':>13} "
            f"{'step ms':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        held = r["state_bytes"]
        sent = sum(op["sent_bytes"] for op in r["collectives"].values())
        lines.append(f"{r['stage'] or '-':>5} {r['strategy']:<16} {r['losses'][-1]:>9.4f} "
                     f"{held['params'] / mib:>10.3f} {held['grads'] / mib:>9.3f} "
                     f"{held['optimizer'] / mib:>9.3f} {r['peak_bytes'] / mib:>8.3f} "
                     f"{sent / mib:>13.3f} {1e3 * r['step_seconds']:>7.1f}")
    return "\n".join(lines)


def deepspeed_estimate(stage: int, psi: int, largest_layer: int, gpus: int) -> int:
    """DeepSpeed's own estimate of the model states per GPU (bytes) for ZeRO-2 or ZeRO-3
    with mixed precision and Adam on `gpus` GPUs of one node, no offload:
    `estimate_zero{2,3}_model_states_mem_needs`, what the `..._all_cold` functions print
    for a model of `psi` parameters whose largest module has `largest_layer`."""
    import_deepspeed(torch.device("cpu"))
    with _quiet_stderr():  # these modules check for libaio when first imported
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import \
            estimate_zero2_model_states_mem_needs
    if stage == 2:
        return int(estimate_zero2_model_states_mem_needs(psi, gpus, cpu_offload=False)[1])
    if stage == 3:
        return int(estimate_zero3_model_states_mem_needs(
            psi, largest_layer, gpus, cpu_offload=False, cpu_offload_params=False)[1])
    raise ValueError(f"DeepSpeed estimates stages 2 and 3, not {stage!r}")


def zero_config_defaults() -> dict[str, Any]:
    """DeepSpeed's defaults for its `zero_optimization` keys, by their config names."""
    import_deepspeed(torch.device("cpu"))
    with _quiet_stderr():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig().model_dump(by_alias=True)


def estimates_beside_planner(model: str = "gpt-small", world: int = 4,
                             model_config: dict | None = None) -> list[dict]:
    """DeepSpeed's memory estimator beside the course's planner, for ZeRO-2 and ZeRO-3
    with bf16-mixed AdamW on `world` GPUs of one node, no offload; bytes per GPU.

    * "deepspeed_estimate": DeepSpeed's own `estimate_zero{2,3}_model_states_mem_needs`
      (what its `..._all_live(model, num_gpus_per_node=world)` prints): 2Ψ + 18Ψ/N for
      ZeRO-2, 4·L + 18Ψ/N for ZeRO-3, L the largest module's own parameters;
    * "planner": `shardlab.memory.model_states` (the paper's 2Ψ + 14Ψ/N and 16Ψ/N), plus,
      for ZeRO-3, the planner's gathered unit (`gathered_unit_bytes`, the largest
      transformer block in bf16, prefetch on: two of them);
    * "deepspeed_rules": what a rank of `deepspeed-zero{2,3}` holds after a step by
      `predicted_state_bytes` (the measured bytes, to the byte, on the course's runs).

    Runs in the calling process (nothing distributed); it imports DeepSpeed for the CPU.
    """
    from shardlab import memory

    net = build_model(model, 0, model_config)
    with _quiet_stderr():
        from deepspeed.runtime.zero.stage3 import model_to_params
    psi, largest_layer = model_to_params(net)
    blocks = [m for m in net.modules() if type(m).__name__ in ("Block", "GPT2Block",
                                                               "LlamaDecoderLayer")]
    unit = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=psi)
    rows = []
    for stage in (2, 3):
        estimate = deepspeed_estimate(stage, psi, largest_layer, world)
        gathered = (memory.gathered_unit_bytes(unit, "bf16-mixed", prefetch=True)
                    if stage == 3 else 0)
        paper = memory.model_states(psi, world, stage, "bf16-mixed", "adamw")
        rules = predicted_state_bytes(net, stage, world, "bf16-mixed")
        rows.append({"stage": stage, "world": world, "psi": psi,
                     "largest_layer": largest_layer, "unit": unit,
                     "deepspeed_estimate": int(estimate),
                     "planner": int(paper.total) + gathered,
                     "planner_states": int(paper.total), "planner_gathered": gathered,
                     "deepspeed_rules": sum(rules.values()), "deepspeed_rules_by": rules})
    return rows
