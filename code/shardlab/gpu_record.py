"""What a GPU run recorded, read back: the device and the date it ran on, and its results.

A GPU is at hand only sometimes. `tools/gpu_check.py` runs the course's GPU checks in one
command and writes one JSON file; committed as `shardlab/data/gpu-check.json` (package
data, so a notebook opened on Colab, with no checkout, finds it too), it is what the
course's GPU sections show. With no file they say so in one line (`NO_RECORD`) instead of
asserting an outcome no run has shown, and a record of the check's dry run on a CPU is
never shown as a GPU's.

The memory experiment is described here, as plain data, because three places run or read
it: the check records it, chapter 8 shows the record or runs it live on a GPU, and the
check's dry run on a CPU runs it small. `MemoryExperiment.runs()` are the runs,
`memory_run` turns each one's rank summaries (`rank_summary`) into what the record holds
(each peak beside the planner's prediction, `shardlab.memory.plan`), and `memory_rows`
into a table. `peak_parts` reads `tools/gpu_peak.py`'s replay of the allocator at the
peak (`shardlab/data/gpu-peak.json`) in the planner's terms. The other `*_rows` build the
tables of chapter 9's GPU section.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardlab import hardware, memory
from shardlab.models import GPT_CONFIGS
from shardlab.report import RunReport, ledger_totals, median_step_time
from shardlab.units import MiB

RECORD_PATH = Path(__file__).parent / "data" / "gpu-check.json"
NO_RECORD = "no GPU run recorded yet: run tools/gpu_check.py on a GPU"
PEAK_PATH = Path(__file__).parent / "data" / "gpu-peak.json"
NO_PEAK = "no replay of a GPU's peak recorded yet: run tools/gpu_peak.py on a GPU"
# `tools/gpu_peak.py`'s name for the blocks allocated with no Python frame on the stack
NO_FRAME = "(no Python frame: made by the C++ side)"


# ----------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class GpuRecord:
    """One run of `tools/gpu_check.py`: `data` is its JSON file as written."""

    path: Path
    data: dict[str, Any]

    @property
    def dry_run(self) -> bool:
        return bool(self.data.get("dry_run"))

    @property
    def device(self) -> str:
        return self.data.get("device", {}).get("name") or "an unknown device"

    @property
    def date(self) -> str:
        return (self.data.get("started") or "an unknown date")[:10]

    def header(self) -> str:
        """Where and when it ran, in one line: what a page prints above its figures."""
        d = self.data.get("device", {})
        versions = ", ".join(f"{name} {d[key]}" for name, key in
                             (("torch", "torch"), ("CUDA", "cuda"), ("NCCL", "nccl"))
                             if d.get(key))
        kind = "dry run on the CPU" if self.dry_run else "recorded"
        return f"{kind} on {self.device} on {self.date} ({versions})"

    def item(self, name: str) -> dict[str, Any] | None:
        """An item's result (partial if it ran out of time), or None if it has none."""
        entry = self.data.get("items", {}).get(name) or {}
        return entry.get("result")

    def status(self, name: str) -> str:
        entry = self.data.get("items", {}).get(name) or {}
        status = entry.get("status", "not run")
        return status if not entry.get("error") else f"{status}: {entry['error']}"


def load_record(path: str | Path | None = None) -> GpuRecord | None:
    """The record at `path` (the committed one by default), or None if there is none. A
    file that is there but is not a record is refused in one line."""
    path = Path(path) if path is not None else RECORD_PATH
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not a GPU check's JSON ({exc}): write it again with "
                         f"tools/gpu_check.py") from None
    if not isinstance(data, dict) or "items" not in data:
        raise ValueError(f"{path} holds no 'items': not a file tools/gpu_check.py wrote")
    return GpuRecord(path, data)


def gpu_record(path: str | Path | None = None) -> GpuRecord | None:
    """The record a page shows: a GPU's run, never the CPU dry run's."""
    record = load_record(path)
    return record if record is not None and not record.dry_run else None


def rank_summary(report: RunReport) -> dict[str, Any]:
    """What the record keeps of one rank's run: plain numbers, as JSON holds them."""
    totals = ledger_totals(report)
    return {"rank": report.rank, "placement": report.placement, "psi": report.psi,
            "losses": list(report.losses),
            "state_bytes": int(sum(report.state_bytes.values())),
            "peak": {k: int(v) for k, v in report.peak.items()},
            "calls_per_step": totals["calls"],
            "logical_bytes_per_step": totals["logical_bytes"],
            "sent_bytes_per_step": totals["sent_bytes"],
            "step_times": list(report.step_times),
            "median_step_s": median_step_time(report) if report.step_times else None,
            "memory_limit_crossing": report.memory_limit_crossing}


