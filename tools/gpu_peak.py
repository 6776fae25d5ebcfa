"""What is alive at a GPU step's peak: the CUDA allocator's history, replayed.

    PYTHONPATH=code python tools/gpu_peak.py --out gpu-peak.json      # on a GPU

The memory experiment of `tools/gpu_check.py` puts each rank's `max_memory_allocated`
beside the planner's total; this says what the difference is made of. It trains the same
model, rows and precision on one rank for each strategy named, with PyTorch's allocator
history on (`torch.cuda.memory._record_memory_history`, Python frames only), replays the
history (`live_at_peak`) to the moment the most bytes were allocated, and groups the
blocks alive then by the course's line that asked for them and the innermost frame
(`torch.nn.functional.cross_entropy`, say). It records the peak, each group's bytes, and
the model-state bytes the run reports. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def frame_name(frame: dict) -> str:
    """`path/after/site-packages-or-code:line function`, short enough to read."""
    path = frame.get("filename", "?")
    for cut in ("site-packages/", "/code/", "/tools/"):
        if cut in path:
            path = path.split(cut, 1)[1]
            break
    return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}"


def owner(frames: list[dict]) -> str:
    """Who asked for a block: the innermost frame of the course's package, and the
    innermost frame of all (frames run innermost first, as the allocator records them)."""
    if not frames:
        return "(no Python frame: made by the C++ side)"
    ours = next((f for f in frames if "shardlab/" in f.get("filename", "")), None)
    inner = frame_name(frames[0])
    return inner if ours is None or ours is frames[0] else f"{frame_name(ours)} <- {inner}"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[str, int]]:
    """Replay one device's allocator events: (the most bytes allocated at once, bytes
    alive at that moment grouped by `owner`). A block counts from its `alloc` to its
    `free_completed` (a block freed while a stream still uses it stays taken until then).
    Blocks allocated before the history began are not in it: their bytes are missing."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], owner(event.get("frames", [])))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    groups: Counter[str] = Counter()
    for size, who in at_peak.values():
        groups[who] += size
    return peak, dict(groups.most_common())


def record_one(config) -> dict:
    """One rank's run of `config` with the allocator's history on, replayed."""
    import torch

    from shardlab.train import train_worker

    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    report = train_worker(config)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, groups = live_at_peak(trace)
    return {"strategy": config.strategy, "events": len(trace),
            "last_step_peak": report.peak,
            "state_bytes": report.state_bytes, "replayed_peak": peak,
            "groups": {k: v for k, v in list(groups.items())[:25]}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-peak.json"))
    parser.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "fsdp2"])
    parser.add_argument("--rows", type=int, default=2, help="rows per rank")
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "code"), str(ROOT / "tools")]
    import torch

    import gpu_peak  # the ranks find `record_one` by this module's name, not __main__

    from shardlab.config import TrainConfig
    from shardlab.gpu_record import MemoryExperiment
    from shardlab.launch import launch

    if not torch.cuda.is_available():
        print("gpu_peak: no CUDA GPU here", file=sys.stderr)
        return 2
    exp = MemoryExperiment()
    fields = {**exp.train_fields(), "world": 1, "batch_size": args.rows}
    results = []
    for name in args.strategies:
        config = TrainConfig(strategy=name, record_ledger=False, **fields)
        [result] = launch(gpu_peak.record_one, 1, config, device="cuda", timeout=300)
        results.append(result)
        print(f"{name}: peak {result['replayed_peak'] / 2**30:.2f} GiB replayed, "
              f"{result['last_step_peak'].get('total', 0) / 2**30:.2f} GiB last step")
        for who, size in list(result["groups"].items())[:8]:
            print(f"  {size / 2**20:9.1f} MiB  {who}")
    args.out.write_text(json.dumps({"experiment": fields, "runs": results}, indent=1) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
