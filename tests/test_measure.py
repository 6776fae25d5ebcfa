"""`measure` counts what live tensors hold; on real runs (one process, PyTorch's DDP on 2
and 4 ranks, FSDP2) the counts equal `memory`'s formulas to the byte, once the
optimizer's per-tensor step counters and FSDP2's padding are added explicitly, and
PyTorch DDP's bucket copy of the gradients (which the process's allocator shows is there
unless `gradient_as_bucket_view=True`) is counted and planned."""

import pytest
import torch
from torch import nn

import measure_workers as w
from shardlab import memory
from shardlab.launch import launch
from shardlab.measure import state_bytes, track_peak
from shardlab.precision import MasterWeightOptimizer

CASES = [("fp32", "adamw"), ("bf16-mixed", "adamw"), ("bf16", "adamw"),
         ("fp32", "sgd-momentum"), ("bf16-mixed", "sgd")]
STEP_COUNTER_BYTES = 4  # AdamW keeps `step` as a 0-dim fp32 tensor per parameter tensor


def predicted(case_result: dict, world: int, precision: str, optimizer: str) -> dict:
    """memory's formula for stage 0 (every data-parallel rank holds everything), plus
    what the formula leaves out on purpose: Adam's step counters; on more than one rank
    (PyTorch's DDP, its default gradient_as_bucket_view=False) the planner's bucket copy
    of the gradients."""
    b = memory.model_states(case_result["psi"], world, 0, precision, optimizer)
    counters = STEP_COUNTER_BYTES * case_result["param_tensors"] if optimizer == "adamw" else 0
    buckets = memory.ddp_bucket_copy_bytes(case_result["psi"], precision) if world > 1 else 0
    return {"params": b.params, "grads": b.grads + buckets,
            "optimizer": b.optimizer + counters, "buffers": 0}


def check_against_formulas(results: dict, world: int):
    for (precision, optimizer), r in results.items():
        expected = predicted(r, world, precision, optimizer)
        assert r["state_bytes"] == expected, (precision, optimizer)
        # zero_grad(set_to_none) frees the gradients and nothing else: DDP's buckets stay
        buckets = expected["grads"] - memory.model_states(
            r["psi"], world, 0, precision, optimizer).grads
        assert r["after_zero_grad"] == {**expected, "grads": buckets}, (precision, optimizer)
        # the step's peak holds at least the model states
        assert r["peak"] >= sum(expected.values())
        assert r["peak_by_category"]["params"] == expected["params"]


def test_single_process_matches_the_formulas_to_the_byte():
    check_against_formulas(w.all_cases(CASES), world=1)


@pytest.fixture(scope="module")
def ddp_runs():
    """One launch per world size; every case runs inside it."""
    return {world: launch(w.ddp_and_fully_shard, world, CASES, world == 2, timeout=240)
            for world in (2, 4)}


@pytest.mark.parametrize("world", [2, 4])
def test_torch_ddp_matches_the_formulas_to_the_byte_on_every_rank(ddp_runs, world):
    # DDP is stage 0: each of the N ranks holds the whole 16 psi (or 4+4+8 psi ...).
    for rank_result in ddp_runs[world]:
        check_against_formulas(rank_result["ddp"], world)


def test_ddp_keeps_a_bucket_copy_of_the_gradients_unless_they_are_bucket_views(ddp_runs):
    """PyTorch's DDP on a 4 MB model, two steps: the process's allocator (glibc's malloc,
    which the C++ Reducer's buffers come from too) holds the gradients twice over the
    model's own bytes with gradient_as_bucket_view=False (its default) and once with True,
    within 2% of Ψ·4 bytes; `state_bytes` counts the same, and the planner's stage 0
    (model_states' grads + ddp_bucket_copy_bytes) equals it to the byte, both ways."""
    world = 2
    for rank_result in ddp_runs[world]:
        assert set(rank_result["bucket_copy"]) == {False, True}
        for view, r in rank_result["bucket_copy"].items():
            grads = memory.model_states(r["psi"], world, 0, "fp32", "adamw").grads
            planned = grads + memory.ddp_bucket_copy_bytes(r["psi"], "fp32",
                                                           gradient_as_bucket_view=view)
            assert planned == (4 if view else 8) * r["psi"]
            assert r["state_bytes"]["grads"] == planned, view
            assert abs(r["allocated"] - planned) <= 0.02 * 4 * r["psi"], (view, r)


