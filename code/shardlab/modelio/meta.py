"""A pretrained model into shards through the `meta` device: no rank builds it whole.

    model = build_on_meta(name, config)     shapes and dtypes, no storage, no init
    wrapped = strategy(model, ...)          a sharding strategy cuts a meta model
    materialize(wrapped.module, device)     storage for this rank's shards only
    restore_buffers(wrapped.module, ...)    buffers no checkpoint holds, rebuilt
    load_into(folder, wrapped)              each rank reads its pieces from the file

PyTorch's `fully_shard` and the course's `zero3`, `fsdp2` and `hsdp` shard a model on
meta: PyTorch's leaves its shards on meta for `to_empty`; the course's give each shard
storage as they cut it (`shardlab.strategy.storage_device`). The strategies that keep the
whole model on every rank (DDP, ZeRO-1/2) have nothing to save, so for them the order is
to_empty, restore the buffers, read the whole file, then wrap: each rank holds the whole
model, as it will while it trains, but never a random init of it.

Its trap is the third line. `to_empty` gives every tensor storage and no values, buffers
too, and a buffer that is not `persistent` is in no checkpoint: Llama's rotary `inv_freq`
is computed in `__init__` and never saved. Left empty, the model trains without an error
and a loss far off. So each rank rebuilds the buffers on the CPU by running the model's
own constructor with its parameters on `meta` (`parameters_on_meta`, what `accelerate`'s
`init_empty_weights(include_buffers=False)` does): buffers are small, and they come out
exactly as a normal build makes them, whatever module computes them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable

import torch
from torch import nn

from shardlab.cards import card
from shardlab.modelio.hf_files import check_matches, load_into, load_module
from shardlab.models import build_model
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import Precision
from shardlab.strategy import Wrapped, get_strategy

def build_on_meta(name: str, config: dict | None = None) -> nn.Module:
    """The model `name`: every parameter and buffer on the meta device (no bytes)."""
    with torch.device("meta"):
        return build_model(name, seed=0, config=config)


@contextlib.contextmanager
def parameters_on_meta():
    """Inside: every parameter a module registers goes to the meta device; buffers are
    computed as usual. A model built here holds its buffers and nothing else."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def restore_buffers(module: nn.Module, name: str, config: dict | None = None,
                    skip: Iterable[str] = ()) -> list[str]:
    """Give every buffer of `module` the value a normal build gives it, computed on this
    rank's CPU from the model's own constructor; return the names restored. Persistent
    buffers are then overwritten by the checkpoint, as a normal build's would be.
    `skip`: names left as they are (a test hook: the test must then fail)."""
    with parameters_on_meta():
        reference = dict(build_model(name, seed=0, config=config).named_buffers())
    skip = set(skip)
    unknown = skip - set(reference)
    if unknown:
        raise ValueError(f"skip names no buffer of {name}: {sorted(unknown)}; its buffers "
                         f"are {sorted(reference)}")
    restored = []
    with torch.no_grad():
        for buffer_name, buffer in module.named_buffers():
            if buffer_name in skip:
                continue
            buffer.copy_(reference[buffer_name])  # copy_ casts to the model's precision
            restored.append(buffer_name)
    return restored


def to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)`, with every tied parameter tied again: to_empty may give
    each name its own new tensor (torch's swap of module parameters), which unties GPT-2's
    head from its embedding, silently, and leaves the head out of every file."""
    tied: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for first, *others in (names for names in tied.values() if len(names) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner) if owner else model, attr, shared)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Storage on `device` for whatever wrapping left on meta. PyTorch's `fully_shard`
    leaves its shards there, for `to_empty` (its documented way); the course's strategies
    gave their shards storage as they cut them, and leave only the buffers."""
    if any(p.is_meta for p in module.parameters()):
        module.to_empty(device=device)
        return
    for m in module.modules():
        for name, buffer in m._buffers.items():
            if buffer is not None and buffer.is_meta:
                m._buffers[name] = torch.empty_like(buffer, device=device)


def wrap_on_meta(name: str, config: dict | None, strategy: str, precision: Precision,
                 optimizer: OptimizerSpec, options: dict, device: torch.device,
                 folder: str, skip_buffers: Iterable[str] = (),
                 before_wrap: Callable[[nn.Module], None] | None = None) -> Wrapped:
    """Build `name` on meta, give it storage on `device` (only the shards, for a strategy
    whose card says `shards_on_meta`), restore its buffers, and read its weights from the
    Hugging Face `folder`, each rank its own pieces. `before_wrap`: what the loop does to
    a model before wrapping it (recomputation's hooks). `skip_buffers`: see
    `restore_buffers`."""
    model = build_on_meta(name, config)
    check_matches(folder, model)  # names and shapes, before a byte is allocated
    if before_wrap is not None:
        before_wrap(model)
    wrap = get_strategy(strategy)
    if card(strategy).shards_on_meta:
        wrapped = wrap(model, precision, optimizer, dict(options))
        materialize(wrapped.module, device)  # only this rank's shards get storage
        restore_buffers(wrapped.module, name, config, skip_buffers)
        load_into(folder, wrapped)
        return wrapped
    to_empty_keeping_ties(model, device)
    restore_buffers(model, name, config, skip_buffers)
    load_module(folder, model)
    return wrap(model, precision, optimizer, dict(options))
