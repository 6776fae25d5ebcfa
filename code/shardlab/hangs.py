"""Hangs caused on purpose, the way real jobs cause them, each with its fix.

A sharded job hangs when its ranks stop agreeing on the collectives they call: a
collective completes only when every rank of the group has called it, with the same kind,
size and type, in the same order. In the issue threads of PyTorch, DeepSpeed and the
trainers built on them, hangs almost never come from the network; they come from code
whose path differs by rank. Each fault below is one such path, switched on by its name,
and `fixed=True` runs the same code with its fix (the line marked `# the fix`):

* `rank0_decides`: the loss is `reduce`d to rank 0, so only rank 0 can decide to stop;
  it stops, the others go on into the next step's all-gather. Fix: `all_reduce`, and
  every rank decides from the same value;
* `uneven_eval`: rank 0 gets one more evaluation batch than the others and waits in its
  all-reduce alone. Fix: `all_reduce(has_data, MIN)` before each batch, and every rank
  stops when one has run out;
* `skipped_sample`: a filter drops a bad example on one rank only, which skips that
  step's gradient all-reduce; its next all-reduce pairs with the others' previous one.
  Fix: keep the sample with weight 0, so every rank runs its backward;
* `rank0_generate`: under ZeRO-3 / FSDP2 a forward all-gathers every unit, so a
  `generate()` (or a full state dict) on rank 0 only issues all-gathers the others never
  call. Fix: enter it on every rank (rank 0 alone prints);
* `size_mismatch`: one all-reduce called with another size on one rank (a buffer sized
  from the rank's own batch). Fix: agree on the size first, and pad to it;
* `opposite_order`: an all-reduce and an all-gather launched in opposite order on two
  ranks (the order of a set of names, which differs between processes). Fix:
  `sorted(...)`.

Each fault runs on the process group it is given, whose timeout ends it in seconds; the
flight recorder (`shardlab.comm.flight`) says which rank and which collective.
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.distributed as dist

from shardlab.comm.compat import all_gather_into
from shardlab.launch.devices import rank_device

Step = Callable[[], None]  # called at the end of each training step (the recorder's step)


def rank0_decides(group, fixed: bool, next_step: Step) -> None:
    """Early stopping on a loss that only rank 0 holds."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    shard = torch.ones(64, device=dev)
    for step in range(4):
        full = torch.empty(world * shard.numel(), device=dev)
        all_gather_into(full, shard, group=group)         # the forward's all-gather
        loss = torch.tensor([3.0 - step + 2.0 * (rank > 0)], device=dev)  # this rank's
        total = loss.clone()
        if fixed:
            dist.all_reduce(total, group=group)           # the fix: every rank has the sum
        else:
            dist.reduce(total, dst=dist.get_global_rank(group, 0), group=group)
            if rank != 0:
                total = loss * world  # a non-root holds no sum: its own loss is all it has
        if total.item() / world < 2.5:
            return  # the target is reached: stop training (or save, then stop)
        next_step()


def uneven_eval(group, fixed: bool, next_step: Step) -> None:
    """Evaluation over a rank's own shard of 7 samples: 4 batches on rank 0, 3 elsewhere."""
    rank, dev = dist.get_rank(group), rank_device()
    batches = 4 if rank == 0 else 3
    for i in itertools.count():
        has_data = torch.tensor([int(i < batches)], device=dev)
        if fixed:
            dist.all_reduce(has_data, op=dist.ReduceOp.MIN, group=group)  # the fix
        if not has_data.item():
            break
        metrics = torch.tensor([1.0, 0.5], device=dev)  # (loss sum, samples) of a batch
        dist.all_reduce(metrics, group=group)
    next_step()


def skipped_sample(group, fixed: bool, next_step: Step) -> None:
    """Three steps; at step 1 the last rank's sample fails a filter."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    for step in range(3):
        bad = rank == world - 1 and step == 1  # e.g. a sequence longer than the limit
        if bad and not fixed:
            next_step()
            continue                           # skips this step's backward
        weight = 0.0 if bad else 1.0           # the fix: keep it, weighted 0
        grads = torch.full((32,), weight, device=dev)      # the backward's gradients
        dist.all_reduce(grads, group=group)
        next_step()


def size_mismatch(group, fixed: bool, next_step: Step) -> None:
    """A buffer sized from the rank's own batch: 5 tokens on the last rank, 4 elsewhere."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    length = torch.tensor([5 if rank == world - 1 else 4], device=dev)
    if fixed:
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)  # the fix: agree first
    counts = torch.zeros(int(length.item()), device=dev)
    dist.all_reduce(counts, group=group)
    next_step()


def opposite_order(group, fixed: bool, next_step: Step) -> None:
    """A gradient all-reduce and a parameter all-gather, both launched asynchronously, in
    the order a set of names gives (a set of strings iterates in another order in another
    process: Python salts string hashes per process)."""
    rank, world, dev = dist.get_rank(group), dist.get_world_size(group), rank_device()
    grads, shard = torch.ones(48, device=dev), torch.ones(16, device=dev)
    full = torch.empty(16 * world, device=dev)
    launch = {"grads": lambda: dist.all_reduce(grads, group=group, async_op=True),
              "params": lambda: all_gather_into(full, shard, group=group, async_op=True)}
    names = ["grads", "params"] if rank == 0 else ["params", "grads"]
    if fixed:
        names = sorted(names)                                        # the fix
    works = [launch[name]() for name in names]
    for work in works:
        work.wait()
    next_step()


def rank0_generate(group, fixed: bool, next_step: Step, model: torch.nn.Module,
                   train_step: Callable[[], None]) -> None:
    """Two training steps of a ZeRO-3 / FSDP2 `model`; after the first, rank 0 samples a
    few tokens to look at the model's progress."""
    rank, dev = dist.get_rank(group), rank_device()
    for step in range(2):
        train_step()
        next_step()
        if step == 0 and (fixed or rank == 0):  # the fix: every rank enters it
            tokens = sample(model, torch.tensor([[72, 101]], device=dev), new_tokens=2)
            if rank == 0:
                print("sample:", tokens.tolist())


@torch.no_grad()
def sample(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding: every new token is one forward, and every forward of a sharded
    model all-gathers each unit."""
    for _ in range(new_tokens):
        logits = model(ids)
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


FAULTS: dict[str, Callable] = {
    "rank0_decides": rank0_decides,
    "uneven_eval": uneven_eval,
    "skipped_sample": skipped_sample,
    "rank0_generate": rank0_generate,
    "opposite_order": opposite_order,
    "size_mismatch": size_mismatch,
}

__all__ = ["FAULTS", "rank0_decides", "uneven_eval", "skipped_sample", "rank0_generate",
           "size_mismatch", "opposite_order", "sample"]
