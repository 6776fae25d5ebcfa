"""The contract between a strategy and everything that reads it.

A *strategy* is a function that takes the model every rank built identically and hands
back a `Wrapped`, so the loop stays the ordinary PyTorch one for all of them:

    wrapped = get_strategy("zero3")(model, precision, optimizer_spec, options)
    loss = loss_fn(wrapped.model(x), y); loss.backward()
    wrapped.optimizer.step(); wrapped.optimizer.zero_grad()

Three kinds of readers use what a strategy hands back, and each reads only the declared
fields of `Wrapped`, never a strategy's private names:

* the loop (`shardlab.train`): `model`, `optimizer`, `no_sync`;
* `shardlab.measure`: `holders()`, the objects whose tensors are this rank's model state;
* `shardlab.checkpoint`: `pieces()`, which says which piece of every parameter (and of
  its optimizer state) this rank holds, and `after_load()`.

A strategy that cannot say how its state is laid out leaves `pieces` unset, and a
checkpoint then refuses to save or load it instead of guessing.

This module sits below the strategies and above the ground (`precision`, `models`): the
strategies import it, and it imports none of them (their cards, `shardlab.cards`, name
their wrap functions as strings).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import weakref
from dataclasses import KW_ONLY, dataclass
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardlab.cards import card, names
from shardlab.clip import GradClip
from shardlab.launch.devices import rank_device
from shardlab.measure import local_tensor
from shardlab.optimizers import OptimizerSpec, build_optimizer, inner_optimizer
from shardlab.precision import Precision
from shardlab.vocabulary import did_you_mean

# ----------------------------------------------------------------------------- the layout


@dataclass
class Piece:
    """This rank's piece of one parameter, in the coordinates of the flattened parameter.

    Every strategy of the course cuts a parameter into contiguous ranges of its flattened
    view: ZeRO-1/2 and ZeRO-3 by cutting a flat buffer, FSDP2 by cutting rows (rows
    [r*R, (r+1)*R) are the range [r*R*cols, (r+1)*R*cols)), data parallelism not at all
    (every rank holds [0, numel)). A checkpoint needs nothing more to write any of them in
    one format and read it back into any other.

    `values` is a 1-D view of the live storage that holds this rank's elements
    [start, stop) of the parameter as the model computes with it; `master` the same range
    of the fp32 master copy when the optimizer keeps one apart ("bf16-mixed"): the
    checkpoint holds the master, and `values` is its cast. `optimizer_state()` returns
    this piece's optimizer states as 1-D views of the same range (a step counter as the
    scalar it is), or {} for a frozen parameter or a state this rank does not hold.
    """

    name: str                                  # the parameter's name (the first, if tied)
    shape: torch.Size                          # its full shape
    start: int
    stop: int
    values: torch.Tensor
    # every rank's (rank, start, stop), or None when every rank holds the whole parameter
    ranges: list[tuple[int, int, int]] | None = None
    master: torch.Tensor | None = None
    optimizer_state: Callable[[], dict[str, torch.Tensor]] = dict
    # False: another rank writes these elements. With `ranges` None, the rank holding
    # the parameter's master copy and optimizer state whole (ZeroRedundancyOptimizer):
    # this rank reads back the values alone. With `ranges`, an equal replica's rank
    # (HSDP): this rank reads back its piece whole, values and optimizer state.
    writer: bool = True
    aliases: tuple[str, ...] = ()              # its other names (a tied weight)

    @property
    def numel(self) -> int:
        return self.shape.numel()


def owned_ranges(lo: int, hi: int, boundary: Callable[[int], int],
                 world: int) -> list[tuple[int, int, int]]:
    """Every rank's (rank, start, stop) of the parameter that occupies [lo, hi) of a
    buffer of which rank r owns [boundary(r), boundary(r + 1)); start and stop count
    from lo, the parameter's first element. Ranks that own none of it are left out."""
    out = []
    for r in range(world):
        a, b = max(lo, boundary(r)), min(hi, boundary(r + 1))
        if b > a:
            out.append((r, a - lo, b - lo))
    return out


