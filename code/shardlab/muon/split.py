"""Which parameters Muon steps: the usual split, in one rule.

Muon is an optimizer for the 2-D weights of hidden layers; everything else keeps AdamW
(torch's Muon docstring, torch/optim/_muon.py: "Other parameters, such as bias, and
embedding, should be optimized by a standard method such as AdamW"; Keller Jordan's
recipe keeps the output head on AdamW too). Norms and biases are 1-D; an embedding and
the output head are 2-D, but their rows are tokens, not a linear map between hidden
features.

The rule reads each parameter's own shape and the module that holds it, never the shape
of what a strategy steps: under ZeRO-3 a rank steps a flat 1-D shard, and a rule that
looked at the shards would hand every matrix to AdamW without a word (DeepSpeed PR #8438:
its Muon switched itself off under ZeRO-3 with `zero.Init`, where every parameter looked
1-D).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# The usual names of an output head (GPT's `lm_head`, the toy models' `head`).
OUTPUT_HEADS = ("lm_head", "head")

Rule = Callable[[nn.Module, str, torch.Tensor], bool]


def takes_muon(model: nn.Module, name: str, param: torch.Tensor) -> bool:
    """True for a weight of a hidden layer (2-D, held by neither an embedding nor the
    output head): Muon steps it. False: AdamW does."""
    if param.dim() != 2:
        return False
    module_name = name.rpartition(".")[0]
    module = model.get_submodule(module_name)
    return (not isinstance(module, nn.Embedding)
            and module_name.rpartition(".")[2] not in OUTPUT_HEADS)


def hidden_matrices(model: nn.Module, rule: Rule = takes_muon) -> dict[str, torch.Tensor]:
    """{name: parameter} of the trainable parameters `rule` gives Muon, every name of a
    tied parameter included. Refused in one line: a rule that gives Muon a parameter that
    is not 2-D (torch.optim.Muon refuses it too, without its name)."""
    chosen = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad and rule(model, name, p):
            if p.dim() != 2:
                raise ValueError(f"Muon steps 2-D matrices only; parameter {name!r} has "
                                 f"shape {tuple(p.shape)}: leave it to AdamW")
            chosen[name] = p
    return chosen
