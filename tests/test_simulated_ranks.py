"""N ranks as threads of one process (`shardlab.many_ranks.threads`): the course's rings
and strategies at N = 8, 16 and 64, with real values, against one process.

Parity as the launched parity tests have it (tests/test_zero3.py says why the bounds are
not zero): losses within 1e-5, fp32 AdamW parameters within 1% of what the learning rate
lets them move. HSDP runs on the meshes the processes cannot run here: 2 x 4 at N = 8,
4 x 4 at 16, 4 x 16 at 64. The 64-rank checkpoints are tests/test_resume_many_ranks.py's.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from shardlab.comm import Ledger, ring_all_gather, ring_all_reduce, ring_broadcast
from shardlab.comm import ring_reduce_scatter, ring_traffic
from shardlab.config import TrainConfig
from shardlab.launch import LaunchTimeout, RankFailed
from shardlab.many_ranks import (expected_bytes, launch_threads, reassembled,
                                 run_on_threads, tensor_parallel_hsdp, train_many_on_threads,
                                 unsplit_mlp_run)
from shardlab.train import train_rank

STEPS, LR = 2, 1e-3
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp2", "hsdp"]
SHARD_GROUP = {8: 4, 16: 4, 64: 16}  # HSDP's meshes: 2 x 4, 4 x 4, 4 x 16


def config(strategy: str, world: int, batch_size: int | None = None) -> TrainConfig:
    options = {"shard_group": SHARD_GROUP[world]} if strategy == "hsdp" else {}
    return TrainConfig(strategy=strategy, world=world, model="gpt-tiny", steps=STEPS,
                       batch_size=batch_size or world, seq_len=16, measure_memory=False,
                       keep_params=True, options=options)


@pytest.fixture(scope="module")
def single():
    """The truth: one process, the whole batch, for each batch size used."""
    return {world: train_rank(config("single", 1, batch_size=world)) for world in (8, 16, 64)}


def check_parity(report, reference) -> None:
    assert max(abs(a - b) for a, b in zip(report.losses, reference.losses)) <= 1e-5
    assert report.params.keys() == reference.params.keys()
    worst = max((report.params[k] - reference.params[k]).abs().max().item()
                for k in reference.params)
    assert worst <= 0.01 * LR * STEPS, worst


# ----------------------------------------------------------------------------- the rings


def rings_at(length: int) -> dict:
    """Worker: each ring collective once on a tensor of `length` (not a multiple of N),
    the values checked against the sum, and this rank's ledger."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.arange(length, dtype=torch.float64) + 1000 * rank
    total = torch.arange(length, dtype=torch.float64) * world + 1000 * world * (world - 1) / 2
    chunk = math.ceil(length / world)
    with Ledger() as ledger:
        summed = ring_all_reduce(mine.clone())
        scattered = ring_reduce_scatter(mine.clone())
        gathered = ring_all_gather(scattered, length)
        source = mine.clone() if rank == 3 else torch.zeros(length, dtype=torch.float64)
        broadcast = ring_broadcast(source, src=3)
    padded = torch.cat([total, torch.zeros(world * chunk - length, dtype=torch.float64)])
    return {"all_reduce": torch.equal(summed, total),
            "reduce_scatter": torch.equal(scattered, padded[rank * chunk:(rank + 1) * chunk]),
            "all_gather": torch.equal(gathered, total),
            "broadcast": torch.equal(broadcast, torch.arange(length, dtype=torch.float64)
                                     + 3000),
            "records": [(r.op, r.sent_bytes, r.received_bytes) for r in ledger.records]}


def test_the_rings_of_send_and_recv_run_on_64_threads_with_their_bytes():
    world, length = 64, 1000  # 1000 = 64 x 15.6: the last chunk is padding
    results = launch_threads(rings_at, world, length)
    for rank, r in enumerate(results):
        assert r["all_reduce"] and r["reduce_scatter"] and r["all_gather"] and r["broadcast"]
        # one record per ring on each rank's own ledger: not its send/recv, not its peers'
        expected = [(op, *ring_traffic(op, length, world, 8, rank, src)[:2])
                    for op, src in (("ring_all_reduce", 0), ("ring_reduce_scatter", 0),
                                    ("ring_all_gather", 0), ("ring_broadcast", 3))]
        assert r["records"] == expected, rank
    # the all-reduce sends 2(N-1) chunks of ceil(L/N) doubles: the padded ring
    assert results[0]["records"][0][1] == 2 * 63 * 16 * 8


