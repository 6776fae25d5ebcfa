"""Where training memory goes: the analytic model of the ZeRO paper, in bytes.

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
What these formulas leave out (activations, the all-gathered unit of ZeRO-3, gradient
buckets, fragmentation) has its own functions below, and `plan` adds it all up.

Units are explicit: GB = 10**9 bytes (the ZeRO paper's unit), GiB = 2**30 bytes (what a
device reports).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Iterable

GB = 10**9
GiB = 2**30

PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # the names of shardlab.precision
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
STAGES = (0, 1, 2, 3)
CHECKPOINTING = ("none", "selective", "full")

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


# ----------------------------------------------------------------------------- checks


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


# ----------------------------------------------------------------------------- 16 bytes


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


# ----------------------------------------------------------------------------- architectures


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, enough to count its parameters.

    style "gpt2": learned positions, LayerNorm (weight and bias), biases everywhere,
    a GELU MLP of two matrices. style "llama": rotary positions (no parameters), RMSNorm
    (weight only), no biases, a SwiGLU MLP of three matrices, grouped-query attention.
    """

    name: str
    style: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    positions: int = 0  # learned position embeddings (GPT-2 only)

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def layer_params(self) -> int:
        h, f, kv = self.hidden, self.ffn, self.kv_dim
        if self.style == "gpt2":
            attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h  # qkv and output
            mlp = h * f + f + f * h + h
            norms = 2 * 2 * h
        else:
            attention = h * (h + 2 * kv) + h * h
            mlp = 3 * h * f  # gate, up, down
            norms = 2 * h
        return attention + mlp + norms

    def num_params(self) -> int:
        h = self.hidden
        embedding = self.vocab * h + self.positions * h
        head = 0 if self.tied else self.vocab * h
        final_norm = 2 * h if self.style == "gpt2" else h
        return embedding + self.layers * self.layer_params() + final_norm + head


def _gpt2(name, layers, hidden, heads):
    return ModelConfig(name, "gpt2", layers, hidden, heads, heads, 4 * hidden, 50257,
                       tied=True, positions=1024)


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab):
    return ModelConfig(name, "llama", layers, hidden, heads, kv_heads, ffn, vocab, tied=False)


# Configurations as published with the models (Hugging Face config.json files).
MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _gpt2("gpt2-small", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
]}


def get_model(name: str) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; use one of {list(MODELS)}")
    return MODELS[name]


def num_params(model: str | ModelConfig) -> int:
    """Ψ of a model preset, counted from its architecture."""
    return (get_model(model) if isinstance(model, str) else model).num_params()


# ----------------------------------------------------------------------------- transients


def activation_bytes(model: str | ModelConfig, batch: int, seq: int,
                     checkpointing: str = "none") -> int:
    """Activations a transformer keeps for backward, per rank (Korthikanti et al., 2022).

    Per layer, with 16-bit activations and no tensor parallelism, a layer saves
    s·b·h·(34 + 5·a·s/h) bytes: 34·s·b·h for the inputs of its matmuls, norms, GELU and
    dropout masks, and 5·a·s²·b for the attention scores, softmax and its dropout mask.
    "selective" recomputes the attention core (drops the 5·a·s/h term); "full"
    checkpoints each layer and keeps only its 2·s·b·h-byte input (one layer at a time is
    rebuilt during backward, which `plan` adds back). Embeddings and the logits are
    small terms the paper leaves out, and so does this function.
    """
    cfg = get_model(model) if isinstance(model, str) else model
    b = check_positive("batch", batch, integer=True)
    s = check_positive("seq", seq, integer=True)
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"unknown checkpointing {checkpointing!r}; use one of "
                         f"{list(CHECKPOINTING)}")
    h, a, L = cfg.hidden, cfg.heads, cfg.layers
    per_layer = {"none": 34 * s * b * h + 5 * a * s * s * b,
                 "selective": 34 * s * b * h,
                 "full": 2 * s * b * h}[checkpointing]
    return L * per_layer


def gathered_unit_bytes(unit_psi, precision: str = "bf16-mixed", prefetch: bool = False) -> int:
    """ZeRO-3/FSDP all-gathers one unit (e.g. a transformer block) before using it; with
    prefetching the next unit's gather is in flight too, so two are held at once."""
    unit_psi = check_positive("unit_psi", unit_psi)
    return bytes_per_param(precision).params * unit_psi * (2 if prefetch else 1)


def bucket_bytes(bucket_numel, precision: str = "bf16-mixed", buckets: int = 1) -> int:
    """Gradient buckets (DDP's all-reduce buckets, ZeRO-2's reduce buckets) hold a copy
    of `bucket_numel` gradients each, in the gradient's dtype."""
    bucket_numel = check_positive("bucket_numel", bucket_numel)
    buckets = check_positive("buckets", buckets, integer=True)
    return bytes_per_param(precision).grads * bucket_numel * buckets


# ----------------------------------------------------------------------------- planner


@dataclass(frozen=True)
class PlanRow:
    stage: int
    checkpointing: str
    offload: bool  # optimizer states (and their step) on the CPU, as in ZeRO-Offload
    states: Breakdown  # model states left on the GPU, per rank
    activations: int
    gathered: int  # the all-gathered unit(s) of stage 3
    memory: int  # the GPU's memory, bytes

    @property
    def total(self) -> float:
        return self.states.total + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.total <= self.memory


