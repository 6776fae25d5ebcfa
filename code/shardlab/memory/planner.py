"""The planner: model states, activations and transients added up for every stage,
recomputation policy and offload, and what fits; `python -m shardlab memory`.

It adds what the other parts of `shardlab.memory` compute, plus what a running step holds
beyond the model states (the all-gathered unit of ZeRO-3, gradient buckets, PyTorch DDP's
bucket copy of the gradients): a module of its
own because it is the one place that combines them, and the command line that prints it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from shardlab.memory.activations import ATTENTION, CHECKPOINTING, activation_bytes
from shardlab.memory.configs import MODELS, ModelConfig, as_config
from shardlab.memory.dim0 import dim0_states_per_rank
from shardlab.memory.states import (OFFLOAD, OPTIMIZERS, PRECISIONS, STAGES, Breakdown,
                                    bytes_per_param, check_choice, check_positive,
                                    check_world, largest_model, model_states,
                                    offloaded_states)
from shardlab.units import GB, GiB


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
    cfg = as_config(model)
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


def ddp_bucket_copy_bytes(psi, precision: str = "bf16-mixed",
                          gradient_as_bucket_view: bool = False) -> int:
    """What PyTorch's DistributedDataParallel holds beyond stage 0's model states: its
    C++ Reducer keeps flat buckets for *all* the gradients it all-reduces, and with its
    default `gradient_as_bucket_view=False` the parameters' `.grad` are a copy of their
    own, so the buckets are a second full copy of the gradients, Ψ in the gradient's
    dtype (`torch/nn/parallel/distributed.py`: True makes the `.grad` views into the
    buckets, "the saved memory size will be equal to the total gradients size"). 0 with
    True, and for the course's `ddp`, which points each `.grad` at its bucket slot. Checked
    against the bytes a run of `torch-ddp` holds, both ways (`tests/test_measure.py`)."""
    psi = check_positive("psi", psi)
    return 0 if gradient_as_bucket_view else bytes_per_param(precision).grads * psi


def fsdp2_states_by_rank(model: str | ModelConfig, world: int,
                         precision: str = "bf16-mixed", optimizer: str = "adamw",
                         optimizer_padded: bool = False) -> list[Breakdown]:
    """Each rank's model states under FSDP2's dim-0 split (`shardlab.memory.dim0`), which
    differ between ranks when N does not divide some parameter's rows (Mixtral's 8
    experts on 3 GPUs: 3, 3 and 2 experts a rank); `model_states(psi, world, 3)` is the
    even split of a padded flat buffer (ZeRO-3). `optimizer_padded=False` is PyTorch's
    `fully_shard` (Adam's states of the rows that exist), True the course's FSDP2."""
    cfg = as_config(model)
    check_world(world)
    return dim0_states_per_rank(cfg.parameter_shapes(), world, precision, optimizer,
                                optimizer_padded)


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
    buckets: int = 0  # stage 0: PyTorch DDP's bucket copy of the gradients

    @property
    def total(self) -> float:
        return self.states.total + self.activations + self.gathered + self.buckets

    @property
    def fits(self) -> bool:
        return self.total <= self.memory


def plan(model, memory_bytes, world: int, batch: int = 1, seq: int = 4096,
         precision: str = "bf16-mixed", optimizer: str = "adamw", prefetch: bool = True,
         attention: str = "sdpa", gradient_as_bucket_view: bool = False) -> list[PlanRow]:
    """Every stage x recomputation x offload for one model on N GPUs of `memory_bytes`.

    `model`: a preset's name, a ModelConfig, or the reader's own model: a Hugging Face
    config.json (its path, its dict, a `transformers` config) or a model carrying one.

    `batch` is the micro-batch per rank. A row's activations are exactly
    `activation_bytes(model, batch, seq, checkpointing, attention)`; stage 3 adds
    `gathered_bytes`; stage 0, run by PyTorch's DDP, adds its bucket copy of the
    gradients unless `gradient_as_bucket_view` (`ddp_bucket_copy_bytes`). Offload rows
    exist where they make sense: "optimizer" from stage 1, "optimizer+params" at stage 3.
    """
    cfg = as_config(model)
    memory_bytes = check_positive("memory_bytes", memory_bytes)
    check_world(world)
    check_choice("attention", attention, ATTENTION)
    psi = cfg.num_params()
    rows = []
    for stage in STAGES:
        gathered = gathered_bytes(cfg, precision, prefetch) if stage == 3 else 0
        buckets = (ddp_bucket_copy_bytes(psi, precision, gradient_as_bucket_view)
                   if stage == 0 else 0)
        offloads = OFFLOAD[:1] if stage == 0 else OFFLOAD[:2] if stage < 3 else OFFLOAD
        for checkpointing in CHECKPOINTING:
            acts = activation_bytes(cfg, batch, seq, checkpointing, attention)
            for offload in offloads:
                on_gpu, host = offloaded_states(psi, world, stage, offload, precision,
                                                optimizer)
                rows.append(PlanRow(stage, checkpointing, offload, on_gpu, host, acts,
                                    gathered, memory_bytes, buckets))
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
    return f"{n / UNITS[unit]:,.2f} {unit}"


# The units a table may be printed in: GB (10^9, the ZeRO paper's) for real models, MiB and
# KiB (what `train` reports and a device counts) for the small ones a CPU trains.
UNITS = {"GB": GB, "GiB": GiB, "MiB": 2**20, "KiB": 2**10}


def unit_for(nbytes: float) -> str:
    """The unit that prints `nbytes` (a table's largest figure) with digits that mean
    something: GB from 1 GB, MiB from 1 MiB, else KiB."""
    return "GB" if nbytes >= GB else "MiB" if nbytes >= 2**20 else "KiB"


def table(psi, world: int, precision: str, optimizer: str, unit: str = "GB") -> list[str]:
    head = f"{'stage':<18}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}"
    lines = [head, "-" * len(head)]
    names = ["0 (DDP)", "1 (Pos)", "2 (Pos+g)", "3 (Pos+g+p)"]
    div = UNITS[unit]
    for stage in STAGES:
        b = model_states(psi, world, stage, precision, optimizer)
        lines.append(f"{names[stage]:<18}" + "".join(
            f"{x / div:>12,.2f}" for x in (b.params, b.grads, b.optimizer, b.total)))
    return lines


def build_parser():
    from shardlab.arguments import Parser, key_value
    from shardlab.memory.configs import model_names
    p = Parser(prog="python -m shardlab memory",
               description="Per-rank memory of every ZeRO stage, and what fits. The same "
                           "model names as python -m shardlab train, so that a run can be "
                           "predicted, then measured.")
    p.add_argument("--model", required=True, metavar="NAME",
                   help=f"a model name ({', '.join(model_names())}) or the path of a "
                        f"Hugging Face config.json (or its folder)")
    p.add_argument("--model-config", action="append", type=key_value, default=[],
                   metavar="KEY=VALUE", help="a setting of the model's architecture, as "
                                             "train takes it, e.g. n_layer=12 (repeatable)")
    p.add_argument("--gpus", "--world", dest="gpus", type=int, required=True, metavar="N",
                   help="N, the data-parallel ranks")
    p.add_argument("--gpu-memory", default="80GB", help="per GPU, e.g. 80GB or 80GiB")
    p.add_argument("--precision", default="bf16-mixed", choices=list(PRECISIONS))
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS))
    p.add_argument("--batch", type=int, default=1, help="micro-batch per GPU")
    p.add_argument("--seq-len", "--seq", dest="seq_len", type=int, default=None,
                   metavar="TOKENS", help="tokens per row (default: the longest the model "
                                          "takes, its config's max_position_embeddings or "
                                          "n_positions)")
    p.add_argument("--attention", default="sdpa", choices=list(ATTENTION),
                   help="sdpa: a fused kernel that keeps no s x s scores (FlashAttention); "
                        "eager: the scores are stored")
    return p


def main(argv: Iterable[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(None if argv is None else list(argv))
    try:
        memory = parse_bytes(args.gpu_memory)
        check_world(args.gpus)
        cfg = as_config(args.model, dict(args.model_config) or None)
        seq = args.seq_len or cfg.longest_sequence
        if seq is None:
            raise ValueError(f"{cfg.name} says no longest sequence "
                             f"(max_position_embeddings); give --seq-len")
        rows = plan(cfg, memory, args.gpus, args.batch, seq, args.precision, args.optimizer,
                    attention=args.attention)
    except ValueError as exc:
        p.error(str(exc))
    psi = cfg.num_params()
    per = bytes_per_param(args.precision, args.optimizer)
    print(f"{cfg.name}: psi = {psi:,} parameters; {args.precision} {args.optimizer}: "
          f"{per.params:g} + {per.grads:g} + K={per.optimizer:g} bytes per parameter; "
          f"N = {args.gpus}")
    unit = unit_for(max(r.total for r in rows))
    div, said = UNITS[unit], {"GB": "GB = 10^9 bytes", "MiB": "MiB = 2^20 bytes",
                              "KiB": "KiB = 2^10 bytes"}[unit]
    print(f"\nModel states per rank ({said}):")
    print("\n".join(table(psi, args.gpus, args.precision, args.optimizer, unit)))
    whose = "--seq-len" if args.seq_len else "the longest the model takes"
    print(f"\nWhat fits in {format_bytes(memory)} ({format_bytes(memory, 'GiB')}) per GPU, "
          f"micro-batch {args.batch} x {seq:,} tokens ({whose}), {args.attention} attention "
          f"({unit}; host = model states in CPU memory):")
    print(f"{'stage':<7}{'recompute':<11}{'offload':<18}{'states':>9}{'activ.':>9}"
          f"{'gathered':>10}{'buckets':>9}{'total':>9}{'host':>9}  fits")
    for r in rows:
        print(f"{r.stage:<7}{r.checkpointing:<11}{r.offload:<18}"
              f"{r.states.total / div:>9,.1f}{r.activations / div:>9,.1f}"
              f"{r.gathered / div:>10,.2f}{r.buckets / div:>9,.1f}{r.total / div:>9,.1f}"
              f"{r.host.total / div:>9,.1f}  {'yes' if r.fits else 'no'}")
    print("(buckets: PyTorch DDP's copy of the gradients in its all-reduce buckets, "
          "gradient_as_bucket_view=False, its default)")
    print(f"\nLargest model whose states alone fit ({args.gpus} GPUs, {format_bytes(memory)}):")
    for stage in STAGES:
        print(f"  stage {stage}: {largest_model(memory, args.gpus, stage, args.precision, args.optimizer) / 1e9:,.1f}B parameters")
    return 0
