"""What this machine reaches, measured on every rank at once: the step-time model's rate F
of a model's own forward and backward (`compute_rate`, `compute_rates`), the rate of its
matmuls alone (`matmul_rate`, the denominator of a CPU run's matmul utilization), and η,
the share of a collective that compute running beside it hides (`hiding_fraction`,
`hiding_shares`). Micro-benchmarks, each timed by `stepparts.median_seconds`; the model
that uses them is `shardlab.steptime`, the run that measures them all
`shardlab.workers.measure_machine`.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardlab.launch.devices import rank_device
from shardlab.stepparts import median_seconds


def matmul_rate(model: nn.Module, tokens: int, repeats: int = 3,
                device: torch.device | str = "cpu") -> float:
    """FLOP/s of this process on the model's own matmuls: `tokens` rows through each
    distinct `nn.Linear` shape (a square 256 matmul for a model with none), the median of
    `repeats` timings. Milliseconds for the course's models: cheap enough for every run.
    Not MFU's denominator (a datasheet peak is): the run's FLOP/s over this rate is its
    "matmul utilization", the share of what this machine reaches on these shapes."""
    shapes = sorted({(m.in_features, m.out_features) for m in model.modules()
                     if isinstance(m, nn.Linear)}) or [(256, 256)]
    tokens = max(1, int(tokens))
    device = torch.device(device)
    flops, seconds = 0.0, 0.0

    def synchronized(run):
        def timed():
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return timed

    # its own generator: the process's is left alone (ranks that are threads of one
    # process build their models from it, `shardlab.many_ranks.threads`)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for n_in, n_out in shapes:
            x = torch.randn(tokens, n_in, device=device, generator=generator)
            w = torch.randn(n_out, n_in, device=device, generator=generator)
            synchronized(lambda: x @ w.T)()  # warm-up
            seconds += median_seconds(synchronized(lambda: x @ w.T), repeats)
            flops += 2 * tokens * n_in * n_out
    return flops / seconds if seconds > 0 else math.inf


def compute_rate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn,
                 repeats: int = 3) -> float:
    """FLOP/s this process reaches on the model itself, counted as 6ΨT: the median time of
    a forward and a backward over `x` (T tokens), with no communication. Below the matmul
    rate by everything that is not a matmul (norms, softmax, the loss, autograd's own work):
    the rate the step-time model divides 6ΨT by."""
    return compute_rates({"model": model}, x, y, loss_fn, repeats)["model"]


def compute_rates(models: dict[str, nn.Module], x: torch.Tensor, y: torch.Tensor, loss_fn,
                  repeats: int = 3, between: Callable[[], None] = lambda: None,
                  slowest: Callable[[float], float] = lambda seconds: seconds
                  ) -> dict[str, float]:
    """`compute_rate` of each of `models`, timed in turn, one forward and backward of each
    a round, `repeats` rounds (`between()` runs before each timing: a barrier, for ranks
    that time together), so that a noisy moment of a shared machine hits them alike.
    `slowest(seconds)` turns this rank's time of a round into the one that counts: for
    ranks that start together, the slowest rank's (`slowest_rank`), since a synchronous
    step waits for it at its first collective."""
    def forward_backward(model):
        def run():
            loss_fn(model(x), y).backward()
            if x.device.type == "cuda":
                torch.cuda.synchronize(x.device)
        return run

    runs = {label: forward_backward(model) for label, model in models.items()}
    for run in runs.values():  # warm-up: a fresh process's first runs fault pages in
        run()
        run()
    times: dict[str, list[float]] = {label: [] for label in models}
    for _ in range(repeats):
        for label, run in runs.items():
            between()
            times[label].append(slowest(median_seconds(run, 1)))
    rates = {}
    for label, model in models.items():
        model.zero_grad(set_to_none=True)
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        rates[label] = 6 * psi * x.numel() / statistics.median(times[label])
    return rates


def slowest_rank(seconds: float) -> float:
    """The longest of every rank's `seconds` (a collective: every rank calls it). Ranks
    that share a CPU finish the same work apart (the scheduler runs some before others),
    and the step of a synchronous strategy goes at the pace of the last to finish: the
    time the report counts as idle on the others."""
    t = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def hiding_fraction(numel: int = 1 << 20, repeats: int = 3,
                    device: torch.device | str = "cpu") -> float:
    """Run on every rank of a group: the share of an all-reduce's time that compute
    running meanwhile hides, the median of `hiding_shares`' rounds."""
    return statistics.median(hiding_shares(numel, repeats, device))


def hiding_shares(numel: int = 1 << 20, repeats: int = 3,
                  device: torch.device | str = "cpu") -> list[float]:
    """Run on every rank of a group: the share of an all-reduce's time that compute
    running meanwhile hides, (C + M - T) / min(C, M), with C matmuls alone, M the
    all-reduce alone and T both at once. Below 1 wherever communication and compute share
    something: the cores (gloo on a CPU), or SMs and memory bandwidth (NCCL's kernels on a
    GPU, where it is measured by the GPU check, not assumed). One share a round, for
    `repeats` rounds, each timing the three in turn. On a shared CPU one round's share
    can be anything from 0 to 1, and rounds taken together agree with each other more
    than with rounds taken a second later: take the median of rounds from several
    moments (`workers.measure_machine` does)."""
    import torch.distributed as dist
    device = torch.device(device)
    x = torch.ones(numel, device=device)
    a = torch.randn(256, 256, device=device)

    def done():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def communicate():
        dist.all_reduce(x)
        done()

    communicate()
    dist.barrier()
    comm_alone = median_seconds(communicate, repeats)

    def one_matmul():
        a @ a
        done()

    matmuls = max(1, int(comm_alone / max(median_seconds(one_matmul, 3), 1e-6)))

    def compute():
        for _ in range(matmuls):
            a @ a
        done()

    def both():
        handle = dist.all_reduce(x, async_op=True)
        compute()
        handle.wait()
        done()

    # the three timed in turn, a round at a time: one round's share each, and their
    # median, so that a noisy moment of a shared machine spoils a round, not the figure
    shares = []
    for _ in range(repeats):
        timed = []
        for run in (compute, communicate, both):
            dist.barrier()
            timed.append(median_seconds(run, 1))
        c, m, t = timed
        shares.append(min(1.0, max(0.0, (c + m - t) / min(c, m))))
    return shares
