"""DeepSpeed's ZeRO as its authors ship it: stages 1, 2 and 3 as reference strategies.

`deepspeed-zero1`, `deepspeed-zero2` and `deepspeed-zero3` wrap the model every rank
built in DeepSpeed's engine (`deepspeed.initialize`) with the course's optimizer as
DeepSpeed's client optimizer, and hand back the contract of `shardlab.strategy`, so the
same loop, report, ledger and memory measurements run them beside ours and PyTorch's.

Three things differ from the course's loop, each for a reason of DeepSpeed's:

* backward goes through the engine (`engine.backward(loss)`), which reduces and
  partitions gradients around autograd; the contract's `backward` field says so;
* `optimizer.step()` is `engine.step()`, which also clears the gradients (DeepSpeed
  frees its gradient partitions there, so what a rank holds after the step is
  parameters and optimizer state only);
* gradient clipping is off (`gradient_clipping: 0`): DeepSpeed clips to norm 1.0 by
  default, and plain AdamW does not, so with the default its losses leave one process's
  after a few steps.

Facts of DeepSpeed's layout that the prediction (`predicted_state_bytes`) applies, checked
against what each rank holds:

* an fp32 master copy of this rank's partition is kept even in fp32 training, so the
  optimizer holds (4 + 8) bytes per element of the partition, not 8;
* stages 1 and 2 flatten the parameters into one buffer padded to a multiple of 2N
  elements (4-byte alignment of each fp16 partition) and keep it whole on every rank;
* stage 3 cuts every parameter on its own (`param.ds_tensor`, padded to a multiple of N),
  and keeps a parameter whole on every rank besides when it has fewer elements than
  `stage3_param_persistence_threshold` (10^5 by default): small tensors are not worth
  the latency of a gather.

DeepSpeed runs on the CPU with gloo (`DS_ACCELERATOR=cpu`, set here before it is
imported when the ranks have no GPU) and on GPUs. Its checkpoints are its engine's
(`engine.save_checkpoint`); the course's checkpoint format is not offered for them.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardlab.launch import rank_device
from shardlab.precision import Precision
from shardlab.strategy import OptimizerSpec, Wrapped, check_options

INSTALL = "pip install deepspeed (or pip install 'shardlab[deepspeed]')"

# The options of the strategies, as DeepSpeed's configuration keys.
# DeepSpeed's own defaults are sized for billions of parameters: a 5*10^8-element
# gradient bucket is allocated whole (2 GB in fp32 per rank, on a laptop too). These are
# sized for the course's models, as DeepSpeed's "auto" values would be for them.
DEEPSPEED_OPTIONS: dict[str, Any] = {
    "reduce_bucket_size": 2 * 10**6,                 # elements per gradient reduction
    "allgather_bucket_size": 2 * 10**6,              # stages 1-2: elements per all-gather
    "overlap_comm": False,
    "stage3_prefetch_bucket_size": 10**6,            # stage 3: elements gathered ahead
    "stage3_param_persistence_threshold": 10**5,     # stage 3: smaller stays whole
    "stage3_max_live_parameters": 10**9,
}
PERSISTENCE_THRESHOLD = DEEPSPEED_OPTIONS["stage3_param_persistence_threshold"]


def import_deepspeed():
    """DeepSpeed, imported for this rank's device, quietly; a clear refusal without it."""
    if "deepspeed" not in sys.modules and rank_device().type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import deepspeed
    except ImportError:
        raise ValueError(f"the deepspeed-* strategies need DeepSpeed: {INSTALL}") from None
    import logging
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls torch.distributed's old collective names, which warn on every
    # call on torch 2.13; the course's own code uses the new ones (shardlab.comm).
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                    r"reduce_scatter_tensor)` is deprecated")
    # The course never uses DeepSpeed's shared-memory inference all-reduce; building it
    # compiles C++ at the first init on a CPU, so it is not built.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    return deepspeed


def deepspeed_config(stage: int, precision: Precision, options: dict) -> dict:
    zero = {"stage": stage, "contiguous_gradients": True,
            "reduce_bucket_size": int(options["reduce_bucket_size"]),
            "overlap_comm": bool(options["overlap_comm"])}
    if stage < 3:
        zero["allgather_bucket_size"] = int(options["allgather_bucket_size"])
    else:
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_max_live_parameters"):
            zero[key] = int(options[key])
    return {"train_micro_batch_size_per_gpu": 1,  # the loop feeds the batches itself
            "gradient_accumulation_steps": 1,      # and says where a step ends (no_sync)
            "gradient_clipping": 0.0,
            "zero_optimization": zero,
            "bf16": {"enabled": precision.master_weights},
            "steps_per_print": 10**12, "wall_clock_breakdown": False}