def state_of(optimizer: torch.optim.Optimizer, param: torch.Tensor,
             window: slice) -> Callable[[], dict[str, torch.Tensor]]:
    """`Piece.optimizer_state` for a piece that is `window` of the flattened tensor that
    `optimizer` steps as `param` (a shard, a master copy, the parameter itself)."""

    def read() -> dict[str, torch.Tensor]:
        out = {}
        numel = local_tensor(param).numel()
        for key, value in optimizer.state.get(param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            value = local_tensor(value)
            if value.dim() > 0 and value.numel() == numel:
                out[key] = value.detach().reshape(-1)[window]
            else:  # Adam's step counter: one number, the same for every piece
                out[key] = value
        return out

    return read


def tied_names(module: nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> all its names in `module`, the first one first."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return names


def replicated_pieces(module: nn.Module, optimizer) -> list[Piece]:
    """The pieces of a strategy that keeps every parameter whole on every rank.

    Checked, not assumed: a module whose parameters are shards (PyTorch's DTensors, or the
    dim-0 chunks of the course's `fully_shard`) would be written as if each rank's chunk
    were the whole parameter, and a resume would load wrong weights without a word."""
    named = list(module.named_parameters())
    dtensors = [name for name, p in named if isinstance(p, DTensor)]
    if dtensors:
        raise ValueError(f"parameters {dtensors[:3]} are DTensors (PyTorch's fully_shard): "
                         f"not whole on every rank. Declare the layout with "
                         f"pieces=lambda: shardlab.fsdp.dtensor_pieces(model, optimizer)")
    check_same_on_all_ranks(named, what="a model checkpointed as whole on every rank", fix=(
        "its parameters are shards, not copies: declare the layout of the strategy that "
        "sharded it (shardlab.strategy.get_strategy(name) declares it; for the course's "
        "fully_shard, pieces=lambda: shardlab.fsdp.model_state(model).pieces(optimizer))"))
    masters = {id(p): m for p, m in getattr(optimizer, "pairs", [])}
    inner = inner_optimizer(optimizer)
    names = tied_names(module)
    out = []
    for name, p in module.named_parameters():
        master = masters.get(id(p))
        stepped = master if master is not None else p
        out.append(Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                         master=None if master is None else master.detach().reshape(-1),
                         optimizer_state=state_of(inner, stepped, slice(None))
                         if p.requires_grad else dict,
                         aliases=tuple(names[id(p)][1:])))
    return out


# ----------------------------------------------------------------------------- the contract


@dataclass
class Wrapped:
    """What a strategy hands back: the loop's objects, and the declarations its readers
    need (see the module's docstring). Every field but `model` and `optimizer` has a
    default that is right for a plain, unsharded model."""

    model: nn.Module          # what the loop calls: the model, or a wrapper around it
    optimizer: Any            # has step() and zero_grad()
    _: KW_ONLY                # the declarations are named, never positional
    # Gradient accumulation: micro-batches before the last run under no_sync().
    no_sync: Callable[[], ContextManager] = contextlib.nullcontext
    # The backward of a loss. Autograd's own for every strategy of the course and of
    # PyTorch; DeepSpeed's engine runs its own around it (it reduces and partitions the
    # gradients), and says so here.
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    # The full (unsharded) parameters by their original names, on every rank: parity
    # tests compare these with the single-process reference.
    full_parameters: Callable[[], dict[str, torch.Tensor]] | None = None
    # The checkpoint layout: this rank's pieces of every parameter. None: the strategy
    # cannot say, and `shardlab.checkpoint` refuses it (with `checkpoint_refusal`).
    pieces: Callable[[], list[Piece]] | None = None
    # What to do once a checkpoint wrote this rank's pieces (ZeRO-1/2 all-gather the
    # parameters every rank needs whole).
    after_load: Callable[[], None] = lambda: None
    # Wait for the collectives a step leaves in flight (ZeRO-1/2's overlapped all-gathers,
    # waited for in the next forward): the loop calls it before its profiler stops, since
    # a collective that completes after the profiler has stopped ends a record of it.
    settle: Callable[[], None] = lambda: None
    # Objects besides model and optimizer whose `state_tensors()` are model state this
    # rank holds (a sharded model's unreduced gradients under no_sync).
    extra_state: tuple[Any, ...] = ()
    # The user's module inside any wrapper (DistributedDataParallel's `.module`): where
    # the parameters' names and the buffers are read.
    module: nn.Module | None = None
    # The clipping of the gradients before each step (`OptimizerSpec.clip_norm`): its
    # `norms` are each step's global norm before clipping. None: no clipping.
    clip: GradClip | None = None
    checkpoint_refusal: str = (
        "this Wrapped declares no checkpoint layout (`pieces`): build it with "
        "shardlab.strategy.get_strategy(name), or pass pieces=lambda: ... with "
        "replicated_pieces(model, optimizer) for a model every rank holds whole, "
        "shardlab.fsdp.model_state(model).pieces(optimizer) for one sharded by the course's "
        "fully_shard, shardlab.fsdp.dtensor_pieces(model, optimizer) for PyTorch's")

    def __post_init__(self):
        if self.module is None:
            self.module = self.model

    def holders(self) -> tuple[Any, ...]:
        """What `shardlab.measure.state_bytes` and `track_peak` should count."""
        return (self.model, self.optimizer, *self.extra_state)


def replicated(model: nn.Module, optimizer, *, module: nn.Module | None = None,
               **fields: Any) -> Wrapped:
    """A `Wrapped` for a strategy that keeps the whole model on every rank."""
    module = model if module is None else module
    return Wrapped(model, optimizer, module=module,
                   pieces=lambda: replicated_pieces(module, optimizer),
                   full_parameters=lambda: named_full_parameters(module), **fields)


# ----------------------------------------------------------------------------- helpers
# shared by every strategy module: the same casting and option checks for all


def check_options(strategy: str, options: dict, accepted: dict[str, Any]) -> dict[str, Any]:
    """`accepted` maps each option a strategy takes to its default; return the merged
    options, or raise naming the accepted ones."""
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"strategy {strategy!r} got unknown option(s) {unknown}"
                         f"{did_you_mean(unknown[0], accepted)}; it accepts "
                         f"{sorted(accepted) if accepted else 'no options'}")
    return {**accepted, **options}


