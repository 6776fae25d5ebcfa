"""Gradient buckets: whole parameters grouped in the order backward produces their
gradients, up to a size cap per bucket.

DDP all-reduces its gradients bucket by bucket, ZeRO reduce-scatters them bucket by
bucket, and both cut the buckets the same way: walk the parameters from the last
registered to the first, which is about the order backward produces their gradients, and start a new
bucket when the next parameter would take the current one past the cap, or has another
dtype (a bucket is one flat buffer). A parameter larger than the cap gets a bucket of its
own. Large buckets mean few collectives, each paying its fixed cost once; small ones mean
the first can start early in backward and little memory waits in a bucket.

A module of its own because both strategies cut their buckets with it, and a reader can
predict the buckets (lab 4 and lab 5 do) without either strategy's runtime.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

# MB (MiB, `shardlab.units`) of parameters per bucket, as PyTorch DDP's `bucket_cap_mb`.
DEFAULT_BUCKET_MB = 25.0


def fill_in_backward_order(params: Sequence[nn.Parameter], cap_bytes: float,
                           first_cap_bytes: float | None = None) -> list[list[nn.Parameter]]:
    """Cut `params` (in registration order) into buckets of whole parameters of at most
    `cap_bytes` each (a larger parameter alone), walking from the last parameter to the
    first: the buckets and the parameters inside each come in backward order. The first
    bucket may have a cap of its own (`first_cap_bytes`): DDP makes it small, so that the
    first all-reduce starts early in backward."""
    buckets: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in reversed(params):
        cap = first_cap_bytes if not buckets and first_cap_bytes is not None else cap_bytes
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap or p.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
