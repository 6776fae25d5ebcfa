"""One card per strategy: everything the package knows about a strategy, in one place.

A strategy is a function in a module of its own: it takes the model every rank built and
hands back the contract (`shardlab.strategy.Wrapped`). What every other reader asks of it
is written on its card, and read there:

    the registry (`strategy.get_strategy`)  where its wrap function is; whether it can wrap
                                            a model on the meta device
    the command line and the config         whether it runs on one process, takes units
                                            (`--wrap`), refuses shardlab's checkpoints,
                                            has a check to run before any rank starts,
                                            clips with its own library's norm
    the time model (`steptime`)             its schedule, the rule that lists its
                                            collectives, whether it steps Ψ/N, how the
                                            tensors its optimizer steps are laid out
                                            (`stepparts`)
    the ZeRO paper's volumes (`comm`)       its bytes sent per step, in multiples of Ψ
    the benchmarks and side-by-side tables  what it is measured against; its ZeRO stage

No module outside this one tests a strategy's name. To add a strategy, write its module
and its card below; nothing else changes (tests/test_cards.py shows it).

The cards are plain data and this module imports nothing of the package, so any layer may
read it: a function is named as "module:function", resolved on use (`strategy.resolve`),
so reading a card never imports a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Who wrote the implementation.
OURS = "ours"                          # the course's, from scratch
PYTORCH = "PyTorch's"                  # PyTorch's own, the reference ours are checked with
DEEPSPEED = "DeepSpeed's"              # DeepSpeed's ZeRO, the paper authors' own
SINGLE_PROCESS = "single-process"      # the model as it is, on one process: parity's truth

# A schedule for the time model (`steptime.exposed_seconds` holds the rules): for each kind
# of collective, the phase whose compute it may hide behind ("forward", "backward", or
# "step": none) and how it runs there:
#   produced    launched as backward produces gradients: the last one cannot hide
#   prefetched  gathered ahead of the compute that needs it: the first one cannot hide
#   waited      launched and waited for at once: nothing hides it
# A pair of places is ZeRO-3/FSDP2's all-gathers: the first half in forward, the second in
# backward. A kind of collective the schedule does not name is waited for in "step".
Schedule = dict[str, Any]

BUCKETS_IN_BACKWARD: Schedule = {"all_reduce": ("backward", "produced")}
GATHER_TWICE_WAITED: Schedule = {"all_gather": (("forward", "waited"), ("backward", "waited")),
                                 "reduce_scatter": ("backward", "produced")}

# The collectives of a step, in words, for the tables of the text.
ALL_REDUCE = "all-reduce of the gradients (2Ψ)"
SCATTER_THEN_GATHER = ("reduce-scatter of the gradients (Ψ) + all-gather of the updated "
                       "parameters (Ψ)")
GATHER_TWICE = ("all-gather of the parameters in forward (Ψ) and in backward (Ψ) "
                "+ reduce-scatter of the gradients (Ψ)")
# Every rank holds every matrix whole (data parallelism): Muon needs nothing gathered.
WHOLE_ON_EVERY_RANK = ("whole",)

HYBRID = ("inside the shard group of S ranks, " + GATHER_TWICE + " over S; across the N/S "
          "replicas, all-reduce of each gradient shard (Ψ/S)")
ZEROPP = ("all-gather of the weights in int8 in forward, over all ranks (qwZ); in backward, "
          "inside the node (hpZ); gradients in int4 by an all-to-all inside the node, then "
          "one across nodes (qgZ)")

DEEPSPEED_CHECKPOINTS = ("DeepSpeed writes its own checkpoints: call "
                         "wrapped.model.save_checkpoint(folder) and load_checkpoint(folder) "
                         "(wrapped.model is the DeepSpeedEngine); shardlab.checkpoint saves "
                         "the course's strategies and PyTorch's")


@dataclass(frozen=True)
class StrategyCard:
    """What a strategy is, for every reader. Defaults are those of a strategy that keeps
    the whole model on every rank and has no time model."""

    name: str
    wrap: str                           # "module:function" that wraps a model (`Wrapped`)
    family: str                         # OURS, PYTORCH, DEEPSPEED or SINGLE_PROCESS
    # What it is measured against: PyTorch's implementation of the same idea
    # (benchmarks/bench_strategies.py's ratio), and DeepSpeed's (`--against deepspeed`).
    reference: str | None = None
    deepspeed_reference: str | None = None
    # The ZeRO stage whose state it shards (1 optimizer states, 2 and gradients, 3 and
    # parameters), for the tables that set each stage's implementations side by side.
    zero_stage: int | None = None
    # Takes units of sharding: the option `wrap` (a wrap policy, `shardlab.wrap`), which
    # `--wrap` sets from the command line.
    takes_units: bool = False
    # Can wrap a model on the meta device: cuts it into shards and gives storage to this
    # rank's alone (a checkpoint is read into them after, `shardlab.modelio.wrap_on_meta`).
    shards_on_meta: bool = False
    # Why `shardlab.checkpoint` cannot save or load it (None: it can), said before a run
    # that asks to save starts.
    checkpoint_refusal: str | None = None
    # "module:function" called as f(name, options, world) in the launching process, to
    # refuse options it can judge without its ranks (None: none).
    launch_check: str | None = None
    # Clips gradients with its own library's global norm (`clip_local_norm`, the
    # rehearsed mistake of clipping by each rank's own norm, is the course's alone).
    clips_by_own_library: bool = False
    # Labels its own process groups with the link they cross (intra-node, inter-node):
    # a simulation of nodes leaves its groups as they are.
    labels_own_links: bool = False
    # Bytes one rank sends per step, in multiples of Ψ(N-1)/N on rings (the ZeRO paper's
    # analysis, `comm.volume_per_rank`); None: not a single multiple.
    volume_factor: int | None = None
    collectives: str | None = None      # the collectives of a step, in words
    # The time model (`steptime.predict_step`): where each collective runs (see Schedule),
    # the rule that lists one step's collectives (`plans.PLANS`), whether the optimizer
    # steps Ψ/N parameters (sharded) rather than Ψ, and the option that, set to False (or
    # left to "auto" on gloo: `steptime.with_overlap_decided`), waits for the all-gather
    # of the updated parameters in the step instead of overlapping it with the next
    # forward. None: no time model.
    schedule: Schedule | None = None
    # Where the schedule differs on gloo (None: it does not): a collective called without
    # async_op blocks the calling thread there until it is done, where on NCCL its wait
    # only orders CUDA streams and the host runs ahead (the notes on WorkNCCL's wait in
    # torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp).
    gloo_schedule: Schedule | None = None
    plan: str | None = None
    sharded_step: bool = False
    gather_overlap_option: str | None = None
    # How the tensors its optimizer steps are laid out on a rank (`stepparts.LAYOUTS`):
    # "whole" parameters, one "flat-shard" of them all, "unit-flat-shards" (one per
    # unit), "dim0-shards" of each parameter (as "dim0-dtensors" under PyTorch's
    # fully_shard), or the whole parameters a rank owns ("owned-parameters"). AdamW pays
    # per tensor as well as per element (`stepparts`). None: no time model.
    optimizer_layout: str | None = None
    # The designs of a whole-matrix optimizer (Muon, `shardlab.muon.designs`) it can
    # honour, the default first: "gather", "owner", "whole". A strategy that keeps every
    # matrix whole on every rank honours "whole" alone, each rank orthogonalizing every
    # matrix; () refuses Muon.
    muon_designs: tuple[str, ...] = ()

    def schedule_on(self, gloo: bool) -> Schedule | None:
        """Its schedule on gloo (`gloo`) or on NCCL."""
        return self.gloo_schedule if gloo and self.gloo_schedule is not None else self.schedule

    @property
    def one_process(self) -> bool:
        """Runs on one process whatever the world size asked (the reference)."""
        return self.family == SINGLE_PROCESS


CARDS: dict[str, StrategyCard] = {c.name: c for c in [
    StrategyCard(
        "single", "shardlab.strategy:wrap_single", SINGLE_PROCESS,
        muon_designs=WHOLE_ON_EVERY_RANK,
        volume_factor=0, collectives="none", schedule={}, plan="none",
        optimizer_layout="whole"),
    StrategyCard(
        "ddp", "shardlab.ddp:wrap_ddp", OURS, reference="torch-ddp",
        muon_designs=WHOLE_ON_EVERY_RANK,
        volume_factor=2, collectives=ALL_REDUCE,
        schedule=BUCKETS_IN_BACKWARD, plan="ddp-buckets",
        optimizer_layout="whole"),
    StrategyCard(
        "ddp-naive", "shardlab.ddp:wrap_ddp_naive", OURS, reference="torch-ddp",
        muon_designs=WHOLE_ON_EVERY_RANK,
        volume_factor=2, collectives=ALL_REDUCE,
        schedule={"all_reduce": ("step", "waited")}, plan="per-parameter",
        optimizer_layout="whole"),
    StrategyCard(
        "torch-ddp", "shardlab.ddp:wrap_torch_ddp", PYTORCH, clips_by_own_library=True,
        muon_designs=WHOLE_ON_EVERY_RANK,
        volume_factor=2, collectives=ALL_REDUCE,
        schedule=BUCKETS_IN_BACKWARD, plan="ddp-buckets",
        optimizer_layout="whole"),
    StrategyCard(
        "zero1", "shardlab.zero:wrap_zero1", OURS, reference="torch-zero1",
        deepspeed_reference="deepspeed-zero1", zero_stage=1,
        volume_factor=2, collectives=SCATTER_THEN_GATHER,
        schedule={"reduce_scatter": ("step", "waited"),
                  "all_reduce": ("step", "waited"),   # gradient_collective="all-reduce"
                  "all_gather": ("forward", "prefetched")},
        plan="zero-buckets", sharded_step=True, gather_overlap_option="overlap_all_gather",
        muon_designs=("gather", "owner", "whole"),
        optimizer_layout="flat-shard"),
    StrategyCard(
        "zero2", "shardlab.zero:wrap_zero2", OURS, reference="torch-fsdp2",
        deepspeed_reference="deepspeed-zero2", zero_stage=2,
        volume_factor=2, collectives=SCATTER_THEN_GATHER,
        schedule={"reduce_scatter": ("backward", "produced"),
                  "all_reduce": ("backward", "produced"),   # gradient_collective="all-reduce"
                  "all_gather": ("forward", "prefetched")},
        plan="zero-buckets", sharded_step=True, gather_overlap_option="overlap_all_gather",
        muon_designs=("gather", "owner", "whole"),
        optimizer_layout="flat-shard"),
    StrategyCard(
        "torch-zero1", "shardlab.zero:wrap_torch_zero1", PYTORCH,
        deepspeed_reference="deepspeed-zero1", zero_stage=1, clips_by_own_library=True,
        # DDP's all-reduce, then each rank broadcasts the parameters it stepped
        volume_factor=3, collectives=ALL_REDUCE + " + broadcast of the updated parameters "
                                                  "from the rank that owns each (Ψ)",
        schedule={"all_reduce": ("backward", "produced"), "broadcast": ("step", "waited")},
        plan="ddp-buckets-then-broadcasts", sharded_step=True,
        optimizer_layout="owned-parameters"),
    StrategyCard(
        "zero3", "shardlab.zero3:wrap_zero3", OURS, reference="torch-fsdp2",
        deepspeed_reference="deepspeed-zero3", zero_stage=3, takes_units=True,
        shards_on_meta=True, volume_factor=3, collectives=GATHER_TWICE,
        schedule=GATHER_TWICE_WAITED, plan="units", sharded_step=True,
        muon_designs=("gather", "owner"),
        optimizer_layout="unit-flat-shards"),
    StrategyCard(
        "fsdp2", "shardlab.fsdp:wrap_fsdp2", OURS, reference="torch-fsdp2",
        deepspeed_reference="deepspeed-zero3", zero_stage=3, takes_units=True,
        shards_on_meta=True, launch_check="shardlab.fsdp.strategies:check_options_before_launch",
        volume_factor=3, collectives=GATHER_TWICE,
        schedule=GATHER_TWICE_WAITED, plan="units", sharded_step=True,
        muon_designs=("gather", "owner"),
        optimizer_layout="dim0-shards"),
    StrategyCard(
        "torch-fsdp2", "shardlab.fsdp:wrap_torch_fsdp2", PYTORCH,
        deepspeed_reference="deepspeed-zero3", zero_stage=3, takes_units=True,
        shards_on_meta=True, launch_check="shardlab.fsdp.strategies:check_options_before_launch",
        clips_by_own_library=True, volume_factor=3,
        collectives=GATHER_TWICE,
        # its backward prefetches the next unit's all-gather (FSDP2's default)
        schedule={"all_gather": (("forward", "waited"), ("backward", "prefetched")),
                  "reduce_scatter": ("backward", "produced")},
        # FSDP2 calls its all-gathers (`unshard_async_op`, False by default) and its
        # reduce-scatters with async_op=False (`foreach_all_gather`, `foreach_reduce` in
        # torch/distributed/fsdp/_fully_shard/): on gloo each call returns when its
        # collective is done, prefetch included (tests/test_stepparts.py watches the calls)
        gloo_schedule={"all_gather": (("forward", "waited"), ("backward", "waited")),
                       "reduce_scatter": ("backward", "waited")},
        plan="units", sharded_step=True, muon_designs=("gather", "owner"),
        optimizer_layout="dim0-dtensors"),
    StrategyCard(
        "hsdp", "shardlab.hsdp:wrap_hsdp", OURS, reference="torch-hsdp", takes_units=True,
        shards_on_meta=True, launch_check="shardlab.hsdp:check_options_before_launch",
        labels_own_links=True, collectives=HYBRID),
    StrategyCard(
        "torch-hsdp", "shardlab.hsdp:wrap_torch_hsdp", PYTORCH, takes_units=True,
        launch_check="shardlab.hsdp:check_options_before_launch",
        clips_by_own_library=True, labels_own_links=True, collectives=HYBRID),
    StrategyCard(
        "zeropp", "shardlab.zeropp:wrap_zeropp", OURS, zero_stage=3, takes_units=True,
        launch_check="shardlab.zeropp.strategy:check_options_before_launch",
        labels_own_links=True, collectives=ZEROPP),
    StrategyCard(
        "deepspeed-zero1", "shardlab.deepspeed_ref:wrap_deepspeed_zero1", DEEPSPEED,
        zero_stage=1, checkpoint_refusal=DEEPSPEED_CHECKPOINTS, clips_by_own_library=True),
    StrategyCard(
        "deepspeed-zero2", "shardlab.deepspeed_ref:wrap_deepspeed_zero2", DEEPSPEED,
        zero_stage=2, checkpoint_refusal=DEEPSPEED_CHECKPOINTS, clips_by_own_library=True),
    StrategyCard(
        "deepspeed-zero3", "shardlab.deepspeed_ref:wrap_deepspeed_zero3", DEEPSPEED,
        zero_stage=3, checkpoint_refusal=DEEPSPEED_CHECKPOINTS, clips_by_own_library=True),
]}


def card(name: str) -> StrategyCard:
    """The card of strategy `name`, or a one-line refusal naming the strategies."""
    if name not in CARDS:
        raise ValueError(f"unknown strategy {name!r}; use one of {sorted(CARDS)}")
    return CARDS[name]


def names(**fields: Any) -> list[str]:
    """The strategies whose cards have these values, in the registry's order:
    `names(takes_units=True)`, `names(family=OURS)`."""
    return [c.name for c in CARDS.values()
            if all(getattr(c, key) == value for key, value in fields.items())]


def required_options(name: str, world: int) -> dict[str, int]:
    """The options strategy `name` cannot run without on `world` ranks of one machine,
    at their smallest sensible value: hybrid sharding's shard group and ZeRO++'s node,
    each of 2 ranks (1 on an odd world). Every other strategy runs on its defaults. What
    runs every strategy in turn (the GPU check, the tests) asks here."""
    needs = {HYBRID: "shard_group", ZEROPP: "node_size"}.get(card(name).collectives)
    return {needs: 2 if world % 2 == 0 else 1} if needs else {}
