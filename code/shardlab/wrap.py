"""Wrap policies: which modules of a model become units of ZeRO-3 and FSDP2.

A unit is gathered whole before it computes, so the unit is what sets the gathered peak:
one unit for the whole model gathers the whole model (which is not sharding at all, at
the peak), one unit per transformer layer gathers one layer. PyTorch offers the same
choices (`ModuleWrapPolicy`, `transformer_auto_wrap_policy`, `size_based_auto_wrap_policy`,
`lambda_auto_wrap_policy` for FSDP1; calling `fully_shard` per layer for FSDP2), and so
does this module, for both of the course's sharded strategies:

    "auto"                      the model's layers if it declares them (the course's GPT:
                                `.blocks`; a Hugging Face model: the classes it lists
                                in `_no_split_modules`); else the members of its largest
                                list of layers of one class (an `nn.ModuleList` or
                                `nn.Sequential`); else, as `size_based_auto_wrap_policy`,
                                every module of at least a tenth of the model (and
                                2^16 parameters); else, a model too small for units to
                                matter, the whole model as one unit (`auto_policy`)
    "blocks" / "model"          each of `model.blocks` / one unit
    "class:GPT2Block,Linear"    every module of one of these classes (names or classes)
    "min-params:100000"         every module holding at least this many parameters that
                                no chosen submodule holds already (bottom up)
    a class or tuple of classes every module of one of them
    a function module -> bool   every module for which it is true

Whatever a policy picks, `unit_modules` returns the units children before parents and
the model itself last: the root takes the parameters no other unit took, and runs first
and last in every step. A unit whose weight is tied to a module outside it is folded into
their common parent (`fold_tied`), so that every wrap a policy gives is one that ZeRO-3
and FSDP2 both accept.

The same units are what recomputation (activation checkpointing) works on:
`recompute_units(model)` keeps each unit's input instead of its activations and runs its
forward again in backward, with PyTorch's composable `checkpoint`, which leaves the
modules and their parameter names as they are.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

WRAP_HELP = ("use 'auto', 'blocks', 'model', 'class:Name[,Name...]', 'min-params:N', "
             "a module class (or a tuple of them), or a function module -> bool")


def layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The classes a Hugging Face model names as its layers (`_no_split_modules`: the
    modules it never splits across devices), found among its submodules."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return {type(m) for m in model.modules() if type(m).__name__ in names}


def _classes_named(model: nn.Module, names: Iterable[str]) -> tuple[type[nn.Module], ...]:
    wanted = [n.strip() for n in names if n.strip()]
    found = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in wanted if n not in found]
    if missing or not wanted:
        known = sorted(found)
        raise ValueError(f"wrap by class: no module of class {missing or wanted} in this "
                         f"{type(model).__name__}; its module classes are "
                         f"{known[:12]}{' ...' if len(known) > 12 else ''}")
    return tuple(found[n] for n in wanted)


def runs_forward(module: nn.Module) -> bool:
    """Whether calling the module is a thing: a container (`nn.ModuleList`, `nn.ModuleDict`)
    has no forward of its own, so the hooks that gather a unit before its forward and
    free it after would never run on it."""
    return type(module).forward is not nn.Module.forward


def _min_params_units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Bottom up, as `size_based_auto_wrap_policy`: a module becomes a unit when the
    parameters it holds outside the units already chosen inside it reach `min_params`.
    Containers are passed over (as PyTorch's policy excludes them): their parameters go
    to the module that calls their members."""
    chosen: list[nn.Module] = []
    claimed: set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if module is model or not runs_forward(module):
            return
        left = {id(p): p.numel() for p in module.parameters() if id(p) not in claimed}
        if sum(left.values()) >= min_params:
            chosen.append(module)
            claimed.update(left)

    visit(model)
    return chosen


