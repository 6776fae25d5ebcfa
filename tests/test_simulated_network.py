"""The simulated network that overlaps (`shardlab.comm.simulate_network`).

A collective on it is done when gloo has finished it and its α-β time on the network has
passed, counted on a wire of its own: waited at once it costs that time; launched early, it
runs while the rank computes, and the wire's thread uses no core meanwhile. One launch of 2
ranks checks it on bare collectives (by the timestamps each rank records: lower bounds,
which hold on a loaded machine, and the order of events, with margins of a whole collective)
and trains strategies whose collectives complete in four ways (a Python `wait`, the C++
reducer of PyTorch's DDP reading the work's future, `is_completed` polled by ZeRO-2, the
futures that time our schedules) with and without it: the same losses to the bit, every
record at least its simulated time. Nothing here asserts how long anything took.
"""

import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.launch import launch
from shardlab.config import TrainConfig
from shardlab.train import train_many

WORLD = 2
# all-reduce of 2**16 fp32 on 2 ranks: 2 rounds of 128 kB, 2 x (20 ms + 128 kB / 1 GB/s)
NETWORK = comm.SimulatedNetwork(alpha=0.02, beta=1e9)
NUMEL = 2**16


def _compute_until(deadline: float) -> int:
    """Matmuls until `deadline` (the rank's compute); how many it ran."""
    a = torch.randn(64, 64)
    done = 0
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)
        done += 1
    return done


def collectives_on_the_network() -> dict:
    """Run on every rank: timestamps of a blocking all-reduce, of an asynchronous one
    overlapped with compute three times its simulated time, and of two launched back to
    back."""
    seconds = NETWORK.seconds("all_reduce", NUMEL, WORLD, 4)
    x = torch.ones(NUMEL)
    out = {"seconds": seconds}
    dist.barrier()
    with comm.simulated_network(NETWORK), comm.Ledger() as ledger:
        t0 = time.perf_counter()
        dist.all_reduce(x)
        out["blocking"] = (t0, time.perf_counter())

        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        out["done_at_launch"] = work.is_completed()
        computed = _compute_until(t0 + 3 * seconds)
        t1 = time.perf_counter()
        out["done_after_compute"] = work.is_completed()
        work.wait()
        out["overlapped"] = (t0, t1, time.perf_counter(), computed)

        dist.barrier()
        t0 = time.perf_counter()
        pair = torch.ones(2, NUMEL)
        first, second = (dist.all_reduce(row, async_op=True) for row in pair)
        second.wait()
        out["second_done"] = first.is_completed()
        out["back_to_back"] = (t0, time.perf_counter())
    out["records"] = [(r.op, r.start, r.end, r.seconds) for r in ledger.records]
    first.wait()
    out["sums"] = (float(x[0]), pair[:, 0].tolist())
    # a collective after the block runs at gloo's pace again, on no wire
    before = sum(w["collectives"] for w in comm.wires().values())
    dist.all_reduce(x)
    out["wires"] = comm.wires()
    out["carried_after"] = sum(w["collectives"] for w in comm.wires().values()) - before
    return out


def trained(configs: list[TrainConfig]) -> dict:
    return {"on network": collectives_on_the_network(), "reports": train_many(configs)}


STRATEGIES = {"ddp": {}, "torch-ddp": {}, "zero2": {"bucket_numel": 4096},
              "fsdp2": {"prefetch": True}}


@pytest.fixture(scope="module")
def runs():
    base = TrainConfig(world=WORLD, steps=3, batch_size=4, seq_len=16, measure_memory=False)
    configs = [replace(base, strategy=name, options=options, simulated_network=network)
               for name, options in STRATEGIES.items() for network in (None, NETWORK)]
    return configs, launch(trained, WORLD, configs, timeout=300)


def test_a_blocking_collective_costs_its_simulated_time(runs):
    for rank in runs[1]:
        seen = rank["on network"]
        start, end = seen["blocking"]
        assert end - start >= seen["seconds"]
        assert seen["sums"] == (4.0, [2.0, 2.0])  # the sums are still right


def test_an_early_collective_completes_while_the_rank_computes(runs):
    """Launched, then compute for three times its simulated time: the launch returned
    before it was done, it was done before the compute ended (two whole collectives of
    margin for a slow wake-up on a loaded machine), and the wait returned no earlier than
    its simulated time after the launch."""
    for rank in runs[1]:
        seen = rank["on network"]
        seconds = seen["seconds"]
        t0, t1, waited, computed = seen["overlapped"]
        assert not seen["done_at_launch"]           # the launch did not hold the rank
        assert computed > 0 and t1 - t0 >= 3 * seconds
        assert seen["done_after_compute"]           # finished during the compute
        assert waited >= t0 + seconds
        record = [r for r in seen["records"] if r[0] == "all_reduce"][1]
        assert record[2] >= record[1] + seconds     # its end: the simulated completion
        assert record[2] <= t1                      # ... before the compute ended


def test_the_wire_carries_one_collective_at_a_time_and_uses_no_core(runs):
    for rank in runs[1]:
        seen = rank["on network"]
        seconds = seen["seconds"]
        start, end = seen["back_to_back"]
        assert end - start >= 2 * seconds and seen["second_done"]
        (wire,) = seen["wires"].values()
        assert wire["collectives"] == 4 and seen["carried_after"] == 0
        # the thread slept through 4 x 44 ms of simulated time; its CPU time is the
        # bookkeeping of 4 completions (a busy loop would use the whole 176 ms)
        assert wire["cpu_seconds"] < 0.25 * 4 * seconds
        assert all(r[3] >= seconds for r in seen["records"])


def test_training_on_it_is_the_same_to_the_bit_and_each_collective_lasts_its_time(runs):
    configs, ranks = runs
    for rank in ranks:
        reports = rank["reports"]
        for i in range(0, len(configs), 2):
            plain, simulated = reports[i], reports[i + 1]
            assert simulated.losses == plain.losses, configs[i].strategy
            assert simulated.ledger, configs[i].strategy
            for r in simulated.ledger:
                least = NETWORK.seconds(r.op, r.numel, r.world, r.logical_bytes // r.numel)
                assert r.seconds >= least, (configs[i].strategy, r.op, r.seconds, least)


def test_bad_networks_are_refused_in_one_line():
    with pytest.raises(ValueError, match="alpha must be a finite number of seconds"):
        comm.SimulatedNetwork(alpha=-1e-3, beta=1e9)
    with pytest.raises(ValueError, match="beta must be a number of bytes per second"):
        comm.SimulatedNetwork(alpha=1e-3, beta=0)
    with pytest.raises(ValueError, match="simulated_network must be None or a"):
        TrainConfig(simulated_network=(1e-3, 1e9)).validate()
    assert "simulated network" in str(NETWORK)
