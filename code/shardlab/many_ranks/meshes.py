"""A mesh of three dimensions: HSDP (replicas x shard group) of the course's tensor-parallel
MLP, each dimension a process group of its own, labelled, so the ledger sends its bytes
to the dimension they cross.

    R x S x T ranks, rank = (r·S + s)·T + t      tensor parallelism innermost (in a node)
        "tp"         the T ranks of one (r, s): Megatron's two all-reduces of the
                     activations per MLP and step (`shardlab.tensor_parallel`)
        "shard"      the S ranks of one (r, t): FSDP2's schedule over this rank's piece
                     of the MLP (all-gather twice, reduce-scatter once)
        "replicate"  the R ranks of one (s, t): the all-reduce of each reduced shard

What each dimension sends is the arithmetic of tensor parallelism and of HSDP on the
piece a rank holds: 2 x 2(T-1)/T of the activations over "tp"; FSDP's 3(S-1)/S of the
tensor-parallel piece over "shard"; 2(R-1)/R of its 1/S over "replicate"
(`expected_bytes`, padding included, as `shardlab.many_ranks.formulas` counts it).
`tensor_parallel_hsdp` trains it with real values on ranks that are threads
(`shardlab.many_ranks.threads`), beside the unsplit MLP on the whole batch
(`unsplit_mlp_run`): the same losses and parameters.

HSDP alone, R x S with T = 1, is the `hsdp` strategy (option `shard_group` = S).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardlab.comm.ledger import Ledger
from shardlab.comm.links import UNLABELLED, label_link, per_link
from shardlab.fsdp.strategies import FSDP2_OPTIONS, fully_shard_on
from shardlab.many_ranks.formulas import INTER, INTRA, predicted
from shardlab.models import GENERATOR_LOCK, MLP, GPTConfig
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.tensor_parallel import TensorParallelMLP, check_split, tensor_parallel_bytes

DIMENSIONS = ("replicate", "shard", "tp")
LR = 1e-3


def coordinates(rank: int, replicas: int, shard: int, tp: int) -> tuple[int, int, int]:
    """(r, s, t) of a rank: tensor parallelism varies fastest, the replica slowest."""
    if not 0 <= rank < replicas * shard * tp:
        raise ValueError(f"rank {rank} is not on a {replicas} x {shard} x {tp} mesh")
    return rank // (shard * tp), rank // tp % shard, rank % tp


def mesh_rank_lists(replicas: int, shard: int, tp: int) -> dict[str, list[list[int]]]:
    """Every group of each dimension, as lists of ranks."""
    def rank(r, s, t):
        return (r * shard + s) * tp + t
    return {
        "tp": [[rank(r, s, t) for t in range(tp)] for r in range(replicas)
               for s in range(shard)],
        "shard": [[rank(r, s, t) for s in range(shard)] for r in range(replicas)
                  for t in range(tp)],
        "replicate": [[rank(r, s, t) for r in range(replicas)] for s in range(shard)
                      for t in range(tp)],
    }


def mesh_groups(replicas: int, shard: int, tp: int) -> dict[str, dist.ProcessGroup]:
    """This rank's group along each dimension, each labelled with its dimension's name.
    Every rank creates every group, in the same order, as `dist.new_group` requires."""
    if dist.get_world_size() != replicas * shard * tp:
        raise ValueError(f"a {replicas} x {shard} x {tp} mesh needs "
                         f"{replicas * shard * tp} ranks, not {dist.get_world_size()}")
    groups = {}
    for name, lists in mesh_rank_lists(replicas, shard, tp).items():
        groups[name], _ = dist.new_subgroups_by_enumeration(lists)
        label_link(groups[name], name)
    return groups


def batch(step: int, rows: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: `rows` inputs and regression targets, from (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return (torch.randn(rows, hidden, generator=g, device="cpu"),
            torch.randn(rows, hidden, generator=g, device="cpu"))


def unsplit_mlp(hidden: int, seed: int = 0) -> MLP:
    """The course's MLP (h -> 4h -> h) with weights from `seed`."""
    # ranks that are threads share the generator: one draws at a time
    with GENERATOR_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MLP(GPTConfig(d_model=hidden))


