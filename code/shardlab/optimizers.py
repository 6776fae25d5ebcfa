"""What a strategy optimizes with: the optimizer's spec (class, arguments, the clip norm)
and its build over whatever a strategy decides to step (parameters, shards, or fp32
master copies).

A strategy receives an `OptimizerSpec`, not an optimizer: an optimizer built before the
model is wrapped would hold the parameters the strategy replaces. Clipping lives in the
spec because it belongs to the step (`shardlab.clip`).

An element-wise optimizer (AdamW, SGD) can step any cut of the parameters. Muon
(`WholeMatrixSpec`, "muon", "muon:gather", "muon:owner", "muon:whole") needs each hidden
matrix whole: a strategy hands its build the places of every parameter's elements
(`shardlab.muon.Place`), and says on its card which of the three designs it can honour.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar

import torch

from shardlab.cards import card, names
from shardlab.clip import (GradClip, check_clip_norm, clip_before_step,
                           torch_clip_before_step)
from shardlab.muon import DESIGNS, MuonWithAdamW, Place, ShardedMuon, hidden_matrices
from shardlab.muon.split import Rule, takes_muon
from shardlab.precision import MasterWeightOptimizer, Precision


@dataclass
class OptimizerSpec:
    """Which torch.optim class to build, and with what arguments, over whatever
    parameters (or shards, or fp32 master copies) a strategy decides to optimize; and
    the global norm its gradients are clipped to before each step (None: no clipping).

    Clipping belongs to the step, not to the loop: the gradients it must scale exist only
    inside some strategies' step (ZeRO-1 reduce-scatters there), and DeepSpeed's engine
    clips in its own step (its `gradient_clipping`)."""

    cls: type[torch.optim.Optimizer]
    kwargs: dict[str, Any] = field(default_factory=dict)
    clip_norm: float | None = None
    # The mistake `shardlab.faults` shows: each rank clips by its own shard's norm.
    clip_local_norm: bool = False

    def build(self, params, places: Callable[[], list[Place]] | None = None,
              group=None) -> torch.optim.Optimizer:
        """The optimizer over `params`. `places` (where each parameter's elements lie
        among `params`, on the ranks of `group`) is for an optimizer that needs whole
        matrices; an element-wise one steps its cut as it is and ignores it."""
        return self.cls(params, **self.kwargs)

    def for_strategy(self, strategy: str, model: torch.nn.Module,
                     precision: Precision) -> "OptimizerSpec":
        """This spec as strategy `strategy` builds it over `model` (`get_strategy` calls
        it before wrapping): an element-wise spec as it is."""
        return self

    def check_strategy(self, strategy: str, precision: str) -> None:
        """Refuse, in one line, a strategy or precision this spec cannot run with."""

    # Why shardlab's checkpoints cannot hold this optimizer's state (None: they can).
    checkpoint_refusal: ClassVar[str | None] = None

    def clipper(self, *, sharded: bool, group=None) -> GradClip | None:
        """The clipping of this spec for gradients that are this rank's share
        (`sharded`) or all of them; None without clipping."""
        if self.clip_norm is None:
            return None
        return GradClip(self.clip_norm, sharded=sharded, group=group,
                        local=self.clip_local_norm)

    def clip_steps(self, optimizer: torch.optim.Optimizer, *, sharded: bool,
                   group=None) -> GradClip | None:
        """Clip what `optimizer` steps before each of its steps (see `shardlab.clip`).
        `group`: the ranks whose shards make up one whole gradient (HSDP's shard group:
        the replicas hold copies, which the norm must not count again)."""
        clip = self.clipper(sharded=sharded, group=group)
        return None if clip is None else clip_before_step(inner_optimizer(optimizer), clip)

    def torch_clip_steps(self, optimizer) -> GradClip | None:
        """The references' clipping: PyTorch's own `clip_grad_norm_` over what `optimizer`
        steps (DTensors under PyTorch's `fully_shard`), before each of its steps."""
        if self.clip_norm is None:
            return None
        inner = inner_optimizer(optimizer)
        params = [p for group in inner.param_groups for p in group["params"]]
        return torch_clip_before_step(inner, params, self.clip_norm)


@dataclass
class WholeMatrixSpec(OptimizerSpec):
    """Muon on the hidden matrices (`rule`, `shardlab.muon.takes_muon`), AdamW on the
    rest, in `design` ("gather", "owner", "whole"; None: the strategy's first).

    `for_strategy` binds it to a strategy and a model: the design the strategy honours,
    and the names and ids of the matrices the rule gives Muon, read from the model as it
    is before the strategy cuts it. Then `build` makes torch's own pair where the
    parameters come whole (`MuonWithAdamW`) and a `ShardedMuon` where the strategy hands
    it the places of its cut."""

    design: str | None = None
    rule: Rule = takes_muon
    strategy: str | None = None
    hidden: frozenset[str] = frozenset()
    hidden_ids: frozenset[int] = frozenset()

    checkpoint_refusal: ClassVar[str | None] = (
        "Muon's momentum is not in shardlab's checkpoint layout; train muon without "
        "save_every, resume or export_path")

    @property
    def name(self) -> str:
        return "muon" if self.design is None else f"muon:{self.design}"

    def check_strategy(self, strategy: str, precision: str) -> None:
        designs = card(strategy).muon_designs
        if not designs:
            raise ValueError(f"strategy {strategy!r} cannot step {self.name}; the "
                             f"strategies that can: {names_with_muon()}")
        if self.design is not None and self.design not in designs:
            raise ValueError(f"strategy {strategy!r} cannot honour {self.name}: it "
                             f"honours {', '.join('muon:' + d for d in designs)}")
        if precision != "fp32":
            raise ValueError(f"{self.name} runs in fp32 here (its Newton-Schulz is bf16 "
                             f"inside), got precision {precision!r}: use fp32")

    def for_strategy(self, strategy: str, model: torch.nn.Module,
                     precision: Precision) -> "WholeMatrixSpec":
        self.check_strategy(strategy, precision.name)
        hidden = hidden_matrices(model, self.rule)
        return replace(self, design=self.design or card(strategy).muon_designs[0],
                       strategy=strategy, hidden=frozenset(hidden),
                       hidden_ids=frozenset(id(p) for p in hidden.values()))

    def build(self, params, places: Callable[[], list[Place]] | None = None,
              group=None) -> torch.optim.Optimizer:
        if self.strategy is None:
            raise ValueError(f"{self.name} must know the model's hidden matrices: build "
                             f"the strategy with shardlab.strategy.get_strategy(name)")
        lr = self.kwargs["lr"]
        if places is not None:
            return ShardedMuon(places(), design=self.design, hidden=self.hidden, lr=lr,
                               group=group)
        params = [p for p in params if p.requires_grad]
        given = {id(p) for p in params}
        if not self.hidden_ids <= given:
            # the parameters are not the model's own (shards?): a Muon over them would
            # step no matrix at all, silently (DeepSpeed PR #8438)
            raise ValueError(f"strategy {self.strategy!r} hands {self.name} parameters "
                             f"that are not the model's matrices and no places: it "
                             f"must pass places= to the spec's build")
        return MuonWithAdamW([p for p in params if id(p) in self.hidden_ids],
                             [p for p in params if id(p) not in self.hidden_ids], lr=lr)

    def param_groups(self, params) -> list[dict[str, Any]]:
        """ZeRO's parameter groups: the hidden matrices apart from the rest, laid out
        whole under muon:whole (each matrix on one rank: `whole_params`)."""
        params = [p for p in params if p.requires_grad]
        matrices = [p for p in params if id(p) in self.hidden_ids]
        rest = [p for p in params if id(p) not in self.hidden_ids]
        return [g for g in ({"params": matrices, "whole_params": self.design == "whole"},
                            {"params": rest}) if g["params"]]


def names_with_muon() -> list[str]:
    return [n for n in names() if card(n).muon_designs]


OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}),
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    # Muon on the hidden matrices, AdamW on the rest: the strategy's first design, or
    # the one named
    "muon": (MuonWithAdamW, {}),
    **{f"muon:{design}": (MuonWithAdamW, {"design": design}) for design in DESIGNS},
}