@pytest.mark.parametrize("world", [2, 4])
def test_torch_fully_shard_counts_local_padded_shards(ddp_runs, world):
    """FSDP2 splits each parameter along dim 0 into ceil(rows / N)-row shards: the
    parameters and gradients live in padded storages (counted whole), Adam's m and v are
    made with the shape of the real local rows."""
    for rank, r in enumerate(ddp_runs[world]):
        fs = r["fully_shard"]
        padded = unpadded = 0
        for shape in fs["shapes"]:
            rows, rest = shape[0], (shape[1] if len(shape) > 1 else 1)
            per_rank = -(-rows // world)
            local_rows = max(0, min(per_rank, rows - rank * per_rank))
            padded += per_rank * rest
            unpadded += local_rows * rest
        n = len(fs["shapes"])
        assert fs["state_bytes"] == {"params": 4 * padded, "grads": 4 * padded,
                                     "optimizer": 8 * unpadded + STEP_COUNTER_BYTES * n,
                                     "buffers": 0}
    # summed over the ranks, the shards hold every parameter once (plus padding)
    psi = sum(torch.Size(s).numel() for s in ddp_runs[world][0]["fully_shard"]["shapes"])
    total_params = sum(r["fully_shard"]["state_bytes"]["params"] for r in ddp_runs[world])
    assert 4 * psi <= total_params < 4 * psi + 4 * world * 64


# ----------------------------------------------------------------------------- unit cases


def test_tied_weights_and_shared_storages_count_once():
    emb = nn.Embedding(11, 6)
    head = nn.Linear(6, 11, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    assert state_bytes(model)["params"] == 11 * 6 * 4
    assert state_bytes(model, model)["params"] == 11 * 6 * 4  # a holder given twice


def test_views_of_a_flat_buffer_count_the_whole_storage_padding_included():
    flat = torch.zeros(103)  # 100 elements + 3 of padding
    model = nn.Linear(10, 9)
    model.weight = nn.Parameter(flat[:90].view(9, 10))
    model.bias = nn.Parameter(flat[90:99])
    assert state_bytes(model)["params"] == 103 * 4


def test_buffers_and_an_optimizer_without_its_module():
    model = nn.BatchNorm1d(7)  # weight, bias; running mean, var, num_batches_tracked
    assert state_bytes(model) == {"params": 56, "grads": 0, "optimizer": 0,
                                  "buffers": 7 * 4 * 2 + 8}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    # without the module, the parameters it steps are not known to be the model's
    assert state_bytes(opt) == {"params": 0, "grads": 56, "optimizer": 56 + 56,
                                "buffers": 0}
    assert state_bytes(model, opt) == {"params": 56, "grads": 56, "optimizer": 56,
                                       "buffers": 7 * 4 * 2 + 8}


def test_master_weights_are_optimizer_state():
    model = nn.Linear(8, 4).to(torch.bfloat16)
    opt = MasterWeightOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(torch.randn(2, 8, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    assert state_bytes(model, opt) == {"params": 72, "grads": 72,
                                       "optimizer": 36 * 12 + 2 * 4, "buffers": 0}


class Declared:
    """A strategy that declares what it holds."""

    def __init__(self):
        self.shard = torch.zeros(50)
        self.grad_shard = torch.zeros(50)
        self.m, self.v = torch.zeros(50), torch.zeros(50)

    def state_tensors(self):
        return {"params": [self.shard], "grads": [self.grad_shard],
                "optimizer": [self.m, self.v, self.shard]}  # shard already counted


def test_state_tensors_declares_categories():
    assert state_bytes(Declared()) == {"params": 200, "grads": 200, "optimizer": 400,
                                       "buffers": 0}


def test_bad_holders_are_refused_with_what_to_pass():
    with pytest.raises(TypeError, match="state_tensors"):
        state_bytes(torch.zeros(3))

    class Wrong:
        def state_tensors(self):
            return {"weights": [torch.zeros(2)]}

    with pytest.raises(ValueError, match="optimizer"):
        state_bytes(Wrong())


def test_peak_sees_activations_that_the_states_do_not_hold():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 64)
    for _ in range(2):
        with track_peak(model, opt) as peak:
            model(x).square().mean().backward()
            opt.step()
            held = state_bytes(model, opt)
            opt.zero_grad()
    by = peak.by_category
    # the peak comes in backward, when the activations are still held and only some
    # gradients exist yet
    assert by["params"] == held["params"] and 0 < by["grads"] <= held["grads"]
    assert by["activations"] >= 256 * 512 * 4
    assert peak.bytes == sum(by.values())
    # the hidden activations (256 x 512 fp32, saved for backward) are part of the peak
    assert peak.bytes >= sum(held.values()) + 256 * 512 * 4


def test_peak_counts_declared_optimizer_tensors():
    d = Declared()
    with track_peak(d) as peak:
        d.m.add_(1.0)
        tmp = torch.ones(1000)
        del tmp
    assert peak.by_category["optimizer"] == 400
    assert peak.by_category["params"] == 200 and peak.by_category["grads"] == 200
    assert peak.bytes == 200 + 200 + 400 + 4000


def test_the_training_loops_report_matches_the_formulas():
    """The report of `train.run` (the course's own loop and DDP) carries the same bytes."""
    from shardlab.config import TrainConfig
    from shardlab.models import build_model
    from shardlab.train import run

    model = build_model("gpt-tiny")
    psi, tensors = sum(p.numel() for p in model.parameters()), len(list(model.parameters()))
    for strategy, world, precision in [("single", 1, "bf16-mixed"), ("ddp", 2, "fp32")]:
        reports = run(TrainConfig(strategy=strategy, world=world, precision=precision,
                                  steps=2, record_ledger=False))
        b = memory.model_states(psi, world, 0, precision, "adamw")
        for r in reports:
            assert r.psi == psi
            assert r.state_bytes == {"params": b.params, "grads": b.grads,
                                     "optimizer": b.optimizer + STEP_COUNTER_BYTES * tensors,
                                     "buffers": 0}, (strategy, r.rank)


class FlatParamsAndGradShard:
    """ZeRO-2's layout in one process: the module's parameters are views of one padded
    flat buffer, and the only gradient memory that outlives backward is a shard that is
    nobody's `.grad` (a hook folds each full gradient into it and frees it)."""

    def __init__(self, model: nn.Module, shard_numel: int):
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel + 3, device="cpu")  # 3 elements of padding
        offset = 0
        with torch.no_grad():
            for p in params:
                view = self.flat[offset:offset + p.numel()]
                view.copy_(p.reshape(-1))
                p.data = view.view_as(p)
                offset += p.numel()
        self.grad_shard = torch.zeros(shard_numel, device="cpu")
        for p in params:
            p.register_post_accumulate_grad_hook(self.fold_and_free)

    @torch.no_grad()
    def fold_and_free(self, p: nn.Parameter) -> None:
        n = min(p.numel(), self.grad_shard.numel())
        self.grad_shard[:n] += p.grad.reshape(-1)[:n]
        p.grad = None

    def state_tensors(self):
        return {"params": [self.flat], "grads": [self.grad_shard]}


def test_peak_files_a_declared_gradient_shard_as_grads_not_params():
    """A declared tensor that the modules' parameters are views of (ZeRO's flat buffer)
    is MemTracker's to file as parameters; the gradient shard beside it must still be
    counted as gradients at the peak, not moved into the parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    holder = FlatParamsAndGradShard(model, shard_numel=500)
    x = torch.randn(16, 32)
    with track_peak(model, holder) as peak:
        model(x).square().mean().backward()
    by = peak.by_category
    assert by["params"] == holder.flat.numel() * 4
    assert by["grads"] >= holder.grad_shard.numel() * 4
    assert by["other"] == 0
    assert peak.bytes == sum(by.values())
    # outside the peak, the same holders count the same states
    assert state_bytes(model, holder) == {"params": holder.flat.numel() * 4,
                                          "grads": holder.grad_shard.numel() * 4,
                                          "optimizer": 0, "buffers": 0}


def test_zero2_peak_holds_its_gradient_shard():
    """The report of a real ZeRO-2 run: at the peak of its last step the gradient shard
    ((2 + 0) bytes x Ψ / N in bf16) is there, under "grads", and the parameters are the
    flat buffer alone."""
    from shardlab.config import TrainConfig
    from shardlab.train import run

    for r in run(TrainConfig(strategy="zero2", world=2, steps=2, precision="bf16-mixed",
                             record_ledger=False)):
        predicted = memory.model_states(r.psi, 2, 2, "bf16-mixed", "adamw")
        assert r.state_bytes["grads"] == predicted.grads
        assert r.peak["grads"] >= predicted.grads
        assert r.peak["params"] == r.state_bytes["params"]
