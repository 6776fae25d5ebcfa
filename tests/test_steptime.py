"""The step-time model's arithmetic, on a fixed machine and fixed ledgers (no clock read).

* compute: forward 2ΨT/F, backward 4ΨT/F, the optimizer Ψ (or Ψ/N, sharded) x AdamW's rate;
* each collective by the α-β fit, gloo's reduce-scatter priced as the all-reduce it is and
  gloo's broadcast as the binomial tree it is;
* exposed time by the schedule: DDP's last bucket, the window backward gives, nothing
  hidden where compute hides nothing (`hiding` = 0);
* the planned collectives send the ZeRO paper's volumes (2Ψ, 3Ψ) and match a ledger's;
* MFU in the run report against a datasheet peak (None on a CPU), and the share of the
  measured matmul rate under its own name; a GPU's peak by its name and matmul dtype;
* `hiding` is never defaulted: a GPU Machine takes it explicitly or from the GPU check;
* bad input refused in one line.
"""

import math

import pytest
import torch
from torch import nn

from shardlab import comm
from shardlab.cards import CARDS
from shardlab.comm import CollectiveRecord
from shardlab.models import build_model
from shardlab.report import RunReport, production_metrics
from shardlab.rates import matmul_rate
from shardlab.plans import PLANS, planned_collectives
from shardlab.steptime import Machine, exposed_seconds, predict_step

MACHINE = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=1.0, gloo=False)
WORLD = 4
TOKENS = 128


