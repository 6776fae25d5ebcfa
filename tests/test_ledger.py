"""The ledger sees every collective, ours and PyTorch's, with the bytes of the formulas.

One launch of 4 ranks runs everything (rings, native calls, a collective from a backward
hook, PyTorch's DDP, DDP + ZeroRedundancyOptimizer, fully_shard), each section under its
own ledger; the tests below check what each ledger recorded against `ring_traffic` and
`volume_per_rank` exactly. The model has Ψ = 212 parameters, and every unit of it divides
by 4, so the ring's chunks need no padding and the paper's formulas hold to the byte.
"""

import math
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardlab import comm, workers
from shardlab.launch import launch

WORLD = 4
STEPS = 2


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


PSI = sum(p.numel() for p in small_model().parameters())  # 212


def _train(model, optimizer, ledger) -> None:
    for step in range(STEPS):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + dist.get_rank()))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ledger.mark_step()


def record_everything() -> dict[str, list]:
    rank = dist.get_rank()
    out = {}

    with comm.Ledger() as ledger:
        g = torch.arange(PSI, dtype=torch.bfloat16)
        comm.ring_all_reduce(g)
        ledger.mark_step()
        shard = comm.ring_reduce_scatter(g)
        comm.ring_all_gather(shard, PSI)
        ledger.mark_step()
        uneven = torch.ones(10)
        comm.ring_all_reduce(uneven)
        comm.ring_broadcast(uneven, src=1)
    out["rings"] = ledger.records

    with comm.Ledger() as ledger:
        t = torch.ones(12)
        dist.all_reduce(t)
        dist.broadcast(t, src=2)
        full = torch.empty(12 * WORLD)
        comm.all_gather_into(full, t)
        comm.reduce_scatter_into(t, full)
        right, left = (rank + 1) % WORLD, (rank - 1) % WORLD
        requests = [dist.isend(t, right), dist.irecv(torch.empty(12), left)]
        for request in requests:
            request.wait()
    out["native"] = ledger.records

    with comm.Ledger() as ledger:  # list and coalesced forms: one record per collective
        dist.all_gather([torch.empty(4) for _ in range(WORLD)], torch.ones(4))
        dist.reduce_scatter(torch.empty(4), [torch.ones(4) for _ in range(WORLD)])
        with dist._coalescing_manager():
            dist.all_reduce(torch.ones(4))
            dist.all_reduce(torch.ones(8))
        with dist._coalescing_manager():
            comm.all_gather_into(torch.empty(4 * WORLD), torch.ones(4))
            comm.all_gather_into(torch.empty(2 * WORLD), torch.ones(2))
    out["coalesced"] = ledger.records

    # A collective launched by a hook inside backward (as any data-parallel code does).
    model = small_model()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))
    with comm.Ledger() as ledger:
        model(torch.ones(2, 8)).sum().backward()
    out["hooks"] = ledger.records

    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(small_model())
    with comm.Ledger() as ledger:
        _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), ledger)
    out["torch-ddp"] = ledger.records

    from torch.distributed.optim import ZeroRedundancyOptimizer
    ddp = DistributedDataParallel(small_model())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=0.1)
    with comm.Ledger() as ledger:
        _train(ddp, zero, ledger)
    out["torch-zero1"] = ledger.records

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    model = small_model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with comm.Ledger() as ledger:
        _train(model, torch.optim.AdamW(model.parameters(), lr=0.1), ledger)
    out["torch-fsdp2"] = ledger.records

    # When: a collective waited for at once, one waited for a step later (as ZeRO's
    # overlapped all-gather is), one waited for after it finished, one never waited for.
    with comm.Ledger() as ledger:
        t = torch.ones(1 << 12)
        dist.all_reduce(t)                                      # blocking: launch + wait
        later = dist.all_reduce(t, async_op=True)
        ledger.mark_step()
        later.wait()                                            # waited in the next step
        done = comm.all_gather_into(torch.empty(4 * WORLD), torch.ones(4), async_op=True)
        dist.barrier()
        done.wait()
        dist.all_reduce(torch.ones(4), async_op=True)           # never waited for
        dist.barrier()
    out["when"] = ledger.records

    # A work the ledger recorded, once waited, lets its tensors go when its owner drops
    # it: the ledger holds no reference past the wait (it would move a ZeRO-3 step's
    # peak, whose full gradients are freed right after their reduce-scatter).
    # (Without the garbage collector: freed by reference counting, as it is without a
    # ledger; the completion callback, on gloo's thread, may still hold it a moment.)
    import gc
    import weakref
    gc.disable()
    try:
        with comm.Ledger():
            flat = torch.ones(1 << 10)
            flat_ref = weakref.ref(flat)
            work = dist.all_reduce(flat, async_op=True)
            work.wait()
            del work, flat
            deadline = time.monotonic() + 2
            while flat_ref() is not None and time.monotonic() < deadline:
                time.sleep(0.001)
            out["freed_after_wait"] = flat_ref() is None
    finally:
        gc.enable()

    if os.path.exists("/proc/self/io"):  # the bytes really written to gloo's sockets
        out["wire"] = workers.socket_bytes(["ring_reduce_scatter", "ring_all_reduce",
                                         "all_reduce", "reduce_scatter", "all_gather"], 1 << 16)
    return out


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, list]]:
    return launch(record_everything, WORLD, backend="gloo", timeout=240)


