"""Data parallelism from scratch: naive, then bucketed and overlapped, side by side.

Every rank holds the whole model and trains on its own rows of the global batch. If all
ranks start from the same weights and every step applies the same averaged gradient,
they stay identical, and the run is the single-process run on the whole batch:

    mean over B rows  =  (1/N) * sum over ranks of (mean over that rank's B/N rows)

So a data-parallel wrapper does three things: broadcast rank 0's parameters and buffers
at wrap time, average the gradients after every backward, and keep out of the way of the
ordinary loop (`loss.backward(); opt.step(); opt.zero_grad()`): the averaging happens
inside `backward()`, so by the time it returns every `.grad` holds the global average.

Two versions of the averaging:

* `NaiveDataParallel`: when backward has finished, one blocking all-reduce per parameter.
  Easy to read; but the network sits idle during the backward and the CPU sits idle
  during the all-reduces, and each of the many small messages pays the latency.
* `BucketedDataParallel`: what PyTorch's `DistributedDataParallel` does
  (Li et al., VLDB 2020). Gradients are grouped into flat buckets of about `bucket_mb`
  MB, in the reverse order of registration (roughly the order backward produces them).
  A hook on each parameter copies its gradient into its bucket slot and points `.grad`
  at that slot; when the last gradient of a bucket arrives, the bucket's all-reduce starts
  asynchronously while backward carries on with earlier layers. A callback queued at
  the end of backward waits for the buckets. Fewer, larger messages, overlapped with
  compute.

Both skip frozen parameters, count a tied weight once (it is one Parameter), handle a
parameter that takes no part in a step (it contributes zeros; its `.grad` stays None if
no rank used it), and offer `no_sync()` for gradient accumulation. `wrap_torch_ddp` wraps
PyTorch's own DDP: the reference the benchmark compares against.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from shardlab import trace
from shardlab.buckets import DEFAULT_BUCKET_MB, fill_in_backward_order
from shardlab.launch.devices import rank_device
from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import OptimizerSpec, build_optimizer
from shardlab.precision import Precision
from shardlab.strategy import Wrapped, cast_model, check_options, grad_ready_hook, replicated
from shardlab.units import MiB


# ----------------------------------------------------------------------------- wrap time


def check_same_model_across_ranks(module: nn.Module) -> None:
    """Raise on every rank, before any training, if the ranks built different models.

    Data parallelism pairs up the ranks' gradients position by position; a model that
    differs in a name, shape, dtype or `requires_grad` would be averaged with the wrong
    partner (or hang). Values may differ: the broadcast that follows makes them equal.
    """
    mine = [(name, tuple(t.shape), str(t.dtype), t.requires_grad)
            for name, t in list(module.named_parameters()) + list(module.named_buffers())]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((f"{a} on rank 0 vs {b} on rank {rank}"
                         for a, b in zip(everyone[0], theirs) if a != b),
                        f"{len(everyone[0])} tensors on rank 0 vs {len(theirs)} on rank {rank}")
            raise ValueError(f"the model differs across ranks ({diff}); every rank must "
                             f"build the same model (same name and config) before wrapping")


@torch.no_grad()
def broadcast_from_rank0(module: nn.Module) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor, src=0)


def params_to_sync(module: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters, each once (a tied weight is one Parameter), in registration
    order: the same list on every rank, which is what pairs up their all-reduces."""
    return [p for p in module.parameters() if p.requires_grad]