def record(op: str, nbytes: int, world: int = WORLD) -> CollectiveRecord:
    return CollectiveRecord(op, torch.float32, nbytes // 4, nbytes, 0, 0, 0.0, 1, world)


@pytest.fixture(scope="module")
def model():
    return build_model("gpt-tiny")


def psi_of(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_compute_is_six_psi_tokens_over_the_rate(model):
    psi = psi_of(model)
    ddp = predict_step("ddp", model, WORLD, {}, MACHINE, tokens=TOKENS)
    assert ddp.compute["forward"] == pytest.approx(2 * psi * TOKENS / 1e9)
    assert ddp.compute["backward"] == pytest.approx(4 * psi * TOKENS / 1e9)
    assert ddp.compute["step"] == pytest.approx(psi * 1e-8)
    zero2 = predict_step("zero2", model, WORLD, {}, MACHINE, tokens=TOKENS)
    assert zero2.compute["step"] == pytest.approx(psi / WORLD * 1e-8)  # its shard only


def test_ddp_exposes_its_last_bucket_or_what_backward_cannot_hide(model):
    psi = psi_of(model)
    fast = Machine(flops=1e11, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=1.0,
                   gloo=False)
    backward = 4 * psi * TOKENS / fast.flops
    small, large = 1 << 16, 1 << 20
    ledger = [record("all_reduce", large), record("all_reduce", small)]
    step = predict_step("ddp", model, WORLD, {}, fast, tokens=TOKENS, ledger=ledger)
    times = [comm.predict_seconds("all_reduce", b, WORLD, 1e-4, 1e8) for b in (large, small)]
    assert [c.seconds for c in step.collectives] == pytest.approx(times)
    assert step.comm_seconds == pytest.approx(sum(times))
    # behind a backward this short, all but `backward` of the communication sticks out
    assert sum(times) - backward > times[-1]
    assert step.exposed["backward"] == pytest.approx(sum(times) - backward)
    assert step.step_seconds == pytest.approx(step.compute_seconds + sum(times) - backward)
    # a slower machine's longer backward hides all but the last bucket
    hidden = predict_step("ddp", model, WORLD, {}, MACHINE, tokens=TOKENS, ledger=ledger)
    assert 4 * psi * TOKENS / MACHINE.flops > sum(times)
    assert hidden.exposed["backward"] == pytest.approx(times[-1])
    # where compute hides nothing (gloo's copies on the computing cores), all is exposed
    shared = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=0.0)
    exposed = predict_step("ddp", model, WORLD, {}, shared, tokens=TOKENS, ledger=ledger)
    assert exposed.exposed_seconds == pytest.approx(sum(times))


def test_gloo_reduce_scatter_costs_an_all_reduce(model):
    ledger = [record("reduce_scatter", 1 << 20), record("all_gather", 1 << 20)]
    nccl = predict_step("zero1", model, WORLD, {}, MACHINE, tokens=TOKENS, ledger=ledger)
    gloo = predict_step("zero1", model, WORLD, {},
                        Machine(1e9, 1e-4, 1e8, 1e-8, 1.0, gloo=True), tokens=TOKENS,
                        ledger=ledger)
    rs = comm.predict_seconds("reduce_scatter", 1 << 20, WORLD, 1e-4, 1e8)
    ar = comm.predict_seconds("all_reduce", 1 << 20, WORLD, 1e-4, 1e8)
    assert nccl.collectives[0].seconds == pytest.approx(rs)
    assert gloo.collectives[0].seconds == pytest.approx(ar) == pytest.approx(2 * rs, rel=0.01)
    # ZeRO-1 reduce-scatters in step() (exposed whole); its one all-gather bucket is needed
    # as the next forward starts, so it cannot hide either
    assert nccl.exposed_seconds == pytest.approx(nccl.comm_seconds)
    off = predict_step("zero1", model, WORLD, {"overlap_all_gather": False}, MACHINE,
                       tokens=TOKENS, ledger=ledger)
    assert [c.phase for c in off.collectives] == ["step", "step"]


def test_on_gloo_pytorch_s_fsdp2_hides_none_of_its_collectives(model):
    """FSDP2 calls its collectives with async_op=False (tests/test_stepparts.py watches
    it): on NCCL that orders streams and its backward's gathers and reduce-scatters hide
    behind compute; on gloo each call holds the thread until it is done, so every second
    of its communication is exposed however well the machine overlaps."""
    gloo = Machine(1e9, 1e-4, 1e8, 1e-8, 1.0, gloo=True)
    nccl = predict_step("torch-fsdp2", model, WORLD, {}, MACHINE, tokens=TOKENS)
    assert nccl.exposed_seconds < 0.9 * nccl.comm_seconds
    step = predict_step("torch-fsdp2", model, WORLD, {}, gloo, tokens=TOKENS)
    assert step.exposed_seconds == pytest.approx(step.comm_seconds)
    ours = predict_step("fsdp2", model, WORLD, {}, gloo, tokens=TOKENS)
    assert ours.exposed_seconds < 0.9 * ours.comm_seconds  # its reduce-scatters overlap


def test_gloo_broadcast_costs_a_binomial_tree(model):
    """ZeroRedundancyOptimizer broadcasts each parameter from its owner; gloo runs a
    broadcast as ceil(log2 N) rounds of the whole tensor, NCCL as a pipelined chain."""
    ledger = [record("all_reduce", 1 << 20)] + [record("broadcast", 4096)] * 10
    gloo = Machine(1e9, 1e-4, 1e8, 1e-8, 1.0, gloo=True)
    for world, rounds in ((2, 1), (3, 2), (4, 2), (8, 3)):
        step = predict_step("torch-zero1", model, world, {}, gloo, tokens=TOKENS,
                            ledger=[record(r.op, r.logical_bytes, world) for r in ledger])
        tree = [c.seconds for c in step.collectives if c.op == "broadcast"]
        assert tree == [pytest.approx(rounds * (1e-4 + 4096 / 1e8))] * 10
    chain = predict_step("torch-zero1", model, WORLD, {}, MACHINE, tokens=TOKENS,
                         ledger=ledger)
    assert chain.collectives[-1].seconds == pytest.approx(
        comm.predict_seconds("broadcast", 4096, WORLD, 1e-4, 1e8))
    assert chain.collectives[-1].seconds > 2 * (1e-4 + 4096 / 1e8)  # 6 rounds of α


@pytest.mark.parametrize("strategy", [n for n, c in CARDS.items() if c.schedule is not None])
def test_planned_collectives_send_the_papers_volume(model, strategy):
    step = predict_step(strategy, model, WORLD, {"bucket_mb": 0.1}, MACHINE, tokens=TOKENS)
    psi = psi_of(model)
    assert step.sent_bytes == pytest.approx(comm.volume_per_rank(strategy, psi, WORLD, 4))


def test_zero3_plan_is_a_gather_per_unit_each_way_and_a_reduce_scatter():
    small = build_model("gpt-small")
    plan = planned_collectives("zero3", small, 2, {})
    kinds = {op: [b for o, b in plan if o == op] for op in ("all_gather", "reduce_scatter")}
    # what the ledger records for gpt-small on 2 ranks: 10 gathers, 5 reduce-scatters
    assert (len(kinds["all_gather"]), sum(kinds["all_gather"])) == (10, 25_931_776)
    assert (len(kinds["reduce_scatter"]), sum(kinds["reduce_scatter"])) == (5, 12_965_888)
    step = predict_step("zero3", small, 2, {}, MACHINE, tokens=TOKENS)
    assert [c.phase for c in step.collectives[:10]] == ["forward"] * 5 + ["backward"] * 5


@pytest.mark.parametrize("strategy, phase", [("zero1", "step"), ("zero2", "backward")])
def test_all_reduced_gradients_are_planned_where_the_reduce_scatters_were(model, strategy,
                                                                          phase):
    """gradient_collective="all-reduce" (DeepSpeed's default): the same buckets, each
    all-reduced in the phase where the stage reduce-scattered it, so twice the bytes of
    the reduce-scatter go on the ring."""
    options = {"bucket_mb": 0.1, "overlap_all_gather": False}
    scatter = predict_step(strategy, model, WORLD, options, MACHINE, tokens=TOKENS)
    reduce = predict_step(strategy, model, WORLD, {**options, "gradient_collective":
                                                   "all-reduce"}, MACHINE, tokens=TOKENS)
    ops = lambda step, op: [(c.nbytes, c.phase) for c in step.collectives if c.op == op]
    assert ops(reduce, "all_reduce") == ops(scatter, "reduce_scatter")
    assert {ph for _, ph in ops(reduce, "all_reduce")} == {phase}
    assert not ops(reduce, "reduce_scatter")
    gradients = sum(n for n, _ in ops(scatter, "reduce_scatter")) * (WORLD - 1) / WORLD
    assert reduce.sent_bytes == pytest.approx(scatter.sent_bytes + gradients)


def test_exposed_rules():
    from shardlab.steptime import Collective
    produced = [Collective("all_reduce", 0, "backward", "produced", s) for s in (1.0, 2.0)]
    prefetched = [Collective("all_gather", 0, "forward", "prefetched", s) for s in (2.0, 1.0)]
    waited = [Collective("all_gather", 0, "forward", "waited", 0.5)]
    assert exposed_seconds(produced, 10.0, 1.0) == 2.0          # the last one
    assert exposed_seconds(produced, 0.5, 1.0) == 2.5           # 3 - 0.5
    assert exposed_seconds(prefetched, 10.0, 1.0) == 2.0        # the first one
    assert exposed_seconds(produced, 10.0, 0.0) == 3.0          # nothing hides
    assert exposed_seconds(waited + prefetched, 10.0, 1.0) == 2.5


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3"])
def test_timeline_ends_at_the_predicted_step(model, strategy):
    step = predict_step(strategy, model, WORLD, {"bucket_mb": 0.1}, MACHINE, tokens=TOKENS)
    timeline = step.timeline()
    compute = [s for s in timeline if s[0] == "compute"]
    assert [s[1] for s in compute] == ["forward", "backward", "optimizer"]
    assert compute[-1][3] == pytest.approx(step.step_seconds)
    # every collective is drawn once, for its predicted time
    drawn = sorted(b - a for lane, _, a, b in timeline if lane == "communication")
    assert drawn == pytest.approx(sorted(c.seconds for c in step.collectives))


def test_every_schedule_is_a_known_strategy():
    timed = [c for c in CARDS.values() if c.schedule is not None]
    assert timed and all(c.volume_factor is not None and c.plan in PLANS for c in timed)


def test_bad_input_is_refused_in_one_line(model):
    with pytest.raises(ValueError, match="no step-time schedule for strategy 'zero9'"):
        predict_step("zero9", model, WORLD, {}, MACHINE, tokens=TOKENS)
    with pytest.raises(ValueError, match="tokens >= 1"):
        predict_step("ddp", model, WORLD, {}, MACHINE, tokens=0)
    with pytest.raises(ValueError, match="flops > 0"):
        Machine(flops=0, alpha=0, beta=1, adam_seconds=0, hiding=0)
    with pytest.raises(ValueError, match="hiding"):
        Machine(flops=1, alpha=0, beta=1, adam_seconds=0, hiding=2)


def test_matmul_rate_is_a_rate():
    rate = matmul_rate(nn.Linear(64, 32), tokens=16)
    assert rate > 0 and math.isfinite(rate)


def test_report_mfu_is_against_the_datasheet_peak_and_matmul_utilization_is_not():
    """MFU = model FLOP/s over the datasheet peak; the share of the measured matmul rate
    is reported apart, as matmul utilization; a CPU run (no peak) has no MFU."""
    report = RunReport(0, 2, "ddp", [1.0] * 4, {}, {}, [], [1.0, 0.5, 0.5, 1.0],
                       tokens_per_step=100, model_flops_per_step=1e9, matmul_flops=1e10,
                       peak_flops=4e10)
    [m] = production_metrics([report])
    assert m["mfu_pct"] == pytest.approx(100 * 1e9 / 0.5 / 4e10)  # 5 %: the steady median
    assert m["matmul_utilization_pct"] == pytest.approx(100 * 1e9 / 0.5 / 1e10)  # 20 %
    cpu = RunReport(0, 2, "ddp", [1.0] * 4, {}, {}, [], [1.0, 0.5, 0.5, 1.0],
                    tokens_per_step=100, model_flops_per_step=1e9, matmul_flops=1e10)
    [m] = production_metrics([cpu])
    assert m["mfu_pct"] is None and m["matmul_utilization_pct"] == pytest.approx(20)
    empty = production_metrics([RunReport(0, 1, "single", [1.0], {}, {}, [], [1.0])])[0]
    assert empty["mfu_pct"] is None and empty["matmul_utilization_pct"] is None


def test_datasheet_peaks_by_gpu_name_and_matmul_dtype():
    """The names torch.cuda.get_device_name gives, mapped to the datasheets' dense peaks;
    fp32 matmuls count at the fp32 rate unless PyTorch lets them use TF32."""
    from shardlab import hardware
    from shardlab.steptime import datasheet_peak, matmul_dtype
    assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "bf16").value == 989e12
    assert hardware.peak_flops("NVIDIA H100 PCIe", "bf16").value == 756e12
    assert hardware.peak_flops("NVIDIA H200", "fp16").value == 989e12
    assert hardware.peak_flops("NVIDIA A100-SXM4-80GB", "fp32").value == 19.5e12
    assert hardware.peak_flops("NVIDIA H100 NVL", "bf16") is None     # not listed
    assert hardware.peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
    with pytest.raises(ValueError, match="dtype must be one of"):
        hardware.peak_flops("NVIDIA H100 80GB HBM3", "fp8")
    assert datasheet_peak("cpu", torch.bfloat16) is None
    assert matmul_dtype(torch.bfloat16) == "bf16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype(torch.float32) == "fp32"
        torch.set_float32_matmul_precision("high")
        assert matmul_dtype(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_model_flops_count_six_psi_and_optionally_palms_attention_term():
    from shardlab.steptime import model_flops_per_token
    assert model_flops_per_token(1000) == 6000
    # PaLM's 12·L·d·s: Llama-2-7B (32 layers, d 4096) at 4096 tokens adds 6.4 GFLOPs
    assert model_flops_per_token(0, 32, 4096, 4096) == 12 * 32 * 4096 * 4096
    with pytest.raises(ValueError, match="psi, n_layers"):
        model_flops_per_token(-1)


def test_a_gpu_machine_takes_hiding_explicitly():
    """No default says a GPU hides everything: unmeasured is refused in one line."""
    from shardlab.steptime import gpu_machine
    with pytest.raises(ValueError, match="hiding on a GPU is unmeasured"):
        gpu_machine(1e15, 5e-6, 4.5e11, hiding=None)
    machine = gpu_machine(1e15, 5e-6, 4.5e11, hiding=0.7)
    assert (machine.hiding, machine.gloo) == (0.7, False)
    with pytest.raises(TypeError):
        Machine(flops=1, alpha=0, beta=1, adam_seconds=0)  # hiding has no default


def test_a_run_reports_mfu_and_profiles_one_step(tmp_path):
    """One launch: every rank's report states its matmul utilization and tokens/s, and no
    MFU on a CPU (the summary prints both columns),
    and --profile's folder holds a Chrome trace per rank with the loop's phases and the
    collectives of the step."""
    import json

    from shardlab.config import TrainConfig
    from shardlab.report_output import summary_table
    from shardlab.train import run
    reports = run(TrainConfig(strategy="zero2", world=2, steps=3, measure_memory=False,
                              profile_dir=str(tmp_path / "traces")))
    for m in production_metrics(reports):
        assert m["mfu_pct"] is None  # a CPU: no datasheet peak
        assert m["matmul_utilization_pct"] is not None and m["matmul_utilization_pct"] > 0
        assert m["tokens_per_s"] > 0
    assert "MFU %" in summary_table(reports) and "mm-util %" in summary_table(reports)
    for rank in (0, 1):
        trace = json.loads((tmp_path / "traces" / f"rank{rank}.json").read_text())
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        assert {"forward", "backward", "optimizer step"} <= names
        assert any(n.startswith("gloo:") for n in names), sorted(names)[:20]
    # what the figure of the predicted step beside the profiled one reads from a trace
    from shardlab.viz import profiled_spans
    spans = profiled_spans(tmp_path / "traces" / "rank0.json")
    assert [w for w, *_ in spans["compute"]] == ["forward", "backward", "optimizer step"]
    assert spans["compute"][0][1] == 0.0 and spans["communication"]


def test_profile_dir_that_is_a_file_is_refused(tmp_path):
    from shardlab.config import TrainConfig
    a_file = tmp_path / "trace"
    a_file.write_text("")
    with pytest.raises(ValueError, match="is a file; give a folder"):
        TrainConfig(strategy="ddp", world=2, profile_dir=str(a_file)).validate()
    # from the command line: one line naming the flag, exit code 2, before any rank starts
    from shardlab.cli import main
    assert main(["--strategy", "ddp", "--world", "2", "--profile", str(a_file)]) == 2