def optimizer_spec(name: str, lr: float, clip_norm: float | None = None,
                   clip_local_norm: bool = False) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(OPTIMIZERS)}")
    cls, kwargs = OPTIMIZERS[name]
    if cls is MuonWithAdamW:
        return WholeMatrixSpec(cls, {"lr": lr}, check_clip_norm(clip_norm),
                               bool(clip_local_norm), design=kwargs.get("design"))
    return OptimizerSpec(cls, {"lr": lr, **kwargs}, check_clip_norm(clip_norm),
                         bool(clip_local_norm))


def build_optimizer(params, precision: Precision, spec: OptimizerSpec,
                    places: Callable[[], list[Place]] | None = None, group=None):
    """The optimizer over the trainable `params`: through fp32 master weights for
    "bf16-mixed". `places`, `group`: see `OptimizerSpec.build`."""
    params = [p for p in params if p.requires_grad]
    if precision.master_weights:
        return MasterWeightOptimizer(params, spec.cls, **spec.kwargs)
    return spec.build(params, places=places, group=group)


def inner_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch.optim optimizer that holds the state (inside ZeRO or master weights)."""
    while not isinstance(optimizer, torch.optim.Optimizer):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None:
            raise TypeError(f"{type(optimizer).__name__} holds no torch.optim optimizer "
                            f"in `.optimizer`")
        optimizer = inner
    return optimizer
