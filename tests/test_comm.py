"""The ring collectives against torch.distributed: every N from 1 to 8, uneven lengths,
fp32 / bf16 / fp16, sum and average; and a clear error, not a hang, on mismatched input.

One launch of 8 ranks covers every group size: the ranks form subgroups of 1..8 (some
not starting at rank 0, so the ring's neighbours must be mapped to global ranks), and
each subgroup runs every case. Values are small integers, so every sum is exact in every
dtype and the ring must agree with torch bit for bit. On values that round, the ring's
reduce-scatter agrees bit for bit with its replay in one process
(`comm.reduction_precision.ring_sum`).
"""

import math

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.launch import RankFailed, launch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LENGTHS = (1, 5, 16, 37)   # shorter than N, uneven, even, prime
# ranks of each subgroup; with 8 ranks they cover every size from 1 to 8
GROUPS = ([0], [3, 6], [1, 4, 6], [0, 1, 2, 3], [2, 3, 5, 6, 7], [0, 1, 2, 4, 5, 7],
          [1, 2, 3, 4, 5, 6, 7], list(range(8)))


def _data(rank: int, length: int, dtype: torch.dtype, case: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randint(-8, 9, (length,), generator=g).to(dtype)


def _cases():
    """Every dtype with every length; sum and average alternate, so each dtype has both."""
    case = 0
    for dtype in DTYPES:
        for length in LENGTHS:
            case += 1
            yield case, dtype, length, ("sum", "avg")[case % 2]


def compare_rings_with_torch(groups) -> list[str]:
    """Run every case in every group this rank belongs to; return the mismatches."""
    failures = []
    subgroups = [(ranks, dist.new_group(ranks)) for ranks in groups]  # collective: all ranks
    me = dist.get_rank()
    for ranks, group in subgroups:
        if me not in ranks:
            continue
        world, rank = len(ranks), ranks.index(me)
        for case, dtype, length, op in _cases():
            where = f"N={world} {dtype} L={length} {op}"
            mine = _data(rank, length, dtype, case)
            everyone = [_data(r, length, dtype, case) for r in range(world)]

            # reduce-scatter: torch needs a length that divides by N, so pad as the ring does
            chunk = math.ceil(length / world)
            padded = torch.zeros(world * chunk, dtype=dtype)
            padded[:length] = mine
            expected = torch.empty(chunk, dtype=dtype)
            comm.reduce_scatter_into(expected, padded, group=group)
            if op == "avg":
                expected /= world
            got = comm.ring_reduce_scatter(mine, op, group=group)
            if not torch.equal(got, expected):
                failures.append(f"reduce_scatter {where}: {got} != {expected}")

            # all-gather of those chunks, trimmed back to the length
            expected_full = torch.empty(world * chunk, dtype=dtype)
            comm.all_gather_into(expected_full, expected, group=group)
            got_full = comm.ring_all_gather(got, length, group=group)
            if not torch.equal(got_full, expected_full[:length]):
                failures.append(f"all_gather {where}")

            # all-reduce in place, against torch's and against the sum computed locally
            t = mine.clone()
            reference = mine.clone()
            dist.all_reduce(reference, group=group)
            if op == "avg":
                reference /= world
            comm.ring_all_reduce(t, op, group=group)
            local = torch.stack(everyone).sum(0, dtype=torch.float32).to(dtype)
            local = local / world if op == "avg" else local
            if not (torch.equal(t, reference) and torch.equal(t, local)):
                failures.append(f"all_reduce {where}")

            # broadcast from a source that moves with the case
            src = case % world
            t, reference = mine.clone(), mine.clone()
            comm.ring_broadcast(t, src, group=group)
            dist.broadcast(reference, ranks[src], group=group)
            if not torch.equal(t, reference) or not torch.equal(t, everyone[src]):
                failures.append(f"broadcast {where} src={src}")

        # floats that are not integers, summed in bf16 and fp32 with a rounding after each
        # addition: the ring's order, which `reduction_precision.ring_sum` replays in one
        # process, bit for bit
        from shardlab.comm.reduction_precision import ring_sum
        for dtype in (torch.bfloat16, torch.float32):
            everyone = torch.stack([torch.randn(37, generator=torch.Generator().manual_seed(
                100 + r)) for r in range(world)]).to(dtype)
            got = comm.ring_reduce_scatter(everyone[rank], group=group)
            chunk = math.ceil(37 / world)
            replayed = torch.zeros(world * chunk, dtype=dtype)
            replayed[:37] = ring_sum(everyone, dtype)
            if not torch.equal(got, replayed[rank * chunk:(rank + 1) * chunk]):
                failures.append(f"ring_sum replays the ring N={world} {dtype}")

        # shapes other than 1-D, floats that are not integers: close, not equal
        x = torch.randn(3, 5, generator=torch.Generator().manual_seed(rank))
        y, reference = x.clone(), x.clone()
        comm.ring_all_reduce(y, group=group)
        dist.all_reduce(reference, group=group)
        if y.shape != (3, 5) or not torch.allclose(y, reference, atol=1e-5):
            failures.append(f"all_reduce 2-D fp32 N={world}")
    return failures


def test_rings_match_torch_for_every_world_size_length_and_dtype():
    results = launch(compare_rings_with_torch, 8, GROUPS, backend="gloo", timeout=240)
    assert results == [[]] * 8, [f for r in results for f in r][:20]


def rings_on_the_default_group_and_mismatches(world: int) -> list:
    """No group argument: the ring's neighbours are the plain ranks. Then three calls with
    mismatched inputs, whose errors every rank must raise (so none is left hanging)."""
    rank = dist.get_rank()
    x = torch.arange(10, dtype=torch.float32) + rank
    y = x.clone()
    comm.ring_all_reduce(y)
    expected = torch.arange(10, dtype=torch.float32) * world + sum(range(world))
    shard = comm.ring_reduce_scatter(x)
    b = x.clone()
    comm.ring_broadcast(b, src=world - 1)
    results = [torch.equal(y, expected), torch.equal(comm.ring_all_gather(shard, 10), expected),
               torch.equal(b, torch.arange(10, dtype=torch.float32) + world - 1)]
    mismatched = [
        lambda: comm.ring_all_reduce(torch.ones(10 + 2 * (rank == 1))),
        lambda: comm.ring_reduce_scatter(torch.ones(8, dtype=torch.bfloat16 if rank else
                                                    torch.float32)),
        lambda: comm.ring_all_gather(torch.ones(3 if rank == 2 else 4)),
    ]
    for call in mismatched:
        try:
            call()
            results.append("no error")
        except ValueError as error:
            results.append(str(error))
    return results


def test_default_group_and_mismatched_inputs_fail_with_the_ranks_and_shapes():
    results = launch(rings_on_the_default_group_and_mismatches, 3, 3, backend="gloo",
                     timeout=60)
    for rank_result in results:  # every rank got the same error: no rank hangs
        assert rank_result[:3] == [True] * 3
        assert rank_result[3] == (
            "ring_all_reduce: every rank must pass a tensor of the same shape and dtype, "
            "but got rank 0: float32 (10,), rank 1: float32 (12,), rank 2: float32 (10,)")
        assert rank_result[4].endswith("rank 0: float32 (8,), rank 1: bfloat16 (8,), "
                                       "rank 2: bfloat16 (8,)")
        assert rank_result[5] == (
            "ring_all_gather: every rank must pass a tensor of the same shape and dtype, "
            "but got rank 0: float32 (4,), rank 1: float32 (4,), rank 2: float32 (3,)")


def raise_on_mismatch():
    comm.ring_all_reduce(torch.ones(4 + dist.get_rank()))


def test_a_mismatch_ends_the_launch_with_the_error_not_a_timeout():
    with pytest.raises(RankFailed) as info:
        launch(raise_on_mismatch, 2, backend="gloo", timeout=60)
    assert "rank 0: float32 (4,), rank 1: float32 (5,)" in info.value.rank_traceback


def test_bad_arguments_are_refused_before_communicating():
    with pytest.raises(ValueError, match="use 'sum' or 'avg'"):
        comm.ring_reduce_scatter(torch.ones(2), op="max")
    with pytest.raises(ValueError, match="unknown strategy 'zero4'"):
        comm.volume_per_rank("zero4", 10, 2)
    with pytest.raises(ValueError, match="unknown collective"):
        comm.ring_traffic("scatter", 10, 2, 4)


def gathered_by_c10d_and_by_dtensor() -> list[str]:
    """`comm.full_tensor.gather_shards` (c10d's all-gather, the path taken over gloo with
    CUDA tensors, where PyTorch's `full_tensor()` crashed) against `full_tensor()` on the
    CPU: 1-D and 2-D meshes, uneven shards (empty pieces included), any tensor dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from shardlab.comm.full_tensor import full_tensor, gather_shards

    flat, square = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
    cases = [(flat, (5, 3), [Shard(0)]), (flat, (3, 7), [Shard(1)]), (flat, (1,), [Shard(0)]),
             (flat, (8, 2), [Shard(0)]), (flat, (4, 2), [Replicate()]),
             (square, (5, 3), [Replicate(), Shard(0)]),   # HSDP's placement
             (square, (3, 5), [Shard(0), Shard(1)]), (square, (7, 2), [Shard(1), Shard(0)])]
    wrong = []
    for mesh, shape, placements in cases:
        whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        t = distribute_tensor(whole, mesh, placements).requires_grad_()  # a parameter's
        for name, got in (("gather_shards", gather_shards(t)), ("full_tensor", full_tensor(t))):
            if not torch.equal(got.detach(), whole):
                wrong.append(f"{name} {shape} {placements}: {got.tolist()}")
    partial = DTensor.from_local(torch.ones(2), flat, [Partial()])
    try:
        gather_shards(partial)
        wrong.append("a Partial tensor was gathered, not refused")
    except ValueError as exc:
        if "Partial" not in str(exc):
            wrong.append(f"the refusal does not name the placement: {exc}")
    return wrong


def test_a_dtensor_gathered_by_c10d_equals_its_full_tensor():
    results = launch(gathered_by_c10d_and_by_dtensor, 4, backend="gloo", timeout=120)
    assert results == [[]] * 4, results[0]