# ----------------------------------------------------------------------------- memory


# GPT-2 small's shapes (12 layers of width 768, 12 heads, 1,024 positions, 50,257 tokens,
# tied head) in the course's GPT: the same parameters, 124,439,808, as the planner's
# `gpt2-small`. The corpus is bytes, so only the first 256 rows of the embedding see a
# token; the memory does not care which rows do.
GPT2_SMALL_SHAPES = {"n_layer": 12, "n_head": 12, "d_model": 768, "block_size": 1024,
                     "vocab_size": 50257}


@dataclass(frozen=True)
class MemoryExperiment:
    """DDP and ZeRO-1/2/3 and FSDP2, each without and with recomputation (each block's
    activations rebuilt in backward: the planner's "full"), on `world` ranks sharing one
    GPU; and where DDP runs out of memory under a cap per process."""

    model: str = "gpt-small"
    model_config: dict[str, int] | None = field(default_factory=lambda: dict(GPT2_SMALL_SHAPES))
    world: int = 4
    precision: str = "bf16-mixed"
    batch_size: int = 8          # global: batch_size / world rows per rank
    seq_len: int = 1024
    steps: int = 3               # the last is tracked: optimizer states exist by then
    strategies: tuple[tuple[str, int], ...] = (("ddp", 0), ("zero1", 1), ("zero2", 2),
                                               ("zero3", 3), ("fsdp2", 3))
    oom_strategy: str = "ddp"
    oom_cap_bytes: int = 6 * 2**30   # per process, by set_per_process_memory_fraction

    def runs(self) -> list[dict[str, Any]]:
        """Each run's strategy, ZeRO stage and recomputation, in the order they run."""
        return [{"strategy": s, "stage": stage, "recompute": r}
                for s, stage in self.strategies for r in (False, True)]

    def train_fields(self) -> dict[str, Any]:
        """The fields of a `TrainConfig` every run shares."""
        return {"world": self.world, "model": self.model,
                "model_config": dict(self.model_config or {}) or None,
                "precision": self.precision, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "steps": self.steps}

    def planner_model(self) -> memory.ModelConfig:
        """The course's GPT at these settings, as the planner counts it (GPT-2's layer:
        LayerNorms, biases, a GELU MLP of 4 x the width, a tied head)."""
        cfg = dataclasses.replace(GPT_CONFIGS[self.model], **(self.model_config or {}))
        return memory.ModelConfig(f"{self.model} {cfg.n_layer}x{cfg.d_model}", "gpt2",
                                  cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head,
                                  4 * cfg.d_model, cfg.vocab_size, tied=True,
                                  positions=cfg.block_size)

    def predicted(self, stage: int, recompute: bool, rows_per_rank: int | None = None,
                  memory_bytes: int = 80 * 2**30) -> memory.PlanRow:
        """The planner's row for one run (no offload; ours do not prefetch by default)."""
        rows = memory.plan(self.planner_model(), memory_bytes, self.world,
                           batch=rows_per_rank or self.batch_size // self.world,
                           seq=self.seq_len, precision=self.precision, prefetch=False)
        policy = "full" if recompute else "none"
        return next(r for r in rows if r.stage == stage and r.checkpointing == policy
                    and r.offload == "none")

    def predicted_largest_batch(self, limit: int = 4096) -> int:
        """The most rows per rank the planner fits under `oom_cap_bytes` for DDP (stage 0,
        no recomputation): 0 if not even one."""
        stage = dict(self.strategies)[self.oom_strategy]
        rows = 0  # the prediction grows with the rows: stop at the first that does not fit
        while rows < limit and self.predicted(stage, False, rows + 1).total <= self.oom_cap_bytes:
            rows += 1
        return rows


def _plan_dict(row: memory.PlanRow) -> dict[str, int]:
    return {"states": int(row.states.total), "activations": int(row.activations),
            "gathered": int(row.gathered), "total": int(row.total)}


