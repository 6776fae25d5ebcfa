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

Activations are counted per architecture, not with one coefficient: GPT-3's layer (GELU
MLP, dropout, attention scores stored) keeps s·b·h·(34 + 5·a·s/h) bytes (Korthikanti et
al., 2022); a Llama layer (SwiGLU MLP, no dropout, grouped-query attention) keeps other
terms, and an attention kernel of the FlashAttention kind (PyTorch's SDPA) keeps no
s×s scores at all. `layer_activations` names every term.

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
# "sdpa": a fused kernel (FlashAttention, torch's scaled_dot_product_attention) that keeps
# its inputs, its output and one log-sum-exp per row, never the s x s scores: today's
# baseline. "eager": the scores are materialized and kept, as in GPT-3's count.
ATTENTION = ("sdpa", "eager")
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
    """The shape of a decoder-only transformer, enough to count its parameters and the
    activations a layer keeps.

    style "gpt2": learned positions, LayerNorm (weight and bias), biases everywhere,
    a GELU MLP of two matrices, dropout after attention and after the MLP (GPT-2 and
    GPT-3 train with it). style "llama": rotary positions (no parameters), RMSNorm
    (weight only), no biases, a SwiGLU MLP of three matrices, grouped-query attention, no
    dropout. `experts` > 1 makes every MLP a mixture of that many SwiGLU experts, each
    token sent to `top_k` of them by a linear router (Mixtral's layer).
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
    experts: int = 1  # MLP experts per layer (1: a dense MLP)
    top_k: int = 1  # experts each token is routed to

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def mlp(self) -> str:
        return "gelu" if self.style == "gpt2" else "swiglu"

    @property
    def dropout(self) -> bool:
        return self.style == "gpt2"

    def expert_params(self) -> int:
        """Parameters of one MLP expert (of the dense MLP when experts == 1)."""
        h, f = self.hidden, self.ffn
        return h * f + f + f * h + h if self.mlp == "gelu" else 3 * h * f

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        router = h * self.experts if self.experts > 1 else 0
        mlp = self.experts * self.expert_params() + router
        if self.style == "gpt2":
            attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h  # qkv and output
            norms = 2 * 2 * h
        else:
            attention = h * (h + 2 * kv) + h * h
            norms = 2 * h
        return attention + mlp + norms

    def root_params(self) -> int:
        """Everything outside the layers: embeddings, final norm, untied head (the root
        unit of ZeRO-3 / FSDP when each layer is a unit of its own)."""
        return self.num_params() - self.layers * self.layer_params()

    def num_params(self) -> int:
        h = self.hidden
        embedding = self.vocab * h + self.positions * h
        head = 0 if self.tied else self.vocab * h
        final_norm = 2 * h if self.style == "gpt2" else h
        return embedding + self.layers * self.layer_params() + final_norm + head


def _gpt2(name, layers, hidden, heads):
    return ModelConfig(name, "gpt2", layers, hidden, heads, heads, 4 * hidden, 50257,
                       tied=True, positions=1024)


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, experts=1, top_k=1):
    return ModelConfig(name, "llama", layers, hidden, heads, kv_heads, ffn, vocab, tied=False,
                       experts=experts, top_k=top_k)


# Configurations as published with the models (Hugging Face config.json files).
MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _gpt2("gpt2-small", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    # GPT-3 175B (Brown et al., 2020, table 2.1): the layer Korthikanti et al. count
    ModelConfig("gpt3-175b", "gpt2", 96, 12288, 96, 96, 4 * 12288, 50257, tied=True,
                positions=2048),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2),
]}


def get_model(name: str) -> ModelConfig:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; use one of {list(MODELS)}")
    return MODELS[name]


def num_params(model: str | ModelConfig) -> int:
    """Ψ of a model preset, counted from its architecture."""
    return (get_model(model) if isinstance(model, str) else model).num_params()


# ----------------------------------------------------------------------------- activations


def _config(model: str | ModelConfig) -> ModelConfig:
    return get_model(model) if isinstance(model, str) else model


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; use one of {list(choices)}")
    return value


def layer_activations(model: str | ModelConfig, batch: int, seq: int,
                      attention: str = "sdpa") -> dict[str, int]:
    """Bytes one transformer layer keeps for its backward, term by term.

    Activations are 16-bit (2 bytes), dropout masks 1 byte (CUDA's; a CPU keeps them in
    the activation's dtype). s = seq, b = batch (micro-batch per rank), h = hidden,
    f = ffn, a = heads, kv = key/value width (h for multi-head attention, less with GQA):

    norms      each norm keeps its input                         2 x 2sbh
    attention  input of the q/k/v projections 2sbh, q 2sbh, k and v 2·2sb·kv,
               output (the input of the output projection) 2sbh; a fused kernel
               ("sdpa") also keeps a fp32 log-sum-exp per head and row, 4asb
    scores     "eager" only: the softmax output 2as²b, and with dropout its mask as²b
               and its output 2as²b (Korthikanti's 5as²b)
    mlp        GELU: input 2sbh, GELU input 2sbf, GELU output 2sbf;
               SwiGLU: input 2sbh, gate 2sbf, up 2sbf, silu(gate) 2sbf, product 2sbf;
               a mixture of experts: the router's input 2sbh and, for each of the top_k
               experts a token visits, its copy of the token 2sbh and 8sbf
    dropout    a mask after attention and one after the MLP, sbh each (GPT only)

    For GPT-3's layer (f = 4h, kv = h, dropout, "eager") the terms add up to
    sbh(34 + 5as/h), Korthikanti et al.'s count.
    """
    cfg = _config(model)
    b = check_positive("batch", batch, integer=True)
    s = check_positive("seq", seq, integer=True)
    check_choice("attention", attention, ATTENTION)
    h, f, a, kv = cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_dim
    sbh, sbf = s * b * h, s * b * f
    attn = 2 * sbh + 2 * sbh + 2 * 2 * s * b * kv + 2 * sbh
    if attention == "sdpa":
        attn += 4 * a * s * b
    scores = 0
    if attention == "eager":
        scores = 2 * a * s * s * b + (3 * a * s * s * b if cfg.dropout else 0)
    if cfg.experts > 1:
        mlp = 2 * sbh + cfg.top_k * (2 * sbh + 8 * sbf)
    elif cfg.mlp == "gelu":
        mlp = 2 * sbh + 2 * sbf + 2 * sbf
    else:
        mlp = 2 * sbh + 8 * sbf
    return {"norms": 2 * 2 * sbh, "attention": attn, "scores": scores, "mlp": mlp,
            "dropout": 2 * sbh if cfg.dropout else 0}


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one step on one rank, in three parts.

    layers     what the L layers keep from forward to backward
    recompute  what recomputation rebuilds during backward, one layer at a time (full:
               one whole layer; selective: one layer's attention scores)
    output     the final norm's and the head's inputs (2sbh each) and the fp32
               log-probabilities that cross-entropy keeps (4sbV: the loss upcasts the
               logits)
    """

    layers: int
    recompute: int
    output: int

    @property
    def total(self) -> int:
        return self.layers + self.recompute + self.output


def activations(model: str | ModelConfig, batch: int, seq: int, checkpointing: str = "none",
                attention: str = "sdpa") -> Activations:
    """The activations of a step: every layer's (`layer_activations`), under a
    recomputation policy, plus the output layer's.

    "none" keeps everything. "selective" recomputes the attention core (drops the
    scores; with "sdpa" there are none to drop, so it equals "none": a fused kernel *is*
    selective recomputation). "full" keeps each layer's 2sbh input and rebuilds one
    layer's activations during its backward. Embeddings keep only their token ids
    (GPT's dropout after the embeddings, one sbh mask, is left out).
    """
    cfg = _config(model)
    check_choice("checkpointing", checkpointing, CHECKPOINTING)
    per_layer = layer_activations(cfg, batch, seq, attention)
    one_layer = sum(per_layer.values())
    sbh = seq * batch * cfg.hidden
    output = 2 * sbh + 2 * sbh + 4 * seq * batch * cfg.vocab
    if checkpointing == "none":
        return Activations(cfg.layers * one_layer, 0, output)
    if checkpointing == "selective":
        scores = per_layer["scores"]
        return Activations(cfg.layers * (one_layer - scores), scores, output)
    return Activations(cfg.layers * 2 * sbh, one_layer, output)


def activation_bytes(model: str | ModelConfig, batch: int, seq: int,
                     checkpointing: str = "none", attention: str = "sdpa") -> int:
    """Total activation bytes of a step on one rank: `activations(...).total`."""
    return activations(model, batch, seq, checkpointing, attention).total


# ----------------------------------------------------------------------------- transients


def gathered_unit_bytes(unit_psi, precision: str = "bf16-mixed", prefetch: bool = False) -> int:
    """ZeRO-3/FSDP all-gathers one unit (e.g. a transformer block) before using it; with
    prefetching the next unit's gather is in flight too, so two are held at once."""
    unit_psi = check_positive("unit_psi", unit_psi)
    return bytes_per_param(precision).params * unit_psi * (2 if prefetch else 1)


def gathered_bytes(model: str | ModelConfig, precision: str = "bf16-mixed",
                   prefetch: bool = True) -> int:
    """What ZeRO-3/FSDP holds gathered at its worst moment, with one unit per layer and
    the rest (embeddings, head) as the root unit: the largest unit during its backward,
    its parameters and its unsharded gradient (which exists in full until the
    reduce-scatter), and with prefetching a layer gathered beside it."""
    cfg = _config(model)
    largest = max(cfg.layer_params(), cfg.root_params())
    return (gathered_unit_bytes(largest, precision)
            + bytes_per_param(precision).grads * largest
            + (gathered_unit_bytes(cfg.layer_params(), precision) if prefetch else 0))


def bucket_bytes(bucket_numel, precision: str = "bf16-mixed", buckets: int = 1) -> int:
    """Gradient buckets (DDP's all-reduce buckets, ZeRO-2's reduce buckets) hold a copy
    of `bucket_numel` gradients each, in the gradient's dtype."""
    bucket_numel = check_positive("bucket_numel", bucket_numel)
    buckets = check_positive("buckets", buckets, integer=True)
    return bytes_per_param(precision).grads * bucket_numel * buckets


# ----------------------------------------------------------------------------- offload


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


# ----------------------------------------------------------------------------- the allocator
# What `torch.cuda.memory_allocated` and `memory_reserved` add up, by the default rules of
# PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp). The formulas count
# a tensor's elements times their size; the allocator hands out blocks and asks CUDA for
# whole segments, which it keeps (reserved) after the tensors in them are freed.

CUDA_BLOCK = 512                 # every block is a multiple of 512 bytes
CUDA_SMALL = 1 << 20             # up to 1 MiB: the small pool...
CUDA_SMALL_SEGMENT = 2 << 20     # ...carved from segments of 2 MiB
CUDA_MID = 10 << 20              # up to 10 MiB: carved from segments of 20 MiB
CUDA_MID_SEGMENT = 20 << 20
CUDA_LARGE_ROUND = 2 << 20       # larger: a segment of its own, rounded up to 2 MiB


def cuda_block_bytes(nbytes: int) -> int:
    """The block the allocator gives a tensor of `nbytes`: what `memory_allocated` counts
    for it (at least this: a large block is not split when less than 1 MiB would be left,
    and then counts whole)."""
    nbytes = check_positive("nbytes", nbytes, integer=True)
    return max(CUDA_BLOCK, -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK)


def cuda_segment_bytes(nbytes: int) -> int:
    """The segment the allocator reserves (cudaMalloc) for a tensor of `nbytes` when no
    cached free block fits it; later tensors of its pool are carved from what is left."""
    block = cuda_block_bytes(nbytes)
    if block <= CUDA_SMALL:
        return CUDA_SMALL_SEGMENT
    if block < CUDA_MID:
        return CUDA_MID_SEGMENT
    return -(-block // CUDA_LARGE_ROUND) * CUDA_LARGE_ROUND


# ----------------------------------------------------------------------------- planner


@dataclass(frozen=True)
class PlanRow:
    stage: int
    checkpointing: str
    offload: str  # one of OFFLOAD
    states: Breakdown  # model states left on the GPU, per rank
    host: Breakdown  # model states this rank keeps in host memory
    activations: int  # activation_bytes(...) of the same step
    gathered: int  # the all-gathered unit(s) of stage 3
    memory: int  # the GPU's memory, bytes

    @property
    def total(self) -> float:
        return self.states.total + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.total <= self.memory


def plan(model: str | ModelConfig, memory_bytes, world: int, batch: int = 1, seq: int = 4096,
         precision: str = "bf16-mixed", optimizer: str = "adamw", prefetch: bool = True,
         attention: str = "sdpa") -> list[PlanRow]:
    """Every stage x recomputation x offload for one model on N GPUs of `memory_bytes`.

    `batch` is the micro-batch per rank. A row's activations are exactly
    `activation_bytes(model, batch, seq, checkpointing, attention)`; stage 3 adds
    `gathered_bytes`. Offload rows exist where they make sense: "optimizer" from stage
    1, "optimizer+params" at stage 3.
    """
    cfg = _config(model)
    memory_bytes = check_positive("memory_bytes", memory_bytes)
    check_world(world)
    check_choice("attention", attention, ATTENTION)
    psi = cfg.num_params()
    rows = []
    for stage in STAGES:
        gathered = gathered_bytes(cfg, precision, prefetch) if stage == 3 else 0
        offloads = OFFLOAD[:1] if stage == 0 else OFFLOAD[:2] if stage < 3 else OFFLOAD
        for checkpointing in CHECKPOINTING:
            acts = activation_bytes(cfg, batch, seq, checkpointing, attention)
            for offload in offloads:
                on_gpu, host = offloaded_states(psi, world, stage, offload, precision,
                                                optimizer)
                rows.append(PlanRow(stage, checkpointing, offload, on_gpu, host, acts,
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
    p.add_argument("--attention", default="sdpa", choices=list(ATTENTION),
                   help="sdpa: a fused kernel that keeps no s x s scores (FlashAttention); "
                        "eager: the scores are stored")
    args = p.parse_args(None if argv is None else list(argv))
    try:
        memory = parse_bytes(args.gpu_memory)
        check_world(args.gpus)
        cfg = get_model(args.model)
        rows = plan(cfg, memory, args.gpus, args.batch, args.seq, args.precision, args.optimizer,
                    attention=args.attention)
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
          f"micro-batch {args.batch} x {args.seq} tokens, {args.attention} attention "
          f"(GB; host = model states in CPU memory):")
    print(f"{'stage':<7}{'recompute':<11}{'offload':<18}{'states':>9}{'activ.':>9}"
          f"{'gathered':>10}{'total':>9}{'host':>9}  fits")
    for r in rows:
        print(f"{r.stage:<7}{r.checkpointing:<11}{r.offload:<18}"
              f"{r.states.total / GB:>9,.1f}{r.activations / GB:>9,.1f}"
              f"{r.gathered / GB:>10,.2f}{r.total / GB:>9,.1f}{r.host.total / GB:>9,.1f}"
              f"  {'yes' if r.fits else 'no'}")
    print(f"\nLargest model whose states alone fit ({args.gpus} GPUs, {format_bytes(memory)}):")
    for stage in STAGES:
        print(f"  stage {stage}: {largest_model(memory, args.gpus, stage, args.precision, args.optimizer) / 1e9:,.1f}B parameters")
    return 0