def plan(model: str | ModelConfig, memory_bytes, world: int, batch: int = 1, seq: int = 4096,
         precision: str = "bf16-mixed", optimizer: str = "adamw",
         prefetch: bool = True) -> list[PlanRow]:
    """Every stage × checkpointing × offload for one model on N GPUs of `memory_bytes`.

    `batch` is the micro-batch per rank. Stage 3 adds its gathered layer(s); full
    checkpointing adds back one layer's activations, rebuilt during backward.
    """
    cfg = get_model(model) if isinstance(model, str) else model
    memory_bytes = check_positive("memory_bytes", memory_bytes)
    psi = cfg.num_params()
    rows = []
    for stage in STAGES:
        states = model_states(psi, world, stage, precision, optimizer)
        gathered = gathered_unit_bytes(cfg.layer_params(), precision, prefetch) if stage == 3 else 0
        for checkpointing in CHECKPOINTING:
            acts = activation_bytes(cfg, batch, seq, checkpointing)
            if checkpointing == "full":
                acts += activation_bytes(cfg, batch, seq, "none") // cfg.layers
            for offload in (False, True):
                on_gpu = Breakdown(states.params, states.grads, 0) if offload else states
                rows.append(PlanRow(stage, checkpointing, offload, on_gpu, acts,
                                    gathered, memory_bytes))
    return rows


def parse_bytes(text: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80·2**30 (a bare number is GB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(GB|GiB|TB|TiB|MB|MiB)?\s*", str(text))
    if not m:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. '80GB' (10^9 "
                         f"bytes) or '80GiB' (2^30 bytes)")
    unit = {"GB": GB, "GiB": GiB, "TB": 10**12, "TiB": 2**40, "MB": 10**6,
            "MiB": 2**20, None: GB}[m.group(2)]
    return check_positive("memory", int(float(m.group(1)) * unit))


def format_bytes(n: float, unit: str = "GB") -> str:
    return f"{n / {'GB': GB, 'GiB': GiB}[unit]:,.2f} {unit}"


# ----------------------------------------------------------------------------- command line


def table(psi, world: int, precision: str, optimizer: str, unit: str = "GB") -> list[str]:
    head = f"{'stage':<18}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
    lines = [head, "-" * len(head)]
    names = ["0 (DDP)", "1 (Pos)", "2 (Pos+g)", "3 (Pos+g+p)"]
    div = {"GB": GB, "GiB": GiB}[unit]
    for stage in STAGES:
        b = model_states(psi, world, stage, precision, optimizer)
        lines.append(f"{names[stage]:<18}" + "".join(
            f"{x / div:>12,.2f}" for x in (b.params, b.grads, b.optimizer, b.total)))
    return lines


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardlab memory",
                                description="Per-rank memory of every ZeRO stage, and what fits.")
    p.add_argument("--model", required=True, choices=list(MODELS))
    p.add_argument("--gpus", type=int, required=True, help="N, the data-parallel ranks")
    p.add_argument("--gpu-memory", default="80GB", help="per GPU, e.g. 80GB or 80GiB")
    p.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    p.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    args = p.parse_args(None if argv is None else list(argv))
    try:
        memory = parse_bytes(args.gpu_memory)
        check_world(args.gpus)
        cfg = get_model(args.model)
        rows = plan(cfg, memory, args.gpus, args.batch, args.seq, args.precision, args.optimizer)
    except ValueError as exc:
        p.error(str(exc))
    psi = cfg.num_params()
    per = bytes_per_param(args.precision, args.optimizer)
    print(f"{cfg.name}: psi = {psi:,} parameters; {args.precision} {args.optimizer}: "
          f"{per.params:g} + {per.grads:g} + K={per.optimizer:g} bytes per parameter; "
          f"N = {args.gpus}")
    print("\nModel states per rank (GB = 10^9 bytes):")
    print("\n".join(table(psi, args.gpus, args.precision, args.optimizer)))
    print(f"\nWhat fits in {format_bytes(memory)} ({format_bytes(memory, 'GiB')}) per GPU, "
          f"micro-batch {args.batch} x {args.seq} tokens (activations: Korthikanti et al.):")
    print(f"{'stage':<7}{'checkpointing':<15}{'offload':<9}{'states':>11}{'activ.':>11}"
          f"{'gathered':>11}{'total':>11}  fits")
    for r in rows:
        print(f"{r.stage:<7}{r.checkpointing:<15}{'cpu' if r.offload else '-':<9}"
              f"{r.states.total / GB:>11,.1f}{r.activations / GB:>11,.1f}"
              f"{r.gathered / GB:>11,.2f}{r.total / GB:>11,.1f}  {'yes' if r.fits else 'no'}")
    print(f"\nLargest model whose states alone fit ({args.gpus} GPUs, {format_bytes(memory)}):")
    for stage in STAGES:
        print(f"  stage {stage}: {largest_model(memory, args.gpus, stage, args.precision, args.optimizer) / 1e9:,.1f}B parameters")
    return 0