def memory_run(experiment: MemoryExperiment, run: dict[str, Any],
               ranks: list[dict[str, Any]] | None, error: str | None = None) -> dict[str, Any]:
    """One run as the record holds it: each rank's peaks (from `rank_summary`) beside the
    planner's row."""
    out = {**run, "status": "ok" if ranks else "failed", "error": error,
           "predicted": _plan_dict(experiment.predicted(run["stage"], run["recompute"]))}
    if ranks:
        out["psi"] = ranks[0]["psi"]
        out["peak_allocated"] = [r["peak"].get("total", 0) for r in ranks]
        out["peak_reserved"] = [r["peak"]["reserved"] for r in ranks
                                if "reserved" in r["peak"]] or None
        out["state_bytes"] = [r["state_bytes"] for r in ranks]
        # CUDA bytes still allocated when the run began (earlier runs' leftovers, which
        # its peak counts too): None on a CPU
        out["allocated_before"] = [r.get("allocated_before") for r in ranks]
    return out


def memory_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the experiment's table: the highest rank's peaks in MiB beside
    the planner's prediction, and peak allocated over predicted."""
    rows = []
    for run in result.get("runs", []):
        name = f"{run['strategy']}{', recomputed' if run['recompute'] else ''}"
        predicted = run["predicted"]["total"]
        if run.get("status") != "ok":
            rows.append([name, run.get("status", "?"), "–", f"{predicted / MiB:,.1f}", "–"])
            continue
        peak = max(run["peak_allocated"])
        reserved = max(run["peak_reserved"]) if run.get("peak_reserved") else None
        rows.append([name, f"{peak / MiB:,.1f}",
                     "–" if reserved is None else f"{reserved / MiB:,.1f}",
                     f"{predicted / MiB:,.1f}", f"{peak / predicted:.2f}"])
    return (["run", "peak allocated, MiB", "peak reserved, MiB", "planner, MiB",
             "allocated / planner"], rows)


def oom_summary(oom: dict[str, Any]) -> str:
    """DDP's out-of-memory point in one sentence."""
    def verdict(fits):
        return {True: "fits", False: "fails"}.get(fits, "error")

    tried = ", ".join(f"{a['rows_per_rank']} {verdict(a['fits'])}" for a in oom["attempts"])
    if oom.get("largest_fit"):
        found = f"the most rows per rank that fit: {oom['largest_fit']}"
        if oom.get("first_failure"):
            found += f", and {oom['first_failure']} did not"
    elif oom.get("first_failure"):
        found = f"not even {oom['first_failure']} rows per rank fit"
    else:
        found = "no try ended in a fit or an out-of-memory error"
    return (f"{oom['strategy']} on {oom['world']} ranks under a cap of "
            f"{oom['cap_bytes'] / MiB:,.1f} MiB per process ({oom['how']}), rows of "
            f"{oom['seq_len']} tokens: {found} (the planner: {oom['predicted_largest']}); "
            f"tried {tried or 'nothing'}")


# ----------------------------------------------------------------------------- step time


def datasheet_bf16_peak(name: str) -> tuple[float | None, str]:
    """The dense bf16 peak `shardlab.hardware` holds for a device of this name, and its
    source; None (and why) for a device it has no figure for. The H100 and H200 SXM
    share one figure; the PCIe and NVL boards are slower and have none here."""
    if ("H100" in name or "H200" in name) and not ("PCIe" in name or "NVL" in name):
        figure = hardware.FIGURES["h100_bf16_flops"]
        note = ("; NVIDIA's H200 datasheet gives the H200 SXM the same bf16 rate"
                if "H200" in name else "")
        return figure.value, figure.source + note
    return None, f"shardlab.hardware has no datasheet figure for {name!r}"


def matmul_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The GEMM rates reached, in TFLOP/s, and the share of the datasheet's bf16 peak."""
    peak = result.get("datasheet_bf16_flops")
    rows = [[f"{g['n']} x {g['n']} x {g['n']} matmul, {g['dtype']}",
             f"{g['flops_per_s'] / 1e12:,.1f}",
             f"{g['flops_per_s'] / peak:.0%}" if peak else "–"] for g in result["gemms"]]
    rows.append([f"{result['model']}'s own matmuls, {result['tokens']} tokens (MFU's "
                 f"denominator)", f"{result['model_matmul_flops_per_s'] / 1e12:,.2f}", "–"])
    rows.append([f"{result['model']}'s forward and backward (the step-time model's F)",
                 f"{result['model_forward_backward_flops_per_s'] / 1e12:,.2f}", "–"])
    return ["what", "TFLOP/s", "of the bf16 peak"], rows


