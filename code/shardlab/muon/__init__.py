"""Muon on sharded parameters: an optimizer that needs the whole matrix.

Every stage of ZeRO and FSDP assumes an element-wise optimizer (AdamW's update of an
element needs that element's gradient and states only), so a rank can step its shard
alone. Muon cannot: it orthogonalizes each 2-D update as a whole. The parts:

    newton_schulz.py  the orthogonalization (torch's, written out), its learning-rate
                      adjustment and FLOPs, and `watching()`, which counts its calls
    split.py          which parameters Muon takes (hidden 2-D weights) and AdamW the rest
    places.py         where each parameter's elements are, on every rank (`Place`), and
                      who orthogonalizes each matrix (`owners_by_size`, `sole_holders`)
    designs.py        the three designs: gather, owner, whole-matrix shards
    optimizer.py      `MuonWithAdamW` (torch's pair, the single-process truth) and
                      `ShardedMuon` (the same arithmetic over a strategy's places)

A strategy says which designs it can honour on its card (`muon_designs`), and hands the
optimizer its places; the optimizer spec (`shardlab.optimizers`, "muon:owner") does the
rest.
"""

from shardlab.muon.newton_schulz import (MuonWatch, adjusted_lr, newton_schulz,
                                         newton_schulz_flops, watching)
from shardlab.muon.optimizer import (ADAMW_DEFAULTS, DESIGNS, MUON_DEFAULTS, MuonWithAdamW,
                                     ShardedMuon)
from shardlab.muon.places import Place, dim0_ranges, owners_by_size, sole_holders
from shardlab.muon.split import OUTPUT_HEADS, hidden_matrices, takes_muon

__all__ = ["newton_schulz", "adjusted_lr", "newton_schulz_flops", "watching", "MuonWatch",
           "MuonWithAdamW", "ShardedMuon", "DESIGNS", "MUON_DEFAULTS", "ADAMW_DEFAULTS",
           "Place", "dim0_ranges", "owners_by_size", "sole_holders", "takes_muon",
           "hidden_matrices", "OUTPUT_HEADS"]