def _parse(model: nn.Module, policy: str) -> Any:
    """A policy given as text (the CLI's `--wrap`, a config's options) as a policy."""
    kind, _, value = policy.partition(":")
    if kind == "class":
        return _classes_named(model, value.split(","))
    if kind == "min-params":
        try:
            count = int(float(value))
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"wrap 'min-params:N' needs a whole number N >= 1, got "
                             f"{value!r}")
        return count
    raise ValueError(f"unknown wrap policy {policy!r}; {WRAP_HELP}")


# "auto"'s size rule: a module becomes a unit from a tenth of the model's parameters, and
# never under 2^16 of them. A unit is one more all-gather in every forward and backward; one
# under 2^16 parameters would save less than 256 KiB of fp32 at the peak.
AUTO_SHARE = 10
AUTO_MIN_PARAMS = 2 ** 16


def _repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The members of the model's largest list of layers: among its `nn.ModuleList`s and
    `nn.Sequential`s (the model itself too), the one whose members that hold parameters
    are at least two of one class, and hold the most parameters."""
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        members = [m for m in module.children() if any(True for _ in m.parameters())]
        if len(members) < 2 or len({type(m) for m in members}) != 1:
            continue
        size = sum(p.numel() for m in members for p in m.parameters())
        if size > best_size:
            best, best_size = members, size
    return best


def auto_policy(model: nn.Module) -> tuple[Any, str]:
    """What "auto" means for this model, and why, in words for a report: its declared
    layers, else its largest list of layers of one class, else every module of at least a
    tenth of it (and `AUTO_MIN_PARAMS`), else (a model that small) the whole model."""
    if hasattr(model, "blocks"):
        return "blocks", "its .blocks"
    classes = layer_classes(model)
    if classes:
        return tuple(classes), "the layers its _no_split_modules names"
    layers = _repeated_layers(model)
    if layers:
        ids = {id(m) for m in layers}
        return (lambda m: id(m) in ids,
                f"its list of {len(layers)} {type(layers[0]).__name__} layers")
    psi = sum(p.numel() for p in model.parameters())
    least = max(-(-psi // AUTO_SHARE), AUTO_MIN_PARAMS)
    if _min_params_units(model, least):
        return least, f"every module of at least {least:,} parameters (min-params:{least})"
    return "model", (f"one unit: no declared layers, and no module of {AUTO_MIN_PARAMS:,} "
                     f"parameters or more")


def chosen_modules(model: nn.Module, policy: Any) -> list[nn.Module]:
    """The modules a policy picks (not yet ordered, the model possibly among them)."""
    if isinstance(policy, str) and policy == "auto":
        policy, _ = auto_policy(model)
    if policy == "blocks":
        blocks = getattr(model, "blocks", None)
        if blocks is None:
            raise ValueError(f"wrap='blocks' needs a model with `.blocks` (this "
                             f"{type(model).__name__} has none); {WRAP_HELP}")
        return list(blocks)
    if policy == "model":
        return []
    if isinstance(policy, str):
        policy = _parse(model, policy)
    if isinstance(policy, bool) or policy is None:
        raise ValueError(f"unknown wrap policy {policy!r}; {WRAP_HELP}")
    if isinstance(policy, int):
        return _min_params_units(model, policy)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = (policy,)
    if isinstance(policy, tuple) and policy and all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in policy):
        return [m for m in model.modules() if isinstance(m, policy)]
    if callable(policy):
        return [m for m in model.modules() if policy(m)]
    raise ValueError(f"unknown wrap policy {policy!r}; {WRAP_HELP}")


def _ancestors(model: nn.Module) -> dict[int, list[nn.Module]]:
    """Each module's chain from the model down to itself (by id)."""
    chains: dict[int, list[nn.Module]] = {}

    def visit(module: nn.Module, chain: list[nn.Module]) -> None:
        if id(module) in chains:
            return  # a module reached twice keeps its first place
        chains[id(module)] = chain + [module]
        for child in module.children():
            visit(child, chains[id(module)])

    visit(model, [])
    return chains


