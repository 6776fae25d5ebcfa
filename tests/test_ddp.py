"""DDP parity: naive, bucketed and PyTorch's DDP train exactly like one process on the
whole batch, over many steps, with accumulation, frozen, unused and tied parameters and
buffers; the memory they hold and the bytes they send match the formulas.

Every world size is one launch that runs all its cases (`run_configs`), and the
single-process references run in this process: a launch costs seconds of start-up.
"""

from dataclasses import replace

import pytest
import torch

from shardlab import comm, memory
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.train import train_worker

STEPS = 10
BASE = TrainConfig(steps=STEPS, model="gpt-tiny", keep_params=True, measure_memory=False,
                   record_ledger=False)

# Tolerances. Splitting the batch changes only the order in which the fp32 gradient is
# summed (a mean of N means instead of one mean), a difference of a few ulps (~1e-7
# relative). Adam's update lr * m / (sqrt(v) + eps) is normalized, so on an entry whose
# gradient is near zero such a difference can change the update by a good fraction of
# lr = 1e-3 in the worst case; measured over 10 steps the largest parameter difference is
# ~1e-5 and the loss difference ~1e-6. An averaging that is really wrong (a rank's rows
# lost) moves parameters by ~lr per step: checked below to be > 10x the tolerance, so the
# tolerance separates the two.
FP32_LOSS_TOL = 1e-5
FP32_PARAM_TOL = 1e-4
# bf16 gradients are rounded to 8 bits of mantissa (relative 2^-8 = 4e-3) and the
# all-reduce rounds its partial sums in bf16, so the fp32 master weights of bf16-mixed DDP
# differ slightly from the bf16 single-process run's, and when one lands on the other side
# of a rounding boundary the bf16 parameter differs by one bf16 step: at most 2^-7 = 7.8e-3
# for |p| < 2 (LayerNorm weights start at 1). Measured: 2^-8 on the parameters, ~6e-5 on
# the loss; losing a rank's rows moves the loss by ~5e-2 (fp32 check below).
BF16_LOSS_TOL = 1e-3
BF16_PARAM_TOL = 1e-2


@pytest.fixture(autouse=True)
def _one_thread_everywhere(one_thread):
    """Every test of this file compares with references run in this process."""


def run_configs(configs):
    """Worker: each config in turn on this rank (one launch, many runs)."""
    return [train_worker(c) for c in configs]