class _DataParallel(nn.Module):
    """What both versions share: wrap, forward, `no_sync`, and the backward hooks."""

    def __init__(self, module: nn.Module):
        super().__init__()
        check_same_model_across_ranks(module)
        broadcast_from_rank0(module)
        self.module = module
        self.world = dist.get_world_size()
        self.params = params_to_sync(module)
        self.require_sync = True
        self._finish_queued = False
        for p in self.params:
            p.register_post_accumulate_grad_hook(grad_ready_hook(self._on_grad_ready))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates local gradients only; the next synced backward
        averages the sum (each micro-batch's loss is already divided by their count)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync:
            return
        if not self._finish_queued:
            # Runs once the whole backward is done, before backward() returns.
            Variable._execution_engine.queue_callback(self._finish_backward)
            self._finish_queued = True
        self.grad_ready(param)

    def grad_ready(self, param: nn.Parameter) -> None:
        """Called from backward when `param.grad` holds this backward's gradient."""

    def _finish_backward(self) -> None:
        self._finish_queued = False
        with trace.span("wait for all-reduce"):  # on a timeline (`shardlab.trace`)
            self.finish_backward()

    def finish_backward(self) -> None:
        raise NotImplementedError


def _keep_none_if_unused_everywhere(param: nn.Parameter, averaged: torch.Tensor) -> None:
    # A parameter that had no gradient here sent zeros. If every rank did, the average is
    # zero and the parameter stays gradient-less (so the optimizer skips it, exactly as
    # one process would); otherwise it takes the average like any other parameter.
    if param.grad is None and bool(averaged.any()):
        param.grad = averaged.view_as(param).clone()


# ----------------------------------------------------------------------------- naive


class NaiveDataParallel(_DataParallel):
    """After backward: for each parameter, in the same order on every rank, one blocking
    all-reduce of its gradient divided by N."""

    def finish_backward(self) -> None:
        for i, p in enumerate(self.params):
            with trace.span("all-reduce", i):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                grad.div_(self.world)
                dist.all_reduce(grad)
                _keep_none_if_unused_everywhere(p, grad)


# ----------------------------------------------------------------------------- bucketed


class GradBucket:
    """A flat buffer holding the gradients of some parameters back to back (PyTorch's DDP
    hands its communication hooks the same thing, `torch.distributed.GradBucket`)."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.slots: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for p in params:
            self.slots[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready: set[nn.Parameter] = set()
        self.work = None  # the async all-reduce, once started
        self.timed = None  # the future that marks its end on a timeline (`shardlab.trace`)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(params: list[nn.Parameter], bucket_mb: float,
                 first_bucket_mb: float | None = None) -> list[GradBucket]:
    """Group parameters into buckets of about `bucket_mb` MB in reverse registration
    order, one dtype per bucket (`shardlab.buckets`, as ZeRO's). The first bucket may be
    smaller (`first_bucket_mb`), so that the first all-reduce starts earlier in backward;
    None: the same cap as the others."""
    first = None if first_bucket_mb is None else first_bucket_mb * MiB
    return [GradBucket(members) for members in
            fill_in_backward_order(params, bucket_mb * MiB, first)]


class BucketedDataParallel(_DataParallel):
    """Gradients as views of flat buckets, each bucket all-reduced asynchronously as soon
    as its last gradient is ready, all waited for at the end of backward.

    Buckets start in index order on every rank (the order collectives are matched in),
    so a bucket that is ready early waits for the one before it to start.
    """

    def __init__(self, module: nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB,
                 first_bucket_mb: float | None = None):
        super().__init__(module)
        self.buckets = make_buckets(self.params, bucket_mb, first_bucket_mb)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.inverse_world = 1.0 / self.world
        self.next_to_start = 0

    def grad_ready(self, param: nn.Parameter) -> None:
        bucket = self.bucket_of[param]
        if param in bucket.ready:  # its bucket may be on the wire already
            raise RuntimeError(
                "a parameter's gradient was accumulated twice in one backward (used both "
                "inside and outside a reentrant activation checkpoint?); DDP averages each "
                "gradient once a backward: use use_reentrant=False, as PyTorch's DDP asks "
                "(its 'Expected to mark a variable ready only once')")
        slot = bucket.slots[param]
        # The average's 1/N is applied on the way into the bucket, not as a pass over the
        # bucket after: one read and one write of each gradient byte fewer (PyTorch's
        # reducer multiplies by 1/N in the same copy, `Reducer::mark_variable_ready_dense`
        # in torch/csrc/distributed/c10d/reducer.cpp).
        if param.grad.data_ptr() != slot.data_ptr():
            # First backward after zero_grad(set_to_none=True), or after no_sync: the
            # gradient is a fresh tensor. Move it into the bucket and make .grad a view
            # of it, so the all-reduced bucket *is* the gradient (no copy back).
            torch.mul(param.grad, self.inverse_world, out=slot)
            param.grad = slot
        else:  # accumulated in place into the bucket since the last step
            slot.mul_(self.inverse_world)
        bucket.ready.add(param)
        self._start_ready_buckets()

    def _start_ready_buckets(self) -> None:
        while self.next_to_start < len(self.buckets):
            bucket = self.buckets[self.next_to_start]
            if len(bucket.ready) < len(bucket.params):
                return
            self._start(bucket)

    def _start(self, bucket: GradBucket) -> None:
        index = self.next_to_start
        trace.mark("all-reduce", index)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self.next_to_start += 1
        bucket.timed = trace.end_when_done(bucket.work, "all-reduce", index)

    def finish_backward(self) -> None:
        # Parameters that took no part in this backward leave holes: fill them with
        # zeros and start whatever has not started yet, in order.
        for bucket in self.buckets[self.next_to_start:]:
            for p in bucket.params:
                if p not in bucket.ready:
                    bucket.slots[p].zero_()
            self._start(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.timed is not None:  # the end is recorded before backward returns
                bucket.timed.wait()
                bucket.timed = None
            for p in bucket.params:
                if p not in bucket.ready:
                    _keep_none_if_unused_everywhere(p, bucket.slots[p])
            bucket.ready.clear()
            bucket.work = None
        self.next_to_start = 0


# ----------------------------------------------------------------------------- strategies


def _wrap_ours(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
               data_parallel: type[_DataParallel], *args: float) -> Wrapped:
    """The model cast, wrapped in one of the course's data-parallel classes, and an
    ordinary optimizer over the parameters every rank holds whole."""
    model = cast_model(model, precision)
    ddp = data_parallel(model, *args)
    opt = build_optimizer(model.parameters(), precision, optimizer)
    return replicated(ddp, opt, module=model, no_sync=ddp.no_sync,
                      clip=optimizer.clip_steps(opt, sharded=False))


def wrap_ddp_naive(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                   options: dict) -> Wrapped:
    check_options("ddp-naive", options, {})
    return _wrap_ours(model, precision, optimizer, NaiveDataParallel)


def wrap_ddp(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
             options: dict) -> Wrapped:
    # No smaller first bucket unless asked for: PyTorch's DDP makes its first bucket 1 MiB
    # only when `bucket_cap_mb` is left unset (`_BucketCapacityConfig.create` in
    # torch/nn/parallel/distributed.py), and a small first cap, with the cut made before a
    # parameter would pass it, can leave a bucket of a few hundred elements (gpt-small's
    # final LayerNorm) that pays a whole collective's fixed cost.
    opts = check_options("ddp", options, {"bucket_mb": DEFAULT_BUCKET_MB,
                                          "first_bucket_mb": None})
    first = opts["first_bucket_mb"]
    return _wrap_ours(model, precision, optimizer, BucketedDataParallel,
                      float(opts["bucket_mb"]), None if first is None else float(first))


def wrap_torch_ddp(model: nn.Module, precision: Precision, optimizer: OptimizerSpec,
                   options: dict) -> Wrapped:
    """PyTorch's DistributedDataParallel, with its own defaults unless told otherwise."""
    opts = check_options("torch-ddp", options, {"bucket_mb": DEFAULT_BUCKET_MB,
                                                "find_unused_parameters": False,
                                                "gradient_as_bucket_view": False})
    model = cast_model(model, precision)
    check_same_model_across_ranks(model)
    device_ids = [model_device.index] if (model_device := next(model.parameters()).device
                                          ).type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, bucket_cap_mb=float(opts["bucket_mb"]),
        find_unused_parameters=bool(opts["find_unused_parameters"]),
        gradient_as_bucket_view=bool(opts["gradient_as_bucket_view"]))
    opt = build_optimizer(model.parameters(), precision, optimizer)
    return replicated(ddp, opt, module=model, no_sync=ddp.no_sync,
                      clip=optimizer.torch_clip_steps(opt))


# ----------------------------------------------------------------------------- timeline


def timeline_worker(model: str = "gpt-small", version: str = "bucketed",
                    bucket_mb: float = 1.0, steps: int = 3, batch_size: int = 8,
                    seq_len: int = 32) -> list[trace.Span]:
    """Worker: time forward, backward compute and each all-reduce of the last of `steps`
    steps, as `shardlab.trace.Span`s (what, start, end) in seconds from that step's start
    on this rank, in order of start."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    module = build_model(model).to(device)
    ddp = (BucketedDataParallel(module, bucket_mb)
           if version == "bucketed" else NaiveDataParallel(module))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def done() -> None:  # on a GPU, a time is only meaningful once the queued work is done
        if device.type == "cuda":
            torch.cuda.synchronize()

    for step in range(steps):
        x, y = (t.to(device) for t in get_batch(step, rank, world, batch_size, seq_len))
        done()
        with trace.tracing() as events:
            with trace.span("forward"):
                loss = loss_fn(ddp(x), y)
                done()
            with trace.span("backward"):
                loss.backward()
                done()
            with trace.span("optimizer step"):
                optimizer.step()
                optimizer.zero_grad()
                done()
    timeline = trace.spans(trace.relative_to(events, events[0].t))  # from forward's start
    # backward as drawn is autograd's computation: it ends where DDP starts to wait
    waited = next((s.start for s in timeline if s.what == "wait for all-reduce"), None)
    return [s._replace(end=waited) if s.what == "backward" and waited is not None else s
            for s in timeline]
