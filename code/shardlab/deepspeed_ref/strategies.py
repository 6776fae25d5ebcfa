"""DeepSpeed's ZeRO stages 1, 2 and 3 as strategies of the course.

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

Stages 1 and 2 keep DeepSpeed's default `use_multi_rank_bucket_allreduce: true`, under
which `average_tensor` (`deepspeed/runtime/zero/stage_1_and_2.py`) all-reduces each bucket
on every backend, 3Ψ on the wire a step where a reduce-scatter would send 2Ψ; false sends
each rank's slices to it with one `dist.reduce` per destination instead. Both are options
here, so that the tests can count both.

DeepSpeed's checkpoints are its engine's to write (`wrapped.model.save_checkpoint(dir)`,
`load_checkpoint`); `shardlab.checkpoint` reads only declared layouts and refuses these,
saying why (their cards' `checkpoint_refusal`, `shardlab.cards`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardlab.cards import card
from shardlab.clip import GradClip
from shardlab.deepspeed_ref.setup import deepspeed_missing, import_deepspeed
from shardlab.launch.devices import rank_device
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import InnerOptimizerFace, Precision
from shardlab.strategy import Wrapped, cast_model, check_options, named_full_parameters


# The options: DeepSpeed's own `zero_optimization` keys (so a reader learns its names),
# with DeepSpeed's defaults but one: `reduce_bucket_size` (see the module's docstring).
BUCKET_NUMEL = 1 << 16
_COMMON = {"reduce_bucket_size": BUCKET_NUMEL, "contiguous_gradients": True,
           "offload_optimizer": False}
OPTIONS: dict[int, dict[str, Any]] = {
    1: {**_COMMON, "allgather_bucket_size": 500_000_000,
        "use_multi_rank_bucket_allreduce": True},
    2: {**_COMMON, "allgather_bucket_size": 500_000_000, "overlap_comm": False,
        "use_multi_rank_bucket_allreduce": True},
    3: {**_COMMON, "overlap_comm": True, "offload_param": False,
        "stage3_prefetch_bucket_size": 50_000_000,
        "stage3_param_persistence_threshold": 100_000,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        # True replaces torch.nn.functional.linear with DeepSpeed's own for the rest of the
        # process ("This will persist unless manually reset",
        # runtime/zero/partition_parameters.py): every later model of the process, ours
        # included, then computes its linear layers' gradients DeepSpeed's way (in
        # bf16-mixed, measured: a loss of step 1 moved from 5.184197 to 5.184917).
        "memory_efficient_linear": True,
        # ZeRO-Infinity: offload_optimizer / offload_param "nvme" put them in files under
        # nvme_path, through DeepSpeed's async-I/O op (libaio; built on first use). The
        # optimizer steps one sub-group (of at most sub_group_size elements) at a time,
        # through buffer_count swap buffers; a parameter is read into one of
        # offload_param_buffer_count buffers of offload_param_buffer_size elements, and
        # up to offload_param_max_in_cpu elements of parameters stay in memory instead.
        # (DeepSpeed's defaults, `runtime/zero/offload_config.py`.)
        "nvme_path": None, "sub_group_size": 1_000_000_000,
        "offload_optimizer_buffer_count": 4, "offload_param_buffer_count": 5,
        "offload_param_buffer_size": 100_000_000, "offload_param_max_in_cpu": 1_000_000_000},
}
_FLAGS = ("contiguous_gradients", "overlap_comm", "use_multi_rank_bucket_allreduce",
          "memory_efficient_linear")
# True offloads to the CPU (as before the NVMe tier), "cpu" and "nvme" say where
_OFFLOADS = ("offload_optimizer", "offload_param")
_DEVICES = (False, True, "cpu", "nvme")


def check_deepspeed_options(stage: int, options: dict, device: torch.device) -> dict[str, Any]:
    """The options of `deepspeed-zero{stage}` merged with their defaults, or a ValueError
    that says what to change."""
    opts = check_options(f"deepspeed-zero{stage}", options, OPTIONS[stage])
    for key, value in opts.items():
        if key in _OFFLOADS:
            if value not in _DEVICES or (value == 1 and value is not True) \
                    or (value == 0 and value is not False):
                raise ValueError(f"option {key} takes false, true (the CPU), 'cpu' or "
                                 f"'nvme', got {value!r}")
            opts[key] = "cpu" if value is True else value
        elif key == "nvme_path":
            if value is not None and not isinstance(value, str):
                raise ValueError(f"option nvme_path takes a folder, got {value!r}")
        elif key in _FLAGS:
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
    offload = [k for k in _OFFLOADS if opts.get(k) == "cpu"]
    if offload and device.type != "cuda":
        raise ValueError(f"{', '.join(offload)} moves state from GPU memory to the CPU; "
                         f"this rank computes on the CPU already: leave it off"
                         + (" (or put it on a disk: 'nvme' with nvme_path)" if stage == 3
                            else ""))
    nvme = [k for k in _OFFLOADS if opts.get(k) == "nvme"]
    if nvme and stage != 3:  # stage_1_and_2.py takes any offload device for the CPU
        raise ValueError(f"{', '.join(nvme)} 'nvme' is ZeRO-Infinity, a stage-3 offload: "
                         f"use deepspeed-zero3")
    if nvme and not opts.get("nvme_path"):
        raise ValueError(f"{', '.join(nvme)} 'nvme' needs nvme_path, a folder on the disk")
    return opts


def deepspeed_config(stage: int, precision: Precision, opts: dict[str, Any],
                     optimizer: OptimizerSpec) -> dict[str, Any]:
    """DeepSpeed's JSON config for one of these strategies (see the module's docstring)."""
    zero: dict[str, Any] = {"stage": stage}
    nested = {"nvme_path", "offload_optimizer_buffer_count", "offload_param_buffer_count",
              "offload_param_buffer_size", "offload_param_max_in_cpu"}
    for key, value in opts.items():
        if key in _OFFLOADS:
            if value:
                zero[key] = {"device": value, "pin_memory": True}
                if value == "nvme":
                    kind = key.split("_", 1)[1]  # "optimizer" or "param"
                    zero[key].update(nvme_path=opts["nvme_path"],
                                     buffer_count=opts[f"offload_{kind}_buffer_count"])
                    if kind == "param":
                        zero[key].update(buffer_size=opts["offload_param_buffer_size"],
                                         max_in_cpu=opts["offload_param_max_in_cpu"])
        elif key not in nested:
            zero[key] = value
    config: dict[str, Any] = {
        # The loop owns the batch: these two only count samples in DeepSpeed's logs.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        # DeepSpeed clips by the global norm of its fp32 partitions in engine.step()
        "gradient_clipping": optimizer.clip_norm or 0.0,
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


class EngineStep(InnerOptimizerFace):
    """The optimizer the loop sees: `step()` is the engine's. `self.optimizer` is
    DeepSpeed's ZeRO optimizer (whose own `.optimizer` is the torch.optim one), so
    `param_groups` and `state` are the ones DeepSpeed steps."""

    def __init__(self, engine, clip_norm: float | None = None):
        self.engine = engine
        self.optimizer = engine.optimizer
        # only a record of the norms: the engine clips (`gradient_clipping`)
        self.clip = None if clip_norm is None else GradClip(clip_norm, sharded=True)

    def step(self) -> None:
        self.engine.step()
        if self.clip is not None:
            self.clip.norms.append(float(self.engine.get_global_grad_norm()))

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
    stage3_max_reuse_distance, memory_efficient_linear (stage 3), offload_optimizer and
    offload_param (stage 3) on a GPU (True or "cpu"), or on a disk ("nvme", with
    nvme_path, sub_group_size and the buffers: ZeRO-Infinity, on a CPU too). Precisions:
    "fp32" and "bf16-mixed" (DeepSpeed's `bf16`: bf16 parameters and
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

    step = EngineStep(engine, optimizer.clip_norm)
    return Wrapped(engine, step, no_sync=contextlib.nullcontext,
                   full_parameters=full_parameters, pieces=None,
                   checkpoint_refusal=card(f"deepspeed-zero{stage}").checkpoint_refusal,
                   extra_state=(DeepSpeedState(engine, stage),), module=module,
                   clip=step.clip)


def wrap_deepspeed_zero1(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 1 (optimizer states partitioned)."""
    return wrap_deepspeed(1, model, precision, optimizer, options)


def wrap_deepspeed_zero2(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 2 (optimizer states and gradients partitioned)."""
    return wrap_deepspeed(2, model, precision, optimizer, options)


def wrap_deepspeed_zero3(model, precision, optimizer, options) -> Wrapped:
    """Reference: DeepSpeed's ZeRO stage 3 (parameters partitioned too)."""
    return wrap_deepspeed(3, model, precision, optimizer, options)