def common_parent(model: nn.Module, modules: list[nn.Module]) -> nn.Module:
    """The innermost module that contains every one of `modules`."""
    chains = _ancestors(model)
    paths = [chains[id(m)] for m in modules]
    parent = model
    for level in zip(*paths):
        if any(m is not level[0] for m in level):
            break
        parent = level[0]
    return parent


def fold_tied(model: nn.Module, picked: list[nn.Module]) -> list[nn.Module]:
    """`picked` with every unit whose parameter is tied to a module outside it folded
    into their common parent.

    A unit owns its parameters: gathered before its forward, freed after. A weight it
    shares with a module outside it (BERT's masked-LM decoder reuses the word embeddings
    that `_no_split_modules` makes a unit) would then be freed when the other module
    needs it, or sharded twice, which unties it; FSDP2 refuses it outright. So the unit
    gives way to the innermost module holding every user of the weight (a unit if it
    can be called, else its parameters go to the unit around it: the model at worst),
    and the tie lives inside one unit, for ZeRO-3 and FSDP2 alike."""
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(module)
    units = list(picked)
    while True:
        for unit in units:
            if unit is model:
                continue
            inside = {id(m) for m in unit.modules()}
            outside = [h for p in unit.parameters() for h in holders[id(p)]
                       if id(h) not in inside]
            if outside:
                break
        else:
            return units
        units.remove(unit)
        parent = common_parent(model, [unit, *outside])
        if parent is not model and runs_forward(parent) and all(parent is not u
                                                                 for u in units):
            units.append(parent)


def unit_modules(model: nn.Module, policy: Any = "auto") -> list[nn.Module]:
    """The unit modules for `policy`: children before their parents, the model last; a
    unit holding a weight tied to a module outside it is folded into their common
    parent (`fold_tied`)."""
    picked = fold_tied(model, chosen_modules(model, policy))
    containers = sorted({type(m).__name__ for m in picked
                         if m is not model and not runs_forward(m)})
    if containers:
        raise ValueError(f"wrap policy {policy!r} picks containers ({', '.join(containers)}) "
                         f"that are never called, so they cannot be gathered before a "
                         f"forward: pick the layers inside them instead (for example "
                         f"'class:' with the layers' class)")
    chosen = {id(m) for m in picked}
    ordered: list[nn.Module] = []

    def visit(module: nn.Module) -> None:  # post-order: a unit after the units inside it
        for child in module.children():
            visit(child)
        if id(module) in chosen and module is not model and module not in ordered:
            ordered.append(module)

    visit(model)
    return [*ordered, model]


def recompute_units(model: nn.Module, policy: Any = "auto") -> list[nn.Module]:
    """Recompute the activations of each unit `policy` picks (the transformer blocks by
    default; never the whole model, whose input is only token ids) in backward; return
    the units. Their names and parameters do not change."""
    from torch.distributed._composable import checkpoint

    units = [m for m in unit_modules(model, policy) if m is not model]
    if not units:
        raise ValueError(f"recompute: the wrap policy {policy!r} picks no module below the "
                         f"model itself; this model has no layers to recompute")
    for unit in units:
        checkpoint(unit)
    return units


def describe(model: nn.Module, policy: Any) -> str:
    """One line for a report: how many units, of which classes, and for "auto" which of
    its rules chose them."""
    units = unit_modules(model, policy)
    kinds: dict[str, int] = {}
    for m in units[:-1]:
        kinds[type(m).__name__] = kinds.get(type(m).__name__, 0) + 1
    inner = ", ".join(f"{n} x {c}" for c, n in kinds.items())
    line = f"{len(units)} unit{'s' if len(units) > 1 else ''}: " \
           f"{inner + ' + ' if inner else ''}the root"
    if isinstance(policy, str) and policy == "auto":
        line += f" (auto: {auto_policy(model)[1]})"
    return line


