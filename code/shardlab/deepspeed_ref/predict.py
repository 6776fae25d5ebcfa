"""The bytes each rank of a deepspeed-zero* run holds, predicted from DeepSpeed's own rules.

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

Apart from the strategies because it runs without DeepSpeed: a chapter predicts what
DeepSpeed will hold on a machine where it is not installed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardlab.deepspeed_ref.strategies import OPTIONS
from shardlab.models import build_model
from shardlab.optimizers import OPTIMIZERS
from shardlab.precision import get_precision
from shardlab.strategy import check_options


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