def storage_device(t: torch.Tensor) -> torch.device:
    """Where a sharded copy of `t` is kept: `t`'s own device, or, for a tensor on `meta`
    (a model built without storage, sharded before its values are read from a file),
    this rank's device."""
    return rank_device() if t.is_meta else t.device


def check_same_on_all_ranks(named: list[tuple[str, torch.Tensor]], group=None,
                            what: str = "the model", fix: str | None = None) -> None:
    """Refuse, on every rank together, tensors that differ across ranks.

    A model built differently on each rank and then sharded would silently train a
    patchwork of N models (each rank keeps its own piece only), and a model declared
    replicated whose parameters are shards would be checkpointed as wrong whole tensors.
    The ranks compare a signature instead of the tensors: the count, every shape, and
    the sum and sum of squares of every tensor, by an all-reduce of MAX and one of MIN
    (first of the signature's length, so that ranks with different models never meet in
    collectives of different sizes)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    device = rank_device()

    def sums(t: torch.Tensor) -> list[float]:
        # A tensor on meta has no values: they come later, from one file that every
        # rank reads alike (`shardlab.modelio`). Its count and shape still take part.
        if t.is_meta:
            return [0.0, 0.0]
        t = t.detach().double()
        return [t.sum().item(), t.square().sum().item()]

    with torch.no_grad():
        rows = [[float(t.dim()), *map(float, t.shape), *sums(t)] for _, t in named]
    signature = torch.tensor([float(len(named))] + [x for row in rows for x in row],
                             dtype=torch.float64, device=device)

    def agree(t: torch.Tensor) -> torch.Tensor:
        hi, lo = t.clone(), t.clone()
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        return (hi - lo).abs() <= 1e-9 * (1 + hi.abs())

    length = torch.tensor([float(signature.numel())], dtype=torch.float64, device=device)
    bad: list[str] = []
    if not bool(agree(length).all()):
        bad = ["(their number or shapes)"]
    else:
        same = agree(signature)
        if not bool(same.all()):
            starts = [1]
            for row in rows:
                starts.append(starts[-1] + len(row))
            bad = [name for (name, _), a, z in zip(named, starts, starts[1:])
                   if not bool(same[a:z].all())]
    if bad:
        raise ValueError(f"{what} differs across ranks (parameters {bad[:5]}"
                         f"{' ...' if len(bad) > 5 else ''}): " + (fix or (
                             "build it identically on every rank (the same seed, e.g. "
                             "shardlab.models.build_model(name, seed)) before sharding it, "
                             "or broadcast rank 0's copy")))


def grad_ready_hook(method: Callable[..., None], *args: int) -> Callable[[nn.Parameter], None]:
    """A hook for `register_post_accumulate_grad_hook` that calls the bound `method` with
    `args` (plain indices) and the parameter, holding `method`'s object weakly.

    A hook that held the strategy (which holds the model, which holds the parameter) made
    a cycle through the parameter's hook that Python's garbage collector did not free:
    each run of DDP or ZeRO-2 left its model, its buffers and its strategy behind, and on
    a GPU every later run's `max_memory_allocated` counted their bytes (in the GPU check's
    memory runs, one after another in the same ranks, ZeRO-3's peak read 3.95 GiB, and
    2.20 with nothing left). `tests/test_train.py` runs every strategy one after another
    and counts the tensors each leaves alive. A strategy that is gone makes its hooks do
    nothing."""
    ref = weakref.WeakMethod(method)

    def hook(param: nn.Parameter) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, param)
    return hook


def cast_model(model: nn.Module, precision: Precision) -> nn.Module:
    """Cast parameters and floating-point buffers to the precision's parameter dtype."""
    return model.to(precision.param_dtype)