# ----------------------------------------------------------------------------- strategies


@pytest.mark.parametrize("world", [8, 16])
def test_the_strategies_train_like_one_process_at_8_and_16_ranks(single, world):
    reports = train_many_on_threads([config(s, world) for s in STRATEGIES])
    for rank_reports in reports:
        assert [r.strategy for r in rank_reports] == STRATEGIES
    for strategy, report in zip(STRATEGIES, reports[-1]):  # the last rank's view
        check_parity(report, single[world])
        assert report.world == world, strategy


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "hsdp"])
def test_a_64_rank_step_of_the_course_gpt(single, strategy):
    """ZeRO-1 and ZeRO-2 on 64 ranks, HSDP on a 4 x 16 mesh: every rank's losses, the last
    rank's parameters (DDP, ZeRO-3, FSDP2 and HSDP train at 64 ranks, then 48, in
    tests/test_resume_many_ranks.py)."""
    reports = run_on_threads(config(strategy, 64))
    assert len(reports) == 64 and {tuple(r.losses) for r in reports} == {tuple(reports[0].losses)}
    check_parity(reports[-1], single[64])


def test_a_bad_option_is_refused_in_one_line():
    with pytest.raises(ValueError, match="shard_group must be a whole number >= 1 that divides"):
        run_on_threads(TrainConfig(strategy="hsdp", world=8, options={"shard_group": 3}))


# ----------------------------------------------------------------------------- failures


def raise_on_rank_3():
    if dist.get_rank() == 3:
        raise RuntimeError("rank 3 cannot go on")
    dist.all_reduce(torch.ones(4))  # the others wait for rank 3 here


def rank_0_skips_a_collective():
    if dist.get_rank() != 0:
        dist.all_reduce(torch.ones(4))


def rank_0_never_sends():
    if dist.get_rank() == 1:
        dist.recv(torch.empty(4), src=0)


def test_a_rank_that_raises_is_named_and_the_others_are_stopped():
    with pytest.raises(RankFailed, match="rank 3 failed") as failed:
        launch_threads(raise_on_rank_3, 16)
    assert "rank 3 cannot go on" in failed.value.rank_traceback


@pytest.mark.parametrize("hang", [rank_0_skips_a_collective, rank_0_never_sends])
def test_a_hang_is_stopped_by_the_timeout_naming_who_waits(hang):
    with pytest.raises(LaunchTimeout) as stopped:
        launch_threads(hang, 4, timeout=1.0)
    assert stopped.value.unfinished == ([1, 2, 3] if hang is rank_0_skips_a_collective
                                        else [1])
    assert launch_threads(dist.get_rank, 4) == [0, 1, 2, 3]  # the next launch is clean


def test_one_simulated_world_at_a_time_and_none_inside_a_rank():
    with pytest.raises(ValueError, match="world must be a whole number"):
        launch_threads(dist.get_rank, 0)
    with pytest.raises(RankFailed, match="no process group"):
        launch_threads(lambda: launch_threads(dist.get_rank, 2), 2)


# ----------------------------------------------------------------------------- a 3-D mesh


def test_hsdp_of_the_tensor_parallel_mlp_on_a_2x2x2_mesh():
    """FSDP2 over the shard dimension, replicas over the first, Megatron's MLP over the
    last: the unsplit MLP's losses and parameters, and each dimension's bytes those of
    `tensor_parallel.tensor_parallel_bytes` and of HSDP."""
    hidden, rows, steps = 16, 32, 3
    results = launch_threads(tensor_parallel_hsdp, 8, 2, 2, 2, hidden, rows, steps)
    losses, params = unsplit_mlp_run(hidden, rows, steps)
    assert [r["coordinates"] for r in results][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0),
                                                        (0, 1, 1)]
    assert max(abs(a - b) for a, b in zip(results[0]["losses"], losses)) <= 1e-6
    for replica in (0, 1):  # each replica's tensor-parallel pieces make the whole MLP
        pieces = [r["params"] for r in results if r["coordinates"][:2] == (replica, 0)]
        full = reassembled(pieces)
        assert max((full[k] - params[k]).abs().max().item() for k in params) <= 1e-6
    expected = expected_bytes(2, 2, 2, hidden, rows, steps)
    assert all(r["sent"] == expected for r in results)
    assert expected["tp"] > 0 and expected["shard"] > 0 and expected["replicate"] > 0
