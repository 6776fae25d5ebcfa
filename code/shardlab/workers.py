"""The workers the chapters and labs launch (and the launcher's smallest example).

Spawned ranks can only run functions they can import, so what a notebook asks the ranks
to do lives here, unless it belongs to one strategy (`shardlab.ddp.timeline_worker`,
`shardlab.zero.schedule_timeline`, `shardlab.fsdp.step_probe`): the collectives rank by
rank and the bytes they put on the wire, their timings, several runs in one launch,
training across simulated nodes, and the machine as the step-time model sees it. The
notebook launches them and prints or draws what comes back.
"""

from __future__ import annotations

import importlib
import math
import statistics
import time

import torch
import torch.distributed as dist

from shardlab import comm
from shardlab.cards import CARDS, card


def whoami() -> tuple[int, int, str]:
    """Return (rank, world size, backend): the smallest proof that N ranks ran."""
    return dist.get_rank(), dist.get_world_size(), dist.get_backend()


def _ints(t: torch.Tensor) -> list[int]:
    return [int(v) for v in t.tolist()]


def collectives_rank_by_rank() -> dict[str, tuple[list[int], list[int]]]:
    """Each of the four collectives on small tensors: {name: (before, after)} of this rank.

    Rank r starts with (r+1) x [1, 2, ..., N], so sums are easy to check by eye. The
    all-gather starts from what the reduce-scatter left, to show that the two together
    give what the all-reduce gives.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    start = (rank + 1) * torch.arange(1, world + 1, device=device, dtype=torch.float32)
    seen = {}

    t = start.clone()
    dist.broadcast(t, src=0)
    seen["broadcast"] = (_ints(start), _ints(t))

    t = start.clone()
    dist.all_reduce(t)
    seen["all_reduce"] = (_ints(start), _ints(t))

    shard = torch.empty(1, device=device)
    comm.reduce_scatter_into(shard, start.clone())
    seen["reduce_scatter"] = (_ints(start), _ints(shard))

    full = torch.empty(world, device=device)
    comm.all_gather_into(full, shard)
    seen["all_gather"] = (_ints(shard), _ints(full))
    return seen


def all_reduce_equals_reduce_scatter_all_gather(numel: int = 1024, seed: int = 0) -> dict:
    """Run an all-reduce, and a reduce-scatter followed by an all-gather, on the same data.

    Values are whole numbers, so both orders of summation are exact and the results must
    be identical, not merely close.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randint(-100, 101, (numel,), generator=g, device="cpu").float().to(device)
    reduced = x.clone()
    dist.all_reduce(reduced)
    shard = torch.empty(numel // world, device=device)
    comm.reduce_scatter_into(shard, x)
    gathered = torch.empty(numel, device=device)
    comm.all_gather_into(gathered, shard)
    return {"identical": torch.equal(reduced, gathered), "shard_numel": shard.numel(),
            "numel": numel, "first": _ints(reduced[:4].cpu())}


def _device() -> torch.device:
    from shardlab.launch.devices import rank_device
    return rank_device()


# ----------------------------------------------------------------------------- volumes


def ring_and_native_volumes(psi: int, dtype: str = "float32") -> list[comm.CollectiveRecord]:
    """The ledger of one all-reduce and one reduce-scatter + all-gather of Ψ elements,
    first with the course's rings, then with torch's collectives (marked as step 1)."""
    world = dist.get_world_size()
    device = _device()
    x = torch.ones(psi, dtype=getattr(torch, dtype), device=device)
    with comm.Ledger() as ledger:
        comm.ring_all_reduce(x.clone())
        comm.ring_all_gather(comm.ring_reduce_scatter(x), psi)
        ledger.mark_step()
        dist.all_reduce(x.clone())
        shard = torch.empty(math.ceil(psi / world), dtype=x.dtype, device=device)
        comm.reduce_scatter_into(shard, x)
        comm.all_gather_into(torch.empty(psi, dtype=x.dtype, device=device), shard)
    return ledger.records


# ----------------------------------------------------------------------------- timings

# name -> how to run it on a flat tensor of numel elements (divisible by world)
def _native_reduce_scatter(x):
    out = torch.empty(x.numel() // dist.get_world_size(), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, x)


def _native_all_gather(x):
    world = dist.get_world_size()
    shard = x[: x.numel() // world]
    comm.all_gather_into(torch.empty(shard.numel() * world, dtype=x.dtype, device=x.device),
                         shard)


COLLECTIVES = {
    "all_reduce": lambda x: dist.all_reduce(x),
    "reduce_scatter": _native_reduce_scatter,
    "all_gather": _native_all_gather,
    "broadcast": lambda x: dist.broadcast(x, 0),
    "ring_all_reduce": lambda x: comm.ring_all_reduce(x, check=False),
    "ring_reduce_scatter": lambda x: comm.ring_reduce_scatter(x, check=False),
    "ring_all_gather": lambda x: comm.ring_all_gather(x[: x.numel() // dist.get_world_size()],
                                                      check=False),
    "ring_broadcast": lambda x: comm.ring_broadcast(x, 0, check=False),
}


def _ring_from(module: str | dict, op: str):
    """The reader's ring: op is "ring_reduce_scatter" etc., from their own module (its name)
    or from a dict of their functions (written in a notebook cell, carried by value)."""
    functions = module if isinstance(module, dict) else vars(importlib.import_module(module))
    if op == "ring_all_gather":
        gather = functions["ring_all_gather"]
        return lambda x: gather(x[: x.numel() // dist.get_world_size()])
    return functions[op]


def time_collectives(ops: list[str], sizes: list[int], repeats: int = 5,
                     module: str | dict | None = None,
                     typical: bool = False) -> list[comm.CollectiveRecord]:
    """Time each op on fp32 tensors of each size in bytes; one record per (op, size).

    `seconds` is the fastest of `repeats` runs, each started together on all ranks (a
    barrier first, so a rank that arrives late does not count as slow communication); the
    fastest is the run least disturbed by other processes sharing the cores.
    `module` runs the reader's ring functions instead of the course's: a module's name, or
    a dict of the functions by name. `typical`: the median of the runs instead of the
    fastest, what a collective costs on the machine as loaded as it is (the step-time
    model's fit: a step's collectives are not the least disturbed ones).
    rounds / round_bytes are the ring's, for the α-β fit.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _device()
    records = []
    for op in ops:
        run = _ring_from(module, op) if module and op.startswith("ring_") else COLLECTIVES[op]
        for nbytes in sizes:
            numel = max(world, nbytes // 4 // world * world)
            x = torch.ones(numel, device=device)
            run(x.clone())  # warm-up: first use of a size allocates and connects
            times = []
            for _ in range(repeats):
                y = x.clone()
                dist.barrier()
                start = time.perf_counter()
                run(y)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            sent, received, rounds, round_bytes = comm.ring_traffic(op, numel, world, 4, rank)
            records.append(comm.CollectiveRecord(op, torch.float32, numel, numel * 4, sent,
                                                 received,
                                                 statistics.median(times) if typical
                                                 else min(times), 0,
                                                 world, rounds, round_bytes))
    return records


def _bytes_written() -> int:
    """Bytes this process has passed to write() so far, sockets included (Linux)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def socket_bytes(ops: list[str], numel: int) -> dict[str, int]:
    """Bytes this rank really wrote while running each op on `numel` fp32 elements.

    gloo's TCP transport writes every message with a write() system call, and Linux counts
    a process's written bytes in /proc/self/io: the difference around one collective is
    what the rank put on the wire (plus a few bytes of headers). Nothing else writes in
    between: a rank's prints go to a file only when it prints, and it does not.
    """
    x = torch.ones(numel, device=_device())
    written = {}
    for op in ops:
        run = COLLECTIVES[op]
        run(x.clone())                      # warm-up: connections, buffers
        y = x.clone()
        dist.barrier()
        before = _bytes_written()
        run(y)
        written[op] = _bytes_written() - before
        dist.barrier()
    return written


# ----------------------------------------------------------------------------- checks


def check_ring_module(module: str, lengths=(1, 5, 16, 37),
                      dtypes=("float32", "bfloat16")) -> dict:
    """Check the reader's `ring_reduce_scatter(tensor)` and `ring_all_gather(chunk)` from
    `module` against torch, and return what the ledger saw of them on this rank."""
    functions = importlib.import_module(module)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    failures = []
    for case, (dtype_name, length) in enumerate((d, n) for d in dtypes for n in lengths):
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(100 * case + rank)
        x = torch.randint(-8, 9, (length,), generator=g, device="cpu").to(device, dtype)
        chunk = math.ceil(length / world)
        padded = torch.zeros(world * chunk, dtype=dtype, device=device)
        padded[:length] = x
        expected = torch.empty(chunk, dtype=dtype, device=device)
        comm.reduce_scatter_into(expected, padded)
        got = functions.ring_reduce_scatter(x.clone())
        if got.shape != expected.shape or not torch.equal(got, expected):
            failures.append(f"ring_reduce_scatter, {dtype_name}, length {length}")
            continue
        full = torch.empty(world * chunk, dtype=dtype, device=device)
        comm.all_gather_into(full, expected)
        gathered = functions.ring_all_gather(expected)
        if gathered.shape != full.shape or not torch.equal(gathered, full):
            failures.append(f"ring_all_gather, {dtype_name}, length {length}")
    x = torch.ones(1024, device=device)
    with comm.Ledger() as ledger:
        functions.ring_all_gather(functions.ring_reduce_scatter(x))
    return {"failures": failures, "ledger": ledger.records}


# ----------------------------------------------------------------------------- training


def train_strategies(configs: list) -> list:
    """Train several `TrainConfig`s one after the other in one launch (saves start-ups):
    each is what `train.run(config)` would return for this rank."""
    from shardlab.train import train_worker
    return [train_worker(config) for config in configs]


def measure_link(sizes: tuple[int, ...] = (2**12, 2**16, 2**20),
                 repeats: int = 3) -> comm.Link:
    """This machine's link as the α-β model sees it: (α, β) fitted to all-gathers over all
    ranks (`time_collectives`, `fit_alpha_beta`), rank 0's fit on every rank, so that a
    throttle built on it sleeps the same on all of them."""
    alpha, beta = comm.fit_alpha_beta(time_collectives(["all_gather"], list(sizes), repeats))
    agreed = [(alpha, beta)]
    dist.broadcast_object_list(agreed, src=0)
    return comm.Link(*agreed[0])


def train_across_nodes(runs: list[tuple], ranks_per_node: int,
                       fast: comm.Link | None = None) -> tuple[comm.Link, list]:
    """Train each (`TrainConfig`, factor) as if the ranks were nodes of `ranks_per_node`
    whose link between them is `factor` times slower than `fast` (α and 1/β both; this
    machine's, measured by `measure_link`, unless given): a SIMULATION on one machine
    (`shardlab.comm.links`): every collective of a group labelled "inter-node" sleeps the
    extra α-β time of its ring after it completes. Returns (fast, the reports).

    HSDP labels its own groups (shard: intra-node, replicate: inter-node). Any other
    strategy over more ranks than a node holds runs on rings that span nodes, whose pace
    is their slowest hop: its group of all ranks is labelled "inter-node" for that run."""
    from shardlab.train import train_worker

    fast = fast or measure_link()
    reports = []
    for config, factor in runs:
        spans = not card(config.strategy).labels_own_links and config.world > ranks_per_node
        comm.label_link(None, comm.INTER if spans else comm.UNLABELLED)
        comm.throttle_link(comm.INTER, fast.alpha * (factor - 1), (factor - 1) / fast.beta)
        try:
            reports.append(train_worker(config))
        finally:
            comm.unthrottle_link(comm.INTER)
            comm.label_link(None, comm.UNLABELLED)
    return fast, reports


def run_all(calls: list[tuple]) -> list:
    """Run several workers, `(function, args)` pairs, one after the other in one launch.

    Each launch pays for starting the ranks (a few seconds: every rank imports torch), so
    a page that needs several runs asks for them together.
    """
    return [function(*args) for function, args in calls]


def on_simulated_network(network: comm.SimulatedNetwork, function, *args):
    """Run the worker `function(*args)` with every native collective on the simulated
    `network` (a SIMULATION: `shardlab.comm.links`), e.g. a timeline of one step whose
    collectives run on a network apart from the cores."""
    with comm.simulated_network(network):
        return function(*args)


# ----------------------------------------------------------------------------- step time

MACHINE_SIZES = [4_096, 65_536, 1_048_576, 4_194_304]  # bytes, for the α-β fit
# the kinds of collective the course's strategies and PyTorch's call in a step
IN_STEP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def measure_machine(models: dict[str, tuple[str, dict | None]], batch_size: int = 8,
                    seq_len: int = 32, repeats: int = 5,
                    strategies: list[str] | None = None) -> dict:
    """Run on every rank: this machine as the step-time model sees it, one
    `steptime.Machine` per entry of `models` ({label: (model name, its config)}), every
    figure measured with all ranks working at once, each by a micro-benchmark of its own,
    never from a step of a strategy: the rate of the model's own forward and backward on
    this rank's rows of a batch, AdamW's costs per element, per tensor and per DTensor
    (`stepparts.optimizer_costs`), how much of an all-reduce compute hides, how much
    each kind of collective's cost inside a step (`stepparts.collective_costs_in_step`),
    α and β fitted to all-reduces and all-gathers, the own work per parameter tensor
    of each of `strategies` (`probes.strategy_work`; every strategy with a schedule
    when None), and the training loop's own work a step and its ledger's a collective
    (`probes.loop_costs`, for a run of `batch_size` and `seq_len`)."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    from shardlab.config import TrainConfig
    from shardlab.models import build_model, get_batch, loss_fn
    from shardlab.probes import loop_costs, strategy_work
    from shardlab.stepparts import collective_costs_in_step, optimizer_costs
    from shardlab.rates import compute_rates, hiding_shares, slowest_rank
    from shardlab.steptime import Machine
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    x, y = (t.to(device) for t in get_batch(0, rank, world, batch_size, seq_len))
    # the hiding share's rounds are taken at three moments, between the other figures:
    # on a shared CPU rounds taken together agree with each other more than with later ones
    shares = hiding_shares(repeats=repeats, device=device)
    # every rank times its models together, in turn, a round at a time; a round counts
    # at its slowest rank's time, the pace of a synchronous step
    rates = compute_rates({label: build_model(name, 0, config).to(device)
                           for label, (name, config) in models.items()},
                          x, y, loss_fn, repeats=repeats, between=dist.barrier,
                          slowest=slowest_rank)
    dist.barrier()
    adam = optimizer_costs(repeats=repeats, device=device,
                           mesh=init_device_mesh(device.type, (world,)))
    shares += hiding_shares(repeats=repeats, device=device)
    in_step = collective_costs_in_step({kind: COLLECTIVES[kind] for kind in IN_STEP_KINDS},
                                       repeats=repeats, device=device)
    shares += hiding_shares(repeats=repeats, device=device)
    hiding = statistics.median(shares)
    records = time_collectives(["all_reduce", "all_gather"], MACHINE_SIZES, repeats,
                               typical=True)
    alpha, beta = comm.fit_alpha_beta(records)
    machine = Machine(flops=1.0, alpha=alpha, beta=beta, adam_seconds=adam.per_element,
                      hiding=hiding, gloo=dist.get_backend() == "gloo",
                      adam_tensor_seconds=adam.per_tensor,
                      dtensor_tensor_seconds=adam.per_dtensor, in_step=in_step)
    if strategies is None:  # every strategy the time model has a schedule for
        strategies = [name for name, c in CARDS.items()
                      if c.schedule is not None and not c.one_process]
    per_tensor, per_unit = strategy_work(strategies, machine, repeats=repeats)
    loop = loop_costs(TrainConfig(world=world, batch_size=batch_size, seq_len=seq_len),
                      repeats=repeats)
    machine = replace(machine, strategy_work=per_tensor, unit_work=per_unit,
                      loop_seconds=loop.per_step, ledger_seconds=loop.per_collective)
    return {label: replace(machine, flops=rate) for label, rate in rates.items()}


def optimizer_layouts(strategies: list[str], model: str = "gpt-tiny") -> dict:
    """Run on every rank: for each strategy, the tensors its optimizer steps on this rank
    once the model is wrapped (elements of each, DTensors or not), what the time model's
    layouts (`stepparts.stepped_tensors`) must list; and, measured small, AdamW's costs over
    this world's mesh, each kind of collective inside a step, two strategies' own work and
    the loop's; and what `rates.slowest_rank` makes of rank r's r + 1 seconds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from shardlab.config import TrainConfig
    from shardlab.models import build_model
    from shardlab.optimizers import OptimizerSpec, inner_optimizer
    from shardlab.precision import get_precision
    from shardlab.probes import loop_costs, strategy_work
    from shardlab.rates import slowest_rank
    from shardlab.stepparts import collective_costs_in_step, optimizer_costs
    from shardlab.steptime import Machine
    from shardlab.strategy import get_strategy
    device = _device()
    out = {}
    for name in strategies:
        wrapped = get_strategy(name)(build_model(model, 0).to(device), get_precision("fp32"),
                                     OptimizerSpec(torch.optim.AdamW, {"lr": 1e-3}), {})
        stepped = [p for g in inner_optimizer(wrapped.optimizer).param_groups
                   for p in g["params"]]
        out[name] = ([(p.to_local() if isinstance(p, DTensor) else p).numel()
                      for p in stepped], {isinstance(p, DTensor) for p in stepped})
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    out["costs"] = optimizer_costs(numel=1 << 12, pieces=8, repeats=1, device=device,
                                   mesh=mesh)
    out["in_step"] = collective_costs_in_step(
        {kind: COLLECTIVES[kind] for kind in IN_STEP_KINDS}, sizes=(1 << 10, 1 << 14),
        repeats=1, device=device)
    machine = Machine(flops=1.0, alpha=0.0, beta=1e9, adam_seconds=0.0, hiding=0.0,
                      in_step=out["in_step"])
    out["work"] = strategy_work(["ddp", "torch-fsdp2"], machine, repeats=1)
    out["loop"] = loop_costs(TrainConfig(world=dist.get_world_size(), batch_size=4,
                                         seq_len=8), repeats=1, calls=4)
    out["slowest"] = slowest_rank(float(dist.get_rank() + 1))
    return out