def reference(config):
    """The single-process run of `config` on the full batch, in this process."""
    return train_worker(replace(config, strategy="single", world=1, options={}))


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_loss_diff(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def cases(world):
    """(config, loss tolerance, parameter tolerance) for one world size."""
    out = []
    for strategy in ("ddp", "ddp-naive", "torch-ddp"):
        plain = replace(BASE, strategy=strategy, world=world)
        out.append((plain, FP32_LOSS_TOL, FP32_PARAM_TOL))
        if world == 2 or strategy == "ddp":
            out.append((replace(plain, grad_accum=2), FP32_LOSS_TOL, FP32_PARAM_TOL))
    # many small buckets: started in order, overlapped with backward
    out.append((replace(BASE, strategy="ddp", world=world,
                        options={"bucket_mb": 0.1, "first_bucket_mb": 0.02}),
                FP32_LOSS_TOL, FP32_PARAM_TOL))
    if world == 2:
        for model in ("toy-frozen", "toy-unused", "toy-tied", "toy-buffers"):
            for strategy in ("ddp", "ddp-naive", "torch-ddp"):
                options = ({"find_unused_parameters": True}
                           if strategy == "torch-ddp" and model == "toy-unused" else {})
                out.append((replace(BASE, strategy=strategy, world=world, model=model,
                                    lr=1e-2, options=options, grad_accum=2),
                            FP32_LOSS_TOL, FP32_PARAM_TOL))
    # bf16 mixed precision, also measured: the memory and ledger tests read these
    for strategy in ("ddp", "ddp-naive", "torch-ddp"):
        out.append((replace(BASE, strategy=strategy, world=world, precision="bf16-mixed",
                            steps=4, measure_memory=True, record_ledger=True),
                    BF16_LOSS_TOL, BF16_PARAM_TOL))
    return out


_LAUNCHED = {}


def launched(world):
    """(cases, per-rank reports) for `world`: one launch, shared by the tests below."""
    if world not in _LAUNCHED:
        todo = cases(world)
        _LAUNCHED[world] = todo, launch(run_configs, world, [c for c, _, _ in todo],
                                        timeout=280)
    return _LAUNCHED[world]


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_trains_like_one_process_on_the_whole_batch(world):
    todo, reports = launched(world)
    for i, (config, loss_tol, param_tol) in enumerate(todo):
        ref = reference(config)
        what = f"{config.strategy} {config.model} {config.precision} accum={config.grad_accum}"
        for rank in range(world):
            got = reports[rank][i]
            assert got.losses == reports[0][i].losses, f"{what}: ranks disagree on the loss"
            assert max_param_diff(got.params, reports[0][i].params) == 0, \
                f"{what}: the replicas drifted apart"
        got = reports[0][i]
        assert max_loss_diff(got.losses, ref.losses) < loss_tol, what
        assert max_param_diff(got.params, ref.params) < param_tol, what
        if config.model == "toy-frozen":  # frozen parameters never moved
            start = build_model("toy-frozen").emb.weight
            assert torch.equal(got.params["emb.weight"], start)
        if config.model == "toy-unused":  # no gradient, no update, not even weight decay
            start = build_model("toy-unused").unused.weight
            assert torch.equal(got.params["unused.weight"], start)
    # our bucketed DDP and PyTorch's compute the same average in the same order
    by_name = {(c.strategy, c.grad_accum, c.model, c.precision, bool(c.options)): i
               for i, (c, _, _) in enumerate(todo)}
    ours = reports[0][by_name[("ddp", 1, "gpt-tiny", "fp32", False)]]
    theirs = reports[0][by_name[("torch-ddp", 1, "gpt-tiny", "fp32", False)]]
    if world == 2:  # a + b == b + a exactly, whatever the order of the buckets
        assert ours.losses == theirs.losses
        assert max_param_diff(ours.params, theirs.params) == 0
    else:  # gloo's ring adds 4 terms in an order that depends on the bucket layout
        assert max_param_diff(ours.params, theirs.params) < FP32_PARAM_TOL


def test_the_tolerance_would_catch_a_wrong_average():
    # Training on rank 0's half of the batch only (what DDP would do if the average
    # lost the other rank) lands far outside the parity tolerance.
    full = reference(BASE)
    half = train_worker(replace(BASE, batch_size=4))
    assert max_param_diff(full.params, half.params) > 10 * FP32_PARAM_TOL
    assert max_loss_diff(full.losses, half.losses) > 10 * FP32_LOSS_TOL


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_16_psi_and_sends_2_psi_per_step(world):
    todo, reports = launched(world)
    measured = [i for i, (c, _, _) in enumerate(todo) if c.measure_memory]
    assert len(measured) == 3
    for i in measured:
        config = todo[i][0]
        for report in (per_rank[i] for per_rank in reports):
            psi = report.psi
            predicted = memory.model_states(psi, world, 0, "bf16-mixed", "adamw")
            measured = report.state_bytes
            assert measured["params"] == predicted.params, config.strategy
            # PyTorch's DDP also keeps its buckets, a second copy of the gradients; ours
            # point each .grad at its bucket slot instead
            bucket_copy = (memory.ddp_bucket_copy_bytes(psi, "bf16-mixed")
                           if config.strategy == "torch-ddp" else 0)
            assert measured["grads"] == predicted.grads + bucket_copy, config.strategy
            # AdamW also keeps one 4-byte fp32 step counter per parameter tensor
            counters = 4 * sum(1 for p in build_model(config.model).parameters())
            assert measured["optimizer"] == predicted.optimizer + counters, config.strategy
            # every step after the first (PyTorch's DDP broadcasts its rebuilt bucket
            # order once, in the second step): all-reduce of 2 psi (N-1)/N bytes of bf16
            for step, ops in enumerate(comm.per_step(report.ledger)):
                all_reduce = ops["all_reduce"]
                assert all_reduce["sent_bytes"] == comm.volume_per_rank(
                    "ddp", psi, world, bytes_per_elem=2), (config.strategy, step)
                assert all_reduce["logical_bytes"] == 2 * psi
                if config.strategy == "ddp-naive":
                    n_tensors = sum(1 for _ in build_model(config.model).parameters())
                    assert all_reduce["calls"] == n_tensors
                elif config.strategy == "ddp" or step > 0:
                    # 0.23 MB fits one bucket, in ours and in PyTorch's once it has
                    # rebuilt its buckets: no smaller first bucket given a bucket_cap_mb
                    assert all_reduce["calls"] == 1, (config.strategy, step)


def wrap_time_checks():
    """Worker: (1) rank 1 builds a different model: every wrapper must refuse, on every
    rank; (2) same model, different values per rank: the wrap broadcasts rank 0's."""
    import torch.distributed as dist
    from shardlab.ddp import BucketedDataParallel, NaiveDataParallel
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.strategy import get_strategy
    messages = []
    for strategy in ("ddp", "ddp-naive", "torch-ddp"):
        name = "toy-tied" if dist.get_rank() == 1 else "toy-frozen"
        try:
            get_strategy(strategy)(build_model(name), get_precision("fp32"),
                                   optimizer_spec("adamw", 1e-3), {})
            messages.append("no error")
        except ValueError as exc:
            messages.append(str(exc))
    states = []
    for cls in (BucketedDataParallel, NaiveDataParallel):
        model = build_model("toy-buffers", seed=dist.get_rank())
        model.calls += dist.get_rank()
        cls(model)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    return messages, states


def test_wrap_refuses_a_model_that_differs_across_ranks_and_broadcasts_values():
    rank0 = build_model("toy-buffers", seed=0).state_dict()
    for messages, states in launch(wrap_time_checks, 2, timeout=120):
        assert all("differs across ranks" in m and "every rank must build the same model"
                   in m for m in messages), messages
        for state in states:
            assert all(torch.equal(state[k], rank0[k]) for k in rank0)