def unsplit_mlp_run(hidden: int, rows: int, steps: int, seed: int = 0
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: the unsplit MLP, one process, the whole batch, AdamW: each step's
    loss and the parameters after the last."""
    mlp = unsplit_mlp(hidden, seed)
    optimizer = optimizer_spec("adamw", LR).build(mlp.parameters())
    losses = []
    for step in range(steps):
        x, y = batch(step, rows, hidden, seed)
        loss = F.mse_loss(mlp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in mlp.named_parameters()}


def tensor_parallel_hsdp(replicas: int, shard: int, tp: int, hidden: int, rows: int,
                         steps: int, seed: int = 0) -> dict:
    """Worker: the MLP split T ways by tensor parallelism, each piece sharded by HSDP over
    R x S (the course's `fully_shard` with a replicate group), trained `steps` steps on
    `rows` rows a step (each of the R·S data-parallel ranks its 1/(R·S), the T ranks of a
    tensor-parallel group the same rows), with the ledger on. Returns this rank's
    coordinates, the global loss of each step, its tensor-parallel piece's full
    parameters after training, and the bytes it sent by dimension."""
    rank = dist.get_rank()
    r, s, t = coordinates(rank, replicas, shard, tp)
    check_split(4 * hidden, tp)
    data_parallel = replicas * shard
    if rows % data_parallel:
        raise ValueError(f"{rows} rows do not split among {data_parallel} data-parallel "
                         f"ranks; use a multiple of {data_parallel}")
    groups = mesh_groups(replicas, shard, tp)
    piece = TensorParallelMLP(unsplit_mlp(hidden, seed), t, tp, group=groups["tp"])
    options = {**FSDP2_OPTIONS, "wrap": "model"}
    wrapped = fully_shard_on(piece, get_precision("fp32"), optimizer_spec("adamw", LR),
                             options, group=groups["shard"],
                             replicate_group=groups["replicate"] if replicas > 1 else None)
    mine = slice((r * shard + s) * rows // data_parallel,
                 (r * shard + s + 1) * rows // data_parallel)
    losses = []
    with Ledger() as ledger:
        for step in range(steps):
            x, y = batch(step, rows, hidden, seed)
            # in a network the MLP's input comes from the layers before it, whose gradient
            # needs the input's: Megatron's second all-reduce (as in `mlp_traffic`)
            loss = F.mse_loss(wrapped.model(x[mine].requires_grad_()), y[mine])
            loss.backward()
            wrapped.optimizer.step()
            wrapped.optimizer.zero_grad()
            losses.append(loss.detach())
            ledger.mark_step()
    # the global loss: the mean of the data-parallel ranks' (each tensor-parallel rank of
    # one group has the same), gathered after the ledger closed
    every = torch.stack(losses)
    dist.all_reduce(every)
    sent = {link: totals["sent_bytes"] for link, totals in per_link(ledger.records).items()}
    for group in groups.values():  # the names are reused by the next world of this process
        label_link(group, UNLABELLED)
    return {"coordinates": (r, s, t),
            "losses": (every / dist.get_world_size()).tolist(),
            "params": {k: v.clone() for k, v in wrapped.full_parameters().items()},
            "sent": {name: sent.get(name, 0) for name in DIMENSIONS}}


def expected_bytes(replicas: int, shard: int, tp: int, hidden: int, rows: int,
                   steps: int = 1) -> dict[str, float]:
    """Bytes one rank sends along each dimension in `steps` steps: the tensor-parallel
    all-reduces of its data-parallel rank's activations (`tensor_parallel_bytes`, chapter
    7) and HSDP's collectives over its piece, padding included
    (`formulas.predicted("hsdp", piece, R·S, shard_group=S)`)."""
    with torch.device("meta"):
        piece = TensorParallelMLP(MLP(GPTConfig(d_model=hidden)), 0, tp)
    hsdp = predicted("hsdp", piece, replicas * shard, {"shard_group": shard, "wrap": "model"})
    tokens = rows // (replicas * shard)
    return {"tp": steps * tensor_parallel_bytes(tokens, hidden, tp),
            "shard": steps * hsdp.sent.get(INTRA, 0),
            "replicate": steps * hsdp.sent.get(INTER, 0)}


def reassembled(pieces: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The unsplit MLP's parameters from the T tensor-parallel pieces, in order: fc's rows
    and proj's columns side by side, proj's bias (the same on every piece) once."""
    return {"fc.weight": torch.cat([p["fc_weight"] for p in pieces], dim=0),
            "fc.bias": torch.cat([p["fc_bias"] for p in pieces], dim=0),
            "proj.weight": torch.cat([p["proj_weight"] for p in pieces], dim=1),
            "proj.bias": pieces[0]["proj_bias"]}