def test_rings_record_themselves_once_with_the_formula_bytes(recorded):
    for rank, sections in enumerate(recorded):
        records = sections["rings"]
        assert [r.op for r in records] == ["ring_all_reduce", "ring_reduce_scatter",
                                           "ring_all_gather", "ring_all_reduce",
                                           "ring_broadcast"]  # no inner send/recv
        steps = comm.per_step(records)
        bf16 = 2
        # all-reduce = reduce-scatter + all-gather, to the byte, = DDP's 2Ψ(N-1)/N
        assert steps[0]["ring_all_reduce"]["sent_bytes"] == comm.volume_per_rank(
            "ddp", PSI, WORLD, bf16) == 2 * PSI * bf16 * (WORLD - 1) / WORLD
        assert comm.totals(records[1:3])["sent_bytes"] == comm.volume_per_rank(
            "zero2", PSI, WORLD, bf16)
        assert all(r.logical_bytes == PSI * bf16 and r.dtype == torch.bfloat16
                   for r in records[:3])
        assert records[0].received_bytes == records[0].sent_bytes
        assert (records[0].rounds, records[0].round_bytes) == (2 * (WORLD - 1),
                                                               PSI // WORLD * bf16)
        # 10 floats on 4 ranks: chunks of 3, the padding travels too
        assert records[3].sent_bytes == 2 * (WORLD - 1) * 3 * 4
        # chain broadcast from rank 1: all but rank 0 (the last) send, all but 1 receive
        assert records[4].sent_bytes == (0 if rank == 0 else 40)
        assert records[4].received_bytes == (0 if rank == 1 else 40)
        assert all(r.seconds > 0 and r.world == WORLD for r in records)


def test_native_calls_are_recorded_with_ring_bytes(recorded):
    for rank, sections in enumerate(recorded):
        records = sections["native"]
        assert [r.op for r in records] == ["all_reduce", "broadcast", "all_gather",
                                           "reduce_scatter", "send", "recv"]
        chunk = 12 // WORLD * 4
        all_reduce, broadcast, all_gather, reduce_scatter, send, recv = records
        assert all_reduce.sent_bytes == 2 * (WORLD - 1) * chunk == all_reduce.received_bytes
        assert all_gather.logical_bytes == reduce_scatter.logical_bytes == 12 * WORLD * 4
        assert all_gather.sent_bytes == reduce_scatter.sent_bytes == (WORLD - 1) * 12 * 4
        assert broadcast.sent_bytes == (0 if rank == 1 else 48)   # src 2, the last is 1
        assert broadcast.received_bytes == (0 if rank == 2 else 48)
        assert (send.sent_bytes, send.received_bytes) == (48, 0)
        assert (recv.sent_bytes, recv.received_bytes) == (0, 48)
        assert all(r.seconds > 0 and not math.isnan(r.seconds) for r in records)


def test_every_record_says_when_it_ran_and_when_this_rank_waited(recorded):
    for sections in recorded:
        for name in ("rings", "native", "hooks", "torch-ddp", "torch-fsdp2", "when"):
            for r in sections[name]:
                assert 0 < r.start <= r.end and not math.isnan(r.end), (name, r.op)
                assert r.end - r.start == pytest.approx(r.seconds)
                assert r.group == "0"  # the default group's name, the same on every rank
                assert all(r.start <= a <= b for a, b in r.waits), (name, r.op)
        for r in sections["rings"]:  # a ring collective blocks from call to return
            assert r.waits == [(r.start, r.end)]
        # (barriers are not collectives of a strategy: the ledger leaves them out)
        blocking, deferred, finished, unwaited = sections["when"]
        # a blocking call: its launch, then its wait, which lasts until it completes
        assert len(blocking.waits) == 2 and blocking.waits[0][0] == blocking.start
        assert blocking.waits[1][1] >= blocking.end - 1e-3
        # waited for in the next step: the wait is on the record of the step it ran in
        assert (deferred.step, len(deferred.waits)) == (0, 2)
        assert deferred.waits[1][0] > deferred.waits[0][1]
        # a wait after it finished: a short wait that begins after its end
        assert finished.op == "all_gather" and len(finished.waits) == 2
        assert finished.waits[1][0] >= finished.end - 1e-3
        assert len(unwaited.waits) == 1  # its launch only


def test_list_and_coalesced_forms_are_one_record_each(recorded):
    for sections in recorded:
        got = [(r.op, r.numel, r.sent_bytes) for r in sections["coalesced"]]
        assert got == [("all_gather", 4 * WORLD, (WORLD - 1) * 16),
                       ("reduce_scatter", 4 * WORLD, (WORLD - 1) * 16),
                       ("all_reduce", 12, 2 * (WORLD - 1) * 3 * 4),
                       ("all_gather", 6 * WORLD, (WORLD - 1) * 24)]


def test_collectives_from_backward_hooks_are_recorded(recorded):
    for sections in recorded:
        records = sections["hooks"]
        assert [r.op for r in records] == ["all_reduce"] * 4
        assert sum(r.numel for r in records) == PSI


def test_torch_ddp_all_reduces_2psi_per_step(recorded):
    for sections in recorded:
        steps = comm.per_step(sections["torch-ddp"])
        assert len(steps) == STEPS
        for ops in steps:  # (DDP also broadcasts a few bucket indices when it rebuilds)
            assert ops["all_reduce"]["logical_bytes"] == PSI * 4
            assert ops["all_reduce"]["sent_bytes"] == comm.volume_per_rank(
                "torch-ddp", PSI, WORLD, 4)


def test_torch_zero1_all_reduces_then_broadcasts_every_shard(recorded):
    for step in range(STEPS):
        sent = 0
        for sections in recorded:
            ops = comm.per_step(sections["torch-zero1"])[step]
            assert ops["all_reduce"]["logical_bytes"] == PSI * 4
            # (DDP's int64 broadcasts of its bucket indices when it rebuilds are not ZeRO's)
            broadcasts = [r for r in sections["torch-zero1"] if r.step == step
                          and r.op == "broadcast" and r.dtype == torch.float32]
            assert sum(r.numel for r in broadcasts) == PSI   # every parameter, once
            sent += ops["all_reduce"]["sent_bytes"] + sum(r.sent_bytes for r in broadcasts)
        # which rank owns which parameter varies, so the formula holds on average
        assert sent == WORLD * comm.volume_per_rank("torch-zero1", PSI, WORLD, 4)


def test_fully_shard_gathers_twice_and_reduce_scatters_once(recorded):
    for sections in recorded:
        for ops in comm.per_step(sections["torch-fsdp2"]):
            assert set(ops) == {"all_gather", "reduce_scatter"}
            assert ops["all_gather"]["logical_bytes"] == 2 * PSI * 4   # forward + backward
            assert ops["reduce_scatter"]["logical_bytes"] == PSI * 4
            sent = ops["all_gather"]["sent_bytes"] + ops["reduce_scatter"]["sent_bytes"]
            assert sent == comm.volume_per_rank("torch-fsdp2", PSI, WORLD, 4)


def test_the_wire_carries_the_ring_bytes_and_gloo_reduce_scatter_those_of_an_all_reduce(
        recorded):
    if "wire" not in recorded[0]:
        pytest.skip("no /proc/self/io on this system")
    numel = 1 << 16
    for sections in recorded:
        wire = sections["wire"]
        for op in ("ring_reduce_scatter", "ring_all_reduce", "all_reduce", "all_gather"):
            ring = comm.ring_traffic(op, numel, WORLD, 4)[0]
            assert ring <= wire[op] <= 1.01 * ring, (op, wire[op], ring)  # + headers
        # gloo's reduce-scatter is an all-reduce underneath: twice the ring's bytes
        assert wire["reduce_scatter"] == wire["all_reduce"]


def test_a_waited_collective_frees_its_tensors_under_the_ledger(recorded):
    assert all(r["freed_after_wait"] for r in recorded)


def test_volumes_of_the_paper():
    psi, world = 1_000_000, 8
    assert comm.volume_per_rank("ddp", psi, world) == 2 * psi * 7 / 8
    assert comm.volume_per_rank("zero1", psi, world) == comm.volume_per_rank("ddp", psi, world)
    assert comm.volume_per_rank("zero3", psi, world, 2) == 1.5 * comm.volume_per_rank(
        "zero2", psi, world, 2)
    assert comm.volume_per_rank("zero3", psi, 1) == 0


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 50e-6, 2e9
    records = []
    for world in (2, 4):
        for nbytes in (4, 4_000, 4_000_000):
            for op in ("reduce_scatter", "all_reduce"):
                sent, received, rounds, round_bytes = comm.ring_traffic(op, nbytes, world, 1)
                seconds = comm.predict_seconds(op, nbytes, world, alpha, beta)
                records.append(comm.CollectiveRecord(op, torch.uint8, nbytes, nbytes, sent,
                                                     received, seconds, 0, world, rounds,
                                                     round_bytes))
    fitted_alpha, fitted_beta = comm.fit_alpha_beta(records)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_beta == pytest.approx(beta, rel=1e-6)


def test_tables_add_up_per_step_and_per_op():
    r = [comm.CollectiveRecord("all_reduce", torch.float32, 4, 16, 24, 24, 0.5, 0),
         comm.CollectiveRecord("all_reduce", torch.float32, 4, 16, 24, 24, 0.25, 1),
         comm.CollectiveRecord("broadcast", torch.float32, 2, 8, 8, 0, 0.25, 1)]
    assert comm.per_op(r)["all_reduce"] == {"calls": 2, "logical_bytes": 32, "sent_bytes": 48,
                                            "received_bytes": 48, "seconds": 0.75}
    assert list(comm.per_step(r)[1]) == ["all_reduce", "broadcast"]
    assert comm.totals(r)["sent_bytes"] == 56
    assert comm.format_table(r).splitlines()[3].split() == ["1", "broadcast", "1", "8", "8", "0"]
