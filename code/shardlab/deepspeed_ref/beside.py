"""A worker for the ZeRO chapter and lab 5: each stage by its three implementations,
the course's, PyTorch's and DeepSpeed's, trained side by side, and the table of them.

Run by `shardlab.launch.launch` on every rank, so it lives in the package (spawned ranks
import it by name); apart from the strategies because it only drives and measures them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from shardlab.cards import DEEPSPEED, card
from shardlab.deepspeed_ref.predict import predicted_state_bytes
from shardlab.launch.devices import rank_device
from shardlab.models import build_model
from shardlab.precision import get_precision


def beside_deepspeed(strategies: list[str], model: str = "gpt-tiny", steps: int = 5,
                     batch_size: int = 8, seq_len: int = 32, precision: str = "fp32",
                     options: dict[str, dict] | None = None) -> list[dict]:
    """Run on every rank (with `shardlab.launch.launch`): train each strategy `steps` steps
    of AdamW on the same data with the course's loop, and return for each what a table of
    "ours, PyTorch's, DeepSpeed's" shows: the global-batch losses, the bytes this rank
    holds after the last step (DeepSpeed's predicted bytes beside them for its stages),
    the peak of the last step, the collectives of a step (calls and bytes by operation,
    steps after the first) and the median step time (first and last left out)."""
    import statistics
    import time

    from shardlab.comm.ledger import Ledger
    from shardlab.measure import track_peak
    from shardlab.models import get_batch
    from shardlab.optimizers import optimizer_spec
    from shardlab.step import NOTHING, HeldAfterStep, train_step
    from shardlab.strategy import get_strategy

    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    results = []
    for strategy in strategies:
        torch.manual_seed(0)
        net = build_model(model, 0).to(device)
        psi = sum(p.numel() for p in net.parameters() if p.requires_grad)
        wrapped = get_strategy(strategy)(net, get_precision(precision),
                                         optimizer_spec("adamw", 1e-3),
                                         dict((options or {}).get(strategy, {})))
        losses, times, peak = [], [], None
        states = HeldAfterStep(wrapped)  # counted in the last step only
        with Ledger() as ledger:
            for step in range(steps):
                x, y = (t.to(device) for t in get_batch(step, rank, world, batch_size,
                                                         seq_len))
                last = step == steps - 1
                dist.barrier()  # start together: a step's time is the schedule's
                start = time.perf_counter()
                with (track_peak(*wrapped.holders()) if last
                      else contextlib.nullcontext()) as peak:
                    loss = train_step(wrapped, [(x, y)], watch=states if last else NOTHING)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                losses.append(loss)
                ledger.mark_step()
        per_step: dict[str, dict[str, float]] = {}
        for record in ledger.records:
            if 0 < record.step < steps:
                op = per_step.setdefault(record.op, {"calls": 0, "logical_bytes": 0,
                                                     "sent_bytes": 0})
                op["calls"] += 1 / (steps - 1)
                op["logical_bytes"] += record.logical_bytes / (steps - 1)
                op["sent_bytes"] += record.sent_bytes / (steps - 1)
        mean_losses = torch.stack(losses)
        dist.all_reduce(mean_losses)
        # each stage by its implementations: the course's, PyTorch's (none of stage 2:
        # FSDP shards the parameters too; its stage 3 is `fully_shard`), DeepSpeed's
        stage = card(strategy).zero_stage
        results.append({
            "strategy": strategy, "stage": stage, "world": world, "psi": psi,
            "losses": (mean_losses / world).tolist(), "state_bytes": states.held,
            "predicted_bytes": (predicted_state_bytes(build_model(model, 0), stage, world,
                                                      precision, "adamw",
                                                      (options or {}).get(strategy))
                                if card(strategy).family == DEEPSPEED else None),
            "peak_bytes": int(peak.bytes), "collectives": per_step,
            "step_seconds": statistics.median(times[1:-1] if steps > 2 else times),
        })
    return results


def side_by_side_table(results: list[dict]) -> str:
    """`beside_deepspeed`'s results (one rank's) as a text table, one line a strategy."""
    mib = 2**20
    head = (f"{'stage':>5} {'strategy':<16} {'last loss':>9} {'params MiB':>10} "
            f"{'grads MiB':>9} {'optim MiB':>9} {'peak MiB':>8} {'sent MiB/step':>13} "
            f"{'step ms':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        held = r["state_bytes"]
        sent = sum(op["sent_bytes"] for op in r["collectives"].values())
        lines.append(f"{r['stage'] or '-':>5} {r['strategy']:<16} {r['losses'][-1]:>9.4f} "
                     f"{held['params'] / mib:>10.3f} {held['grads'] / mib:>9.3f} "
                     f"{held['optimizer'] / mib:>9.3f} {r['peak_bytes'] / mib:>8.3f} "
                     f"{sent / mib:>13.3f} {1e3 * r['step_seconds']:>7.1f}")
    return "\n".join(lines)
