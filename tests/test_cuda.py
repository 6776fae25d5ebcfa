"""Every strategy on a GPU: NCCL with one rank per GPU, and ranks sharing one GPU over gloo.

Run on a machine with a CUDA GPU with `python -m pytest -m cuda tests/test_cuda.py`;
elsewhere these tests are skipped, saying why. They compare each GPU run with the same
run on the CPU (gloo), which the ordinary suite checks against the formulas:

* the losses and final parameters within the fp32 parity bound of the CPU tests (a GPU's
  kernels round differently from a CPU's, by a few ulps a step);
* every rank's model-state bytes equal the CPU run's (the layout does not depend on the
  device), and the ledger's bytes per step too (2Ψ for DDP and ZeRO-1/2, 3Ψ for ZeRO-3
  and FSDP2);
* every rank reports the CUDA caching allocator's peaks: allocated, and reserved >= it.

Placements: world 1 runs under NCCL (`backend="auto"` picks it for one rank on one GPU);
world 4 runs 4 ranks sharing the GPUs over gloo with CUDA tensors (NCCL refuses two ranks
on one GPU), as a one-GPU Colab runs the labs.
"""

from __future__ import annotations

import pytest
import torch

from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.train import train_many

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA GPU here: run `pytest -m cuda` on a GPU machine"),
]

STRATEGIES = ["single", "ddp", "ddp-naive", "torch-ddp", "zero1", "zero2", "torch-zero1",
              "zero3", "fsdp2", "torch-fsdp2"]
PRECISIONS = ["fp32", "bf16-mixed"]
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # fp32, as the CPU parity tests
BF16_LOSS_TOL = 2 ** -7           # one bf16 rounding of the loss's scale


def configs(world: int) -> list[TrainConfig]:
    return [TrainConfig(strategy=s, world=world, model="gpt-tiny", precision=p, steps=4,
                        batch_size=8, seq_len=16, keep_params=True)
            for s in STRATEGIES if not (s == "single" and world > 1) for p in PRECISIONS]


@pytest.fixture(scope="module", params=[1, 4], ids=["nccl-1-rank", "gloo-4-ranks-share"])
def runs(request):
    world = request.param
    cases = configs(world)
    gpu_backend = "nccl" if world == 1 else "gloo"
    on_gpu = launch(train_many, world, cases, backend=gpu_backend, device="cuda",
                    timeout=900)
    on_cpu = launch(train_many, world, cases, backend="gloo", device="cpu", timeout=900)
    return world, cases, on_gpu, on_cpu


def test_losses_and_parameters_match_the_cpu_run(runs):
    world, cases, on_gpu, on_cpu = runs
    for i, case in enumerate(cases):
        gpu, cpu = on_gpu[0][i], on_cpu[0][i]
        tol = LOSS_TOL if case.precision == "fp32" else BF16_LOSS_TOL
        for a, b in zip(gpu.losses, cpu.losses, strict=True):
            assert abs(a - b) <= tol * max(1.0, abs(b)), (case.strategy, case.precision)
        if case.precision == "fp32":
            for name, p in cpu.params.items():
                diff = (gpu.params[name] - p).abs().max().item()
                assert diff <= PARAM_TOL, (case.strategy, name, diff)


def test_bytes_held_and_moved_do_not_depend_on_the_device(runs):
    world, cases, on_gpu, on_cpu = runs
    for rank in range(world):
        for i, case in enumerate(cases):
            gpu, cpu = on_gpu[rank][i], on_cpu[rank][i]
            assert gpu.state_bytes == cpu.state_bytes, (case.strategy, case.precision, rank)
            per_step = [(r.op, r.logical_bytes) for r in gpu.ledger if r.step == 1]
            assert per_step == [(r.op, r.logical_bytes) for r in cpu.ledger if r.step == 1], \
                (case.strategy, case.precision, rank)


def test_every_rank_reports_the_allocators_peaks(runs):
    world, cases, on_gpu, _ = runs
    for rank in range(world):
        for i, case in enumerate(cases):
            peak = on_gpu[rank][i].peak
            assert peak["total"] > sum(on_gpu[rank][i].state_bytes.values()) > 0, case.strategy
            assert peak["reserved"] >= peak["total"], (case.strategy, peak)
