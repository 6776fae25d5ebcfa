"""A worker for the FSDP2 chapter and lab 6: one step of each strategy, looked inside.

Run by `shardlab.launch.launch` on every rank, so it lives in the package (spawned ranks
import it); apart from the strategies because it only reads them, and it pulls in what a
reader of `fully_shard` does not need (PyTorch's `CommDebugMode`, the models, the loop).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from shardlab.comm.ledger import simulated_network
from shardlab.launch.devices import rank_device


def step_probe(cases: list[dict], steps: int = 4, batch_size: int = 8, seq_len: int = 32
               ) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): for each case
    {strategy, options, model, precision, batch_size (the global batch, if not
    `batch_size`), simulated_network (a `comm.SimulatedNetwork` to run the steps on)},
    train `steps` steps and look inside the last:
    PyTorch's own count of the c10d collectives it ran (`CommDebugMode`, which sees ours and
    `fully_shard`'s alike), the timeline of our schedule (ours only: each unit's
    `shardlab.trace.Event`s, t in seconds from the step's start, in order), the step times,
    the losses, and the parameters as the module shows them (name, shape, dtype)."""
    import time

    from torch.distributed.tensor.debug import CommDebugMode

    from shardlab.models import build_model, get_batch
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.step import train_step
    from shardlab.strategy import get_strategy
    from shardlab.trace import relative_to, tracing

    import warnings

    # CommDebugMode's module tracker warns that a full backward hook fires without inputs
    # that need a gradient (token ids); under it PyTorch's FSDP2 also warns that the
    # model's output is a view. Neither concerns this loop, which never edits the output.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for case in cases:
        model = build_model(case.get("model", "gpt-tiny"), seed=0).to(rank_device())
        wrapped = get_strategy(case["strategy"])(
            model, get_precision(case.get("precision", "fp32")), optimizer_spec("adamw", 1e-3),
            dict(case.get("options", {})))
        shown = [(n, tuple(p.shape), str(p.dtype).replace("torch.", ""))
                 for n, p in wrapped.model.named_parameters()]
        losses, times, counts, events = [], [], {}, []
        with simulated_network(case.get("simulated_network")):
            for step in range(steps):
                x, y = (t.to(rank_device()) for t in get_batch(
                    step, rank, world, case.get("batch_size", batch_size), seq_len))
                last = step == steps - 1
                counter = CommDebugMode() if last else contextlib.nullcontext()
                tracer = tracing() if last else contextlib.nullcontext()
                dist.barrier()
                with counter, tracer as recorded:
                    start = time.perf_counter()
                    loss = train_step(wrapped, [(x, y)])
                    times.append(time.perf_counter() - start)
                losses.append(loss.item())
                if last:
                    counts = {str(op).split(".")[-1]: n
                              for op, n in counter.get_comm_counts().items()}
                    events = relative_to(recorded, start)
        results.append({"case": case, "losses": losses, "step_times": times,
                        "collectives": counts, "events": sorted(events), "shown": shown})
    return results