def named_full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached CPU copies of a (replicated, unsharded) model's parameters by name."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- the registry
# Each strategy's card (`shardlab.cards`) names its wrap function as "module:function",
# resolved here on use: registering a strategy imports no strategy module, and this
# module imports none of them.


def resolve(target: str) -> Callable:
    """The function a card names as "module:function", its module imported on first use."""
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


def get_strategy(name: str) -> Callable[..., Wrapped]:
    strategy = card(name)
    wrap = resolve(strategy.wrap)

    @functools.wraps(wrap)
    def checked(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                *args, **kwargs) -> Wrapped:
        # Refused here, in one line, rather than deep inside torch at the first read of
        # a value the model does not have.
        if not strategy.shards_on_meta and any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"strategy {name!r} keeps the whole model on every rank and cannot wrap a "
                f"model on the meta device (it has no values): give it storage and "
                f"weights first, or load it with shardlab.modelio.wrap_on_meta, which "
                f"does both for {name!r}; the strategies that shard a meta model are "
                f"{sorted(names(shards_on_meta=True))}")
        # A whole-matrix optimizer learns its design and the model's hidden matrices
        # from the model as it is, before the strategy cuts it.
        optimizer = optimizer.for_strategy(name, model, precision)
        wrapped = wrap(model, precision, optimizer, *args, **kwargs)
        if optimizer.checkpoint_refusal is not None:
            wrapped.pieces, wrapped.checkpoint_refusal = None, optimizer.checkpoint_refusal
        return wrapped

    return checked


def checkpoint_refusal(name: str) -> str | None:
    """Why `shardlab.checkpoint` cannot save or load strategy `name`, or None if it can:
    a strategy that keeps its own checkpoints (DeepSpeed's engine) says why on its card,
    so a run that asks to save is refused before it trains."""
    return card(name).checkpoint_refusal


def check_before_launch(name: str, options: dict, world: int) -> None:
    """Refuse, in the launching process, options a strategy can judge without its ranks
    (HSDP's shard group against the world size): the function its card names as
    `launch_check`, called as f(name, options, world)."""
    check = card(name).launch_check
    if check is not None:
        resolve(check)(name, options, world)


def wrap_single(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                options: dict) -> Wrapped:
    """The reference: the model as it is, one process, the whole global batch."""
    check_options("single", options, {})
    model = cast_model(model, precision)
    opt = build_optimizer(model.parameters(), precision, optimizer)
    return replicated(model, opt, clip=optimizer.clip_steps(opt, sharded=False))