def overlap_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The overlap tax: each traffic's time alone and beside the GEMMs, the GEMMs'
    alone and beside it, and the share of it that was hidden."""
    rows = []
    sharing = result.get("gloo_ranks_sharing") or {}
    for op, m in (sharing.get("median_over_ranks") or {}).items():
        where = "sharing the GPU" if sharing["device"] == "cuda" else "on the CPU"
        rows.append([f"{op}, gloo, {sharing['world']} ranks {where} (median rank)",
                     m["traffic_alone_s"], m["gemm_alone_s"], m["both_s"], m["gemm_tax"],
                     m["traffic_tax"], m["hiding"]])
    for name, m in (result.get("inside_the_gpu") or {}).items():
        if isinstance(m, dict):
            rows.append([f"{name} on a second stream, inside the GPU", m["traffic_alone_s"],
                         m["gemm_alone_s"], m["both_s"], m["gemm_tax"], m["traffic_tax"],
                         m["hiding"]])
    table = [[r[0], *(f"{1e3 * x:,.2f}" for x in r[1:4]), *(f"{x:+.0%}" for x in r[4:6]),
              f"{r[6]:.2f}"] for r in rows]
    return ["traffic", "alone, ms", "GEMMs alone, ms", "both, ms", "GEMMs slowed by",
            "traffic slowed by", "hiding"], table


def ratio_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Our step time over PyTorch's, per strategy and world, with the range over the
    interleaved repetitions."""
    rows = []
    for world, w in result["worlds"].items():
        for ours, r in w["ratios"].items():
            if r["ratio"] is None:
                rows.append([ours, r["reference"], f"{world} ({w['backend']})", "–", "–",
                             w["errors"].get(ours) or w["errors"].get(r["reference"], "–")])
                continue
            rows.append([ours, r["reference"], f"{world} ({w['backend']})",
                         f"{r['ours_ms']:,.1f} / {r['reference_ms']:,.1f}",
                         f"{r['ratio']:.2f}", f"{r['min']:.2f}–{r['max']:.2f}"])
    return ["ours", "PyTorch's", "ranks", "step ms, ours / theirs", "ratio",
            "range over repetitions"], rows


# ----------------------------------------------------------------------------- the peak


def peak_record(path: str | Path | None = None) -> dict[str, Any] | None:
    """`tools/gpu_peak.py`'s record (the committed one by default), or None."""
    path = Path(path) if path is not None else PEAK_PATH
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass(frozen=True)
class PeakParts:
    """The bytes alive at one run's peak, in the planner's terms. `states`: the model
    states the run itself counted; `activations`: blocks the model's forward made (its
    lines in `shardlab/models.py`) but the loss; `loss`: cross-entropy's fp32
    log-probabilities; `backward`: blocks allocated with no Python frame on the stack,
    which on a GPU is the autograd engine's own thread running backward
    (`torch/csrc/autograd/engine.cpp` gives each device a thread); `rest`: the peak less
    all of these (the cuBLAS workspace, the batch)."""

    peak: int
    states: int
    activations: int
    loss: int
    backward: int

    @property
    def rest(self) -> int:
        return self.peak - self.states - self.activations - self.loss - self.backward


def peak_parts(run: dict[str, Any]) -> PeakParts:
    """One run of the peak record, in the planner's terms (`PeakParts`)."""
    groups = run["groups"]
    loss = sum(v for k, v in groups.items() if "cross_entropy" in k)
    forward = sum(v for k, v in groups.items()
                  if k.startswith("shardlab/models.py") and "cross_entropy" not in k)
    return PeakParts(run["replayed_peak"], sum(run["state_bytes"].values()), forward, loss,
                     groups.get(NO_FRAME, 0))


__all__ = ["RECORD_PATH", "PEAK_PATH", "NO_PEAK", "peak_record", "PeakParts", "peak_parts", "NO_RECORD", "GpuRecord", "load_record", "gpu_record",
           "rank_summary", "GPT2_SMALL_SHAPES", "MemoryExperiment", "memory_run",
           "memory_rows", "oom_summary", "datasheet_bf16_peak", "matmul_rows", "overlap_rows", "ratio_rows"]