class EngineOptimizer:
    """The optimizer face of DeepSpeed's engine for the course's loop: `step()` is
    `engine.step()`, which also clears the gradients; `zero_grad()` has nothing left to
    do. Its `state_tensors()` declares what DeepSpeed holds, for `shardlab.measure`."""

    def __init__(self, engine, stage: int):
        self.engine, self.stage = engine, stage
        self.zero = engine.optimizer              # DeepSpeed's ZeRO optimizer
        self.optimizer = self.zero.optimizer      # the client optimizer, over partitions

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() cleared them

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        zero = self.zero
        states = [t for s in self.optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)]
        if self.stage < 3:
            params = list(zero.bit16_groups_flat)
            masters = list(zero.single_partition_of_fp32_groups)
        else:
            params = [p.ds_tensor for p in self.engine.module.parameters()]
            params += [p for p in self.engine.module.parameters() if p.numel()]
            masters = list(zero.fp32_partitioned_groups_flat)
        return {"params": params, "grads": [], "optimizer": masters + states,
                "buffers": list(self.engine.module.buffers())}


def _wrap(stage: int, model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
          options: dict) -> Wrapped:
    name = f"deepspeed-zero{stage}"
    options = check_options(name, options, DEEPSPEED_OPTIONS)
    if precision.name == "bf16":
        raise ValueError(f"{name} trains 'fp32' or 'bf16-mixed' (DeepSpeed keeps fp32 "
                         f"master weights whenever it trains in bf16)")
    deepspeed = import_deepspeed()
    if not dist.is_initialized():
        raise ValueError(f"{name} needs torch.distributed initialized: run it through "
                         f"shardlab.launch.launch or torchrun")
    device = rank_device()  # DeepSpeed picks its device by LOCAL_RANK
    os.environ.setdefault("LOCAL_RANK", str(device.index if device.type == "cuda"
                                            else dist.get_rank()))
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # reuses the group
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer.build([p for p in model.parameters()
                                                if p.requires_grad]),
        config=deepspeed_config(stage, precision, options))
    face = EngineOptimizer(engine, stage)

    @contextlib.contextmanager
    def no_sync():
        engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            engine.set_gradient_accumulation_boundary(True)

    def backward(loss: torch.Tensor) -> None:
        engine.backward(loss)

    def full_parameters() -> dict[str, torch.Tensor]:
        names = [n for n, _ in engine.module.named_parameters()]
        if stage < 3:
            return {n: p.detach().float().cpu().clone()
                    for n, p in engine.module.named_parameters()}
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {n: p.detach().float().cpu().clone()
                    for n, p in zip(names, engine.module.parameters())}

    engine.set_gradient_accumulation_boundary(True)
    return Wrapped(engine, face, no_sync=no_sync, full_parameters=full_parameters,
                   backward=backward, extra_state=(), module=engine.module,
                   checkpoint_refusal=f"{name} is checkpointed by DeepSpeed's own "
                                      f"engine.save_checkpoint, not by shardlab")


def wrap_deepspeed_zero1(model, precision, optimizer, options) -> Wrapped:
    """DeepSpeed's stage 1: optimizer states (and fp32 masters) partitioned."""
    return _wrap(1, model, precision, optimizer, options)


def wrap_deepspeed_zero2(model, precision, optimizer, options) -> Wrapped:
    """DeepSpeed's stage 2: gradients partitioned too."""
    return _wrap(2, model, precision, optimizer, options)


def wrap_deepspeed_zero3(model, precision, optimizer, options) -> Wrapped:
    """DeepSpeed's stage 3: parameters partitioned too, each on its own."""
    return _wrap(3, model, precision, optimizer, options)


# ----------------------------------------------------------------------------- prediction


def predicted_state_bytes(model: nn.Module, stage: int, world: int,
                          precision: str = "fp32",
                          persistence_threshold: int = PERSISTENCE_THRESHOLD
                          ) -> dict[str, int]:
    """What one rank of DeepSpeed's `stage` holds after `engine.step()` for AdamW,
    computed from the parameter shapes with DeepSpeed's own rules (module docstring)."""
    params = [p for p in model.parameters() if p.requires_grad]
    psi = sum(p.numel() for p in params)
    b = 2 if precision == "bf16-mixed" else 4   # the model's parameters
    adam = 2 * 4 + 4                             # m and v in fp32, the master copy
    if stage < 3:
        alignment = 2 * world
        padded = math.ceil(psi / alignment) * alignment
        partition = padded // world
        return {"params": b * padded, "grads": 0,
                "optimizer": adam * partition + 4, "buffers": 0}
    partitions = [math.ceil(p.numel() / world) for p in params]
    whole = sum(p.numel() for p in params if p.numel() < persistence_threshold)
    partition = sum(partitions)
    return {"params": b * (partition + whole), "grads": 0,
            "optimizer": adam * partition + 4, "buffers": 0}
