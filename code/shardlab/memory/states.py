"""The stage formulas of the ZeRO paper: bytes per parameter, and what each stage shards.

The symbols are the paper's (Rajbhandari et al., 2020), and the text's:

    psi    Ψ   number of parameters
    world  N   number of data-parallel ranks
    K          optimizer bytes per parameter (12 for AdamW with fp32 master weights)

Mixed-precision AdamW holds 2 + 2 + K = 16 bytes per parameter (bf16 parameter, bf16
gradient, fp32 master copy + fp32 m + fp32 v). Every data-parallel rank holds all 16Ψ;
each ZeRO stage shards one more of the three terms N ways:

    stage 0 (DDP)   (2 + 2 + K) Ψ
    stage 1  P_os   (2 + 2) Ψ + K Ψ / N
    stage 2  P_os+g  2 Ψ + (2 + K) Ψ / N
    stage 3  P_os+g+p (2 + 2 + K) Ψ / N

`bytes_per_param` derives the three numbers from a training recipe instead of assuming
2, 2 and 12, so the same formulas cover fp32 AdamW, bf16 without master weights and SGD.
`offloaded_states` splits them between the GPU and host memory under ZeRO-Offload.
This is the module the rest of `shardlab.memory` builds on, and it also holds the
argument checks they share.

Units are explicit (`shardlab.units`): GB = 10**9 bytes (the ZeRO paper's unit), GiB =
2**30 bytes (what a device reports).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlab.units import GB, GiB

PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # the names of shardlab.precision
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
STAGES = (0, 1, 2, 3)


# Where the rank's shard of the model states lives between steps (ZeRO-Offload keeps the
# optimizer on the CPU; ZeRO-Infinity and FSDP2's CPUOffloadPolicy the parameters too).
OFFLOAD = ("none", "optimizer", "optimizer+params")

# Bytes of one element of the parameters (and gradients) that forward/backward use.
_PARAM_BYTES = {"fp32": 4, "bf16-mixed": 2, "bf16": 2}
# Tensors of parameter size that each optimizer keeps per parameter.
_OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}  # Adam: m and v


@dataclass(frozen=True)
class Breakdown:
    """Bytes (or bytes per parameter) of parameters, gradients and optimizer states."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def scaled(self, factor: float) -> "Breakdown":
        return Breakdown(self.params * factor, self.grads * factor, self.optimizer * factor)

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of {list(PRECISIONS)}")
    return precision


def check_optimizer(optimizer: str) -> str:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {list(OPTIMIZERS)}")
    return optimizer


def check_positive(name: str, value, integer: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or (isinstance(value, float) and not math.isfinite(value)):
        kind = "a whole number" if integer else "a number"
        raise ValueError(f"{name} must be {kind} > 0, got {value!r}")
    return int(value) if integer else value


def check_world(world) -> int:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world (N, the number of data-parallel ranks) must be a whole "
                         f"number >= 1, got {world!r}")
    return world


def check_stage(stage) -> int:
    if stage not in STAGES or isinstance(stage, bool):
        raise ValueError(f"unknown ZeRO stage {stage!r}; use one of {list(STAGES)} "
                         f"(0 = DDP, 3 = ZeRO-3/FSDP)")
    return stage


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; use one of {list(choices)}")
    return value


def bytes_per_param(precision: str = "bf16-mixed", optimizer: str = "adamw") -> Breakdown:
    """Bytes per parameter of a training recipe: (parameter, gradient, K).

    K counts what the optimizer holds per parameter: the fp32 master copy when the
    recipe keeps one (4), plus each state tensor (Adam's m and v, SGD's momentum) in the
    dtype the optimizer steps in (fp32 over master weights, else the parameter's dtype).

    >>> bytes_per_param("bf16-mixed", "adamw")   # 2 + 2 + (4 + 4 + 4) = 16
    Breakdown(params=2, grads=2, optimizer=12)
    """
    check_precision(precision)
    check_optimizer(optimizer)
    param = _PARAM_BYTES[precision]
    master = 4 if precision == "bf16-mixed" else 0
    state_dtype_bytes = 4 if master else param
    K = master + _OPTIMIZER_STATES[optimizer] * state_dtype_bytes
    return Breakdown(params=param, grads=param, optimizer=K)


def shard_numel(psi: int, world: int) -> int:
    """Elements each rank holds of a Ψ-element buffer split N ways: a flat buffer is
    padded to a multiple of N, so every shard has ceil(Ψ/N) elements."""
    return -(-psi // world) if isinstance(psi, int) else psi / world


def model_states(psi, world: int, stage: int, precision: str = "bf16-mixed",
                 optimizer: str = "adamw") -> Breakdown:
    """Per-rank bytes of parameters, gradients and optimizer states at a ZeRO stage.

    Stage 0 is DDP (nothing sharded), 1 shards the optimizer states, 2 also the
    gradients, 3 also the parameters (ZeRO-3 / FSDP). A sharded term holds
    ceil(Ψ/N) elements per rank (whole Ψ is padded to a multiple of N).
    """
    psi = check_positive("psi (the number of parameters)", psi)
    world, stage = check_world(world), check_stage(stage)
    per = bytes_per_param(precision, optimizer)
    full, shard = psi, shard_numel(psi, world)
    return Breakdown(params=per.params * (shard if stage >= 3 else full),
                     grads=per.grads * (shard if stage >= 2 else full),
                     optimizer=per.optimizer * (shard if stage >= 1 else full))


def largest_model(memory_bytes, world: int, stage: int, precision: str = "bf16-mixed",
                  optimizer: str = "adamw") -> float:
    """The largest Ψ whose model states alone fit in `memory_bytes` per rank."""
    memory_bytes = check_positive("memory_bytes", memory_bytes)
    per_param = model_states(1.0, world, stage, precision, optimizer).total
    return memory_bytes / per_param


def offloaded_states(psi, world: int, stage: int, offload: str = "none",
                     precision: str = "bf16-mixed",
                     optimizer: str = "adamw") -> tuple[Breakdown, Breakdown]:
    """(on the GPU, in host memory) per rank, when the rank's shard is offloaded.

    "optimizer" (ZeRO-Offload, stages 1-3): the optimizer states and the gradient
    shard that the CPU's optimizer step reads live in host memory; what every rank
    replicates (the parameters below stage 3, the gradients below stage 2) stays on the
    GPU. "optimizer+params" (stage 3 only: ZeRO-Infinity's parameter offload, FSDP2's
    CPUOffloadPolicy): the parameter shard too, so nothing persists on the GPU but what
    is gathered for a unit's compute.
    """
    check_choice("offload", offload, OFFLOAD)
    states = model_states(psi, world, stage, precision, optimizer)
    if offload == "none":
        return states, Breakdown(0, 0, 0)
    if stage == 0:
        raise ValueError("offload needs a sharded optimizer: use stage 1, 2 or 3 "
                         "(ZeRO-Offload), or offload='none' for DDP")
    if offload == "optimizer+params" and stage != 3:
        raise ValueError("offload='optimizer+params' needs sharded parameters: use stage 3, "
                         "or offload='optimizer'")
    per, shard = bytes_per_param(precision, optimizer), shard_numel(psi, world)
    grads_gpu = states.grads if stage < 2 else 0  # a replicated gradient stays
    params_gpu = 0 if offload == "optimizer+params" else states.params
    host = Breakdown(params=per.params * shard if offload == "optimizer+params" else 0,
                     grads=per.grads * shard, optimizer=states.optimizer)
    return Breakdown(params_gpu, grads_gpu, 0), host
