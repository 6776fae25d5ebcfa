"""Lab 9's grader: your wrap by layer class, against PyTorch's `fully_shard` and the course's
`shardlab.wrap.unit_modules`.

    my_units(model, layer_class) -> [[names of unit 0's parameters], ..., [the root's]]

What `fully_shard(layer)` for every `layer_class` module, then `fully_shard(model)`, makes:
one unit per layer, in the model's order, and the root last with every parameter no layer
took; each parameter under the name `model.named_parameters()` gives it, once. Checked on
three models: Hugging Face's GPT-2 (its head tied to the token embedding), Llama (head not
tied) and the course's GPT (`Block`s, tied head). PyTorch's units are read off the model
itself: after each `fully_shard` call, the parameters that call turned into sharded
DTensors are that unit's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from shardlab.models import build_model
from shardlab.wrap import unit_modules
from graders import wrong
from graders.common import agree, call, grade_on_ranks, run_each, show

MODELS = (("hf-gpt2", "GPT2Block"), ("hf-llama", "LlamaDecoderLayer"), ("gpt-tiny", "Block"))
SMALL = {"hf-gpt2": {"n_layer": 3}, "hf-llama": {"num_hidden_layers": 3},
         "gpt-tiny": {"n_layer": 3}}


def layer_class_of(model, name: str) -> type:
    return next(type(m) for m in model.modules() if type(m).__name__ == name)


def pytorch_units(model, layer_class) -> list[list[str]]:
    """The parameters each `fully_shard` call shards, layers first and the root last."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded: set[str] = set()

    def newly_sharded() -> list[str]:
        names = [n for n, p in model.named_parameters()
                 if isinstance(p, DTensor) and n not in sharded]
        sharded.update(names)
        return names
    units = []
    for layer in [m for m in model.modules() if isinstance(m, layer_class)]:
        fully_shard(layer, mesh=mesh)
        units.append(newly_sharded())
    fully_shard(model, mesh=mesh)
    return [*units, newly_sharded()]


def course_units(model, layer_class) -> list[list[str]]:
    names, taken, units = {id(p): n for n, p in model.named_parameters()}, set(), []
    for unit in unit_modules(model, f"class:{layer_class.__name__}"):
        units.append([names[id(p)] for p in unit.parameters() if id(p) not in taken])
        taken |= {id(p) for p in unit.parameters()}
    return units


def normalized(units) -> list[list[str]] | None:
    """Each unit's names sorted (their order within a unit is free); None if not a list of
    lists of names."""
    try:
        return [sorted(str(n) for n in unit) for unit in units]
    except TypeError:
        return None


def first_difference(yours, theirs: list[list[str]], what: str) -> str | None:
    if yours is None:
        return "returned something that is not a list of lists of parameter names"
    if len(yours) != len(theirs):
        return (f"returned {len(yours)} unit{'s' * (len(yours) != 1)}, fully_shard made "
                f"{len(theirs)} ({len(theirs) - 1} x {what}, then the root)")
    for i, (mine, ref) in enumerate(zip(yours, theirs)):
        unit = "the root" if i == len(theirs) - 1 else f"unit {i}"
        extra, missing = sorted(set(mine) - set(ref)), sorted(set(ref) - set(mine))
        if len(mine) != len(set(mine)):
            return f"{unit} lists a name twice"
        if extra:
            return f"{unit} has {extra[0]!r}, which fully_shard's does not ({len(extra)} such)"
        if missing:
            return f"{unit} lacks {missing[0]!r} ({len(missing)} missing)"
    return None


def check_one(my_units) -> None:
    for name, class_name in MODELS:
        model = build_model(name, seed=0, config=SMALL[name])
        layer_class = layer_class_of(model, class_name)
        ours = course_units(model, layer_class)
        got = normalized(call(f"my_units({name}, {class_name})", my_units, model, layer_class))
        theirs = pytorch_units(build_model(name, seed=0, config=SMALL[name]), layer_class)
        assert normalized(ours) == normalized(theirs), "the course's units differ from PyTorch's"
        problem = first_difference(got, normalized(theirs), class_name)
        agree(problem and f"{name}: {problem}", got=got, mistakes=wrong.UNITS,
              rerun=lambda answer: normalized(answer(build_model(name, seed=0,
                                                                 config=SMALL[name]),
                                                     layer_class)))


def check(candidates: list) -> list:
    return run_each(candidates, check_one)


def grade(my_units, world: int = 2) -> SimpleNamespace:
    """Grade your function on `world` ranks and print one line."""
    [(verdict, _)] = grade_on_ranks(check, world, [my_units])
    return SimpleNamespace(passed=show("your units", verdict), verdict=verdict)
