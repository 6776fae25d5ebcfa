"""The GPU check (`tools/gpu_check.py`) on the CPU: its dry run takes every code path but
CUDA's, so the one command a GPU machine runs cannot rot between GPU runs; and the course's
reader of its record (`shardlab.gpu_record`) reads what the dry run wrote.

One dry run (module fixture) serves every test here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardlab import gpu_record
from shardlab.cards import required_options
from shardlab.config import TrainConfig
from shardlab.memory import get_model
from shardlab.models import build_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402
import gpu_check_items  # noqa: E402

DRY = gpu_check_items.DRY


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "code")}
    done = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), done.stdout, out


def item(record: dict, name: str) -> dict:
    entry = record["items"][name]
    assert entry["status"] == "ok", (name, entry["status"], entry.get("error"))
    return entry["result"]


def test_the_dry_run_records_every_item_and_says_where(dry_run):
    record, stdout, out = dry_run
    assert record["dry_run"] is True and record["finished"]
    assert list(record["items"]) == [i.name for i in gpu_check.ITEMS]
    for name in record["items"]:
        item(record, name)
    assert f"results: {out}" in stdout
    device = record["device"]
    assert device["torch"] == torch.__version__ and device["gpus"] == 0
    assert {"name", "date", "cuda", "nccl", "python", "deepspeed", "commit"} <= set(device)


def test_every_strategy_case_records_losses_bytes_and_peaks(dry_run):
    record, _, _ = dry_run
    result = item(record, "strategies")
    cases = [c for c in result["cases"] if not c.get("rehearsed_failure")]
    expected = {(s, w, p) for w in DRY.worlds for s in DRY.strategies
                if not (s == "single" and w > 1) for p in DRY.precisions}
    assert {(c["strategy"], c["world"], c["precision"]) for c in cases} == expected
    psi = sum(p.numel() for p in build_model(DRY.model).parameters())
    for c in cases:
        assert c["status"] == "ok", c
        assert len(c["losses"]) == DRY.steps and all(math.isfinite(x) for x in c["losses"])
        assert len(c["peak_allocated"]) == c["world"] and min(c["peak_allocated"]) > 0
        assert c["peak_reserved"] is None  # the CUDA allocator's, absent on a CPU
        # DDP's ring all-reduce: 2Ψ(N-1)/N elements a rank sends per step
        if c["strategy"] == "ddp":
            width = 4 if c["precision"] == "fp32" else 2
            assert c["sent_bytes_per_step"] == 2 * psi * width * (c["world"] - 1) / c["world"]


def test_a_failing_case_is_recorded_and_the_cases_after_it_still_run(dry_run):
    record, _, _ = dry_run
    cases = item(record, "strategies")["cases"]
    failed = [i for i, c in enumerate(cases) if c.get("rehearsed_failure")]
    assert len(failed) == 1
    case = cases[failed[0]]
    assert case["status"] == "failed" and "crashed at step 1" in case["error"]
    assert case["error"].startswith(f"rank {case['world'] - 1}: ")
    after = [c for c in cases[failed[0] + 1:] if c["world"] == case["world"]]
    assert after and all(c["status"] == "ok" for c in after)  # in a new launch


def test_pytest_cuda_gives_each_test_its_outcome(dry_run):
    record, _, out = dry_run
    result = item(record, "pytest_cuda")
    assert result["returncode"] == 0 and len(result["outcomes"]) == 6
    for name, outcome in result["outcomes"].items():
        assert outcome["outcome"] == "skipped" and "no CUDA GPU here" in outcome["message"]
    assert result["counts"] == {"skipped": 6} and result["outcomes_from"] == "junit xml"
    # stopped before pytest writes its XML, the check reads its -v lines instead
    log = out.with_suffix(".log").read_text()
    assert {n: o["outcome"] for n, o in gpu_check_items.parse_verbose(log).items()} == \
        {n: o["outcome"] for n, o in result["outcomes"].items()}


def test_the_memory_experiment_puts_the_planner_beside_each_peak(dry_run):
    record, _, _ = dry_run
    result = item(record, "memory")
    exp = DRY.memory
    assert [(r["strategy"], r["recompute"]) for r in result["runs"]] == \
        [(r["strategy"], r["recompute"]) for r in exp.runs()]
    assert result["experiment"]["planner_psi"] == result["runs"][0]["psi"]
    for run in result["runs"]:
        assert run["status"] == "ok" and len(run["peak_allocated"]) == exp.world
        assert run["predicted"]["total"] == exp.predicted(run["stage"], run["recompute"]).total
        # what earlier runs left allocated: measured on CUDA only (the record's zeros there
        # say each peak is its own run's)
        assert run["allocated_before"] == [None] * exp.world
    oom = result["oom"]
    assert oom["predicted_largest"] == exp.predicted_largest_batch() and oom["attempts"]
    for attempt in oom["attempts"]:  # on a CPU, "fits" is the memory watch's verdict
        assert attempt["fits"] is (attempt["error"] is None)
        assert attempt["fits"] is (max(attempt["peak_allocated"]) <= oom["cap_bytes"])
    if oom["largest_fit"] and oom["first_failure"]:
        assert oom["largest_fit"] < oom["first_failure"]


def test_the_overlap_tax_and_the_step_time_ratios(dry_run):
    record, _, _ = dry_run
    overlap = item(record, "overlap")
    sharing = overlap["gloo_ranks_sharing"]
    assert len(sharing["ranks"]) == sharing["world"] == max(DRY.worlds)
    assert set(sharing["median_over_ranks"]) == {"all_gather", "reduce_scatter"}
    assert 0 <= overlap["hiding_for_steptime"] == sharing["machine"]["hiding"] <= 1
    assert overlap["inside_the_gpu"] == {"skipped": "needs CUDA streams"}
    ratios = item(record, "step_ratios")["worlds"]
    for world in DRY.ratio_worlds:
        for ours, r in ratios[str(world)]["ratios"].items():
            assert r["reference"] == gpu_check_items.REFERENCES[ours] and r["ratio"] > 0
            assert len(ratios[str(world)]["step_seconds"][ours]) == DRY.ratio_reps
    matmul = item(record, "matmul")
    assert [g["dtype"] for g in matmul["gemms"]] == ["bfloat16", "float32"]
    assert matmul["datasheet_bf16_flops"] is None  # a CPU has no datasheet figure here


def test_the_course_reads_a_record_and_says_so_without_one(dry_run, tmp_path):
    _, _, out = dry_run
    assert gpu_record.load_record(tmp_path / "none.json") is None
    assert gpu_record.NO_RECORD == "no GPU run recorded yet: run tools/gpu_check.py on a GPU"
    dry = gpu_record.load_record(out)
    assert dry.dry_run and gpu_record.gpu_record(out) is None  # never shown as a GPU's
    assert dry.header().startswith("dry run on the CPU on CPU")
    # the same file as a GPU's would read: every table of chapters 8 and 9 renders from it
    data = json.loads(out.read_text())
    data["dry_run"] = False
    (tmp_path / "gpu.json").write_text(json.dumps(data))
    record = gpu_record.gpu_record(tmp_path / "gpu.json")
    assert record.header().startswith(f"recorded on {data['device']['name']} on "
                                      f"{data['started'][:10]} (torch {torch.__version__}")
    header, rows = gpu_record.memory_rows(record.item("memory"))
    assert len(rows) == len(DRY.memory.runs()) and all(len(r) == len(header) for r in rows)
    assert "the planner: " in gpu_record.oom_summary(record.item("memory")["oom"])
    for name, table in (("matmul", gpu_record.matmul_rows), ("overlap", gpu_record.overlap_rows),
                        ("step_ratios", gpu_record.ratio_rows)):
        header, rows = table(record.item(name))
        assert rows and all(len(r) == len(header) for r in rows), name
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a GPU check's JSON"):
        gpu_record.load_record(tmp_path / "bad.json")


def test_the_memory_experiment_is_gpt2_small_as_the_planner_counts_it():
    exp = gpu_check_items.GPU.memory
    with torch.device("meta"):  # shapes only
        model = build_model(exp.model, config=exp.model_config)
    psi = sum(p.numel() for p in model.parameters())
    assert psi == exp.planner_model().num_params() == get_model("gpt2-small").num_params()
    # the planner's largest micro-batch under the cap is the one that still fits it
    rows = exp.predicted_largest_batch()
    assert exp.predicted(0, False, rows).total <= exp.oom_cap_bytes \
        < exp.predicted(0, False, rows + 1).total


def test_every_strategy_the_gpu_runs_is_configured_as_it_accepts():
    """The dry run trains two strategies; the GPU trains every one of the registry, each
    with the options `cards.required_options` gives it. Each such config must pass the checks made
    before any rank starts, or the GPU run records a refusal where it should record a
    run (the first GPU run gave ZeRO++ HSDP's `shard_group`)."""
    names, _ = gpu_check_items.strategy_names(gpu_check_items.GPU)
    assert len(names) >= 14
    for world in gpu_check_items.GPU.worlds:
        for name in names:
            if name == "single" and world > 1:
                continue
            config = TrainConfig(strategy=name, world=world, model=gpu_check_items.GPU.model,
                                 options=required_options(name, world))
            config.validate()  # raises ValueError, as launch_cases records it


def test_the_committed_record_is_a_gpu_run():
    """The course shows what is committed: a dry run on a CPU must never be committed."""
    record = gpu_record.load_record()
    if record is None:
        pytest.skip(f"no record committed ({gpu_record.NO_RECORD})")
    assert not record.dry_run and record.data["device"].get("gpus", 0) >= 1


def test_an_item_that_fails_or_no_longer_fits_is_recorded_and_the_next_runs(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(gpu_check, "ITEMS", [
        gpu_check.Item("no-such-item", 30, 30), gpu_check.Item("late", 30, 30, least=1e6),
        gpu_check.Item("env", 60, 60)])
    out = tmp_path / "check.json"
    record = gpu_check.run_check(out, 120, True, ["no-such-item", "late"])
    assert json.loads(out.read_text()) == record
    failed, late = (record["items"][n] for n in ("no-such-item", "late"))
    assert failed["status"] == "failed" and failed["error"] == "KeyError: 'no-such-item'"
    assert late["status"] == "skipped: out of time"
    # run one item again into the same file: the others' results stay
    again = gpu_check.run_check(out, 120, True, ["env"], merge=True)
    assert again["items"]["env"]["status"] == "ok"
    assert again["device"]["torch"] == torch.__version__
    assert again["items"]["no-such-item"] == failed and again["reruns"][0]["items"] == ["env"]
    with pytest.raises(SystemExit, match="holds a dry run"):
        gpu_check.run_check(out, 120, False, ["env"], merge=True)


def test_a_command_past_its_time_is_stopped_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; "
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
              f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    returncode, seconds = gpu_check.run_command([sys.executable, "-c", script], 2,
                                                tmp_path / "log")
    assert returncode is None and seconds < 30
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild ends with its session
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child} outlived the stopped command")


def test_the_readme_states_the_command_the_budget_and_every_item_as_the_check_runs_them():
    readme = " ".join((ROOT / "README.md").read_text().split())
    gpu, exp = gpu_check_items.GPU, gpu_check_items.GPU.memory
    assert "PYTHONPATH=code python tools/gpu_check.py --out gpu-check.json" in readme
    assert f"at most {gpu_check.BUDGET / 60:g} minutes** (`--budget {gpu_check.BUDGET:g}`" in readme
    for entry in gpu_check.ITEMS:
        assert f"| `{entry.name}` |" in readme, entry.name
    for figure in (f"{gpu.gemm_n} × {gpu.gemm_n} × {gpu.gemm_n} matmul",
                   f"{gpu.steps} steps of `{gpu.model}`",
                   f"({exp.planner_model().num_params():,} parameters)",
                   f"rows of {exp.seq_len:,} tokens", f"{exp.world} ranks sharing the GPU",
                   f"a cap of {exp.oom_cap_bytes / 2**30:g} GiB per process",
                   f"{gpu.ratio_steps} steps, {gpu.ratio_reps} interleaved repetitions"):
        assert figure in readme, figure
    for ours, theirs in gpu_check_items.REFERENCES.items():
        assert f"`{ours}`" in readme and f"`{theirs}`" in readme


def test_the_readme_states_what_the_committed_record_holds():
    record = gpu_record.gpu_record()
    if record is None:
        pytest.skip(gpu_record.NO_RECORD)
    readme = " ".join((ROOT / "README.md").read_text().split())
    device = record.data["device"]
    assert (f"ran on one {device['name']} on {record.date} (torch {device['torch']}, "
            f"CUDA {device['cuda']}, NCCL {device['nccl']})") in readme
    cases = record.item("strategies")["cases"]
    ok = sum(c["status"] == "ok" for c in cases)
    assert f"Every strategy case ran: {ok} of {len(cases)}" in readme and ok == len(cases)
    assert len(record.item("strategies")["not_run"]) == 3 and "its three" in readme
    counts = record.item("pytest_cuda")["counts"]
    assert counts == {"passed": 6} and "`pytest -m cuda`: 6 passed" in readme
    matmul = record.item("matmul")
    assert (f"bf16 matmul ran at {matmul['gemms'][0]['flops_per_s'] / 1e12:.0f} TFLOP/s, "
            f"{matmul['bf16_share_of_peak']:.0%} of the datasheet") in readme
    runs = record.item("memory")["runs"]
    done = [r for r in runs if r["status"] == "ok"]
    ratios = [max(r["peak_allocated"]) / r["predicted"]["total"] for r in done]
    assert f"finished {len(done)} of {len(runs)} runs" in readme
    assert f"{min(ratios):.2f}–{max(ratios):.2f} × the planner's total" in readme


def test_the_committed_peak_replay_splits_into_the_planners_terms():
    """Chapter 8's table of what is alive at the peak: its parts add up to the replayed
    peak, which is the run's own `max_memory_allocated`, and the model states are the
    run's own count."""
    record = gpu_record.peak_record()
    if record is None:
        pytest.skip(gpu_record.NO_PEAK)
    for run in record["runs"]:
        parts = gpu_record.peak_parts(run)
        assert parts.states == sum(run["state_bytes"].values())
        assert min(parts.activations, parts.loss, parts.backward) > 0
        assert 0 <= parts.rest < 0.02 * parts.peak, parts
        assert abs(parts.peak / run["last_step_peak"]["total"] - 1) < 0.05


def test_the_peak_replay_counts_what_is_alive_when_the_most_is_allocated():
    """`tools/gpu_peak.py` replays the allocator's history: a block counts from its alloc
    to its free_completed, and the groups are those alive at the highest total."""
    import gpu_peak

    def frames(*names):
        return [{"filename": f"/x/code/shardlab/{n}.py" if n.startswith("s:") else
                 f"/v/site-packages/torch/{n}.py", "line": 1, "name": n} for n in names]

    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": frames("s:model")},
             {"action": "alloc", "addr": 2, "size": 50, "frames": frames("functional", "s:loss")},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 3, "size": 30, "frames": []},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 4, "size": 60, "frames": frames("s:model")}]
    peak, groups = gpu_peak.live_at_peak(trace)
    assert peak == 180  # 100 + 50 + 30: block 1 still taken until its free completed
    assert sum(groups.values()) == 180 and len(groups) == 3
    assert any(k.startswith("shardlab/s:loss.py") and "torch/functional.py" in k for k in groups)
    result = subprocess.run([sys.executable, "tools/gpu_peak.py", "--out", "/dev/null"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    if not torch.cuda.is_available():
        assert result.returncode == 2 and "no CUDA GPU" in result.stderr
