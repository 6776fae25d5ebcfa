"""What a gradient reduction loses in bf16 (`shardlab.comm.reduction_precision`), in one
process: the ring's sum replayed (checked against the ring itself in `test_comm.py`), the
error against fp64 as the ranks grow, and the systems' defaults with a source each, the
ones PyTorch decides checked on the installed torch.

The gradients are synthetic here (a shared signal under per-micro-batch noise three times
larger, as gradients of different batches mostly disagree): a chapter computes the same
on a model's real gradients (`model_gradients`), which take a forward and a backward per
rank and micro-batch.
"""

import pytest
import torch
from torch import nn

from shardlab.comm import reduction_precision as rp

RANKS = (2, 4, 8, 16, 32, 64)


@pytest.fixture(scope="module")
def errors():
    g = torch.Generator().manual_seed(0)
    signal = torch.randn(4096, generator=g)
    grads = signal + 3 * torch.randn(64, 2, 4096, generator=g)
    rows = rp.reduction_errors(grads, RANKS)
    return {(r.accumulate, r.reduce): [x.error for x in rows
                                       if (x.accumulate, x.reduce) == (r.accumulate, r.reduce)]
            for r in rows}


def test_a_bf16_reduction_loses_more_the_more_ranks_it_sums(errors):
    """fp32 gradients summed in bf16 on a ring: N - 1 roundings to 8 bits, each of a
    partial sum that grows: the error grows with N, from about the unit roundoff of bf16
    (2^-8) at 2 ranks to twice and more at 64."""
    bf16 = errors[("fp32", "bf16")]
    assert bf16 == sorted(bf16)
    assert bf16[-1] > 2 * bf16[0]
    assert all(2 ** -10 < e < 2 ** -5 for e in bf16)


def test_an_fp32_reduction_stays_near_fp32_epsilon(errors):
    """The same gradients summed in fp32: within a few units of fp32's roundoff (2^-24)
    at every N up to 64, four orders of magnitude below bf16's."""
    fp32 = errors[("fp32", "fp32")]
    assert all(e < 2 ** -21 for e in fp32)
    assert all(e * 1000 < b for e, b in zip(fp32, errors[("fp32", "bf16")]))


def test_accumulating_micro_batches_in_bf16_costs_bf16_rounding_even_with_an_fp32_reduce(
        errors):
    """A bf16 `.grad` accumulated over micro-batches carries bf16 rounding into the sum
    whatever the reduction's dtype; its relative error shrinks as more ranks' independent
    roundings average out, but stays far above fp32's."""
    acc = errors[("bf16", "fp32")]
    assert all(2 ** -14 < e < 2 ** -6 for e in acc)
    assert acc[-1] < acc[0]
    assert all(a > 100 * f for a, f in zip(acc, errors[("fp32", "fp32")]))
    both = errors[("bf16", "bf16")]
    assert all(b >= 0.9 * r for b, r in zip(both, errors[("fp32", "bf16")]))


def test_ring_sum_and_accumulate_round_after_every_addition():
    """Three ranks of values whose bf16 sum depends on the order: the ring's order for
    chunk c is c+1, c+2, ..., c, each partial sum rounded to bf16 (8 significant bits:
    257 is not a bf16 number, and rounds to 256)."""
    bf = torch.bfloat16
    grads = torch.tensor([[1.0, 256.0, 1.0], [256.0, 1.0, 1.0], [1.0, 1.0, 256.0]])
    # element 0 (chunk 0): ranks 1, 2, 0: (256 + 1) + 1 -> 256 + 1 -> 256
    # element 1 (chunk 1): ranks 2, 0, 1: (1 + 256) + 1 -> 256
    # element 2 (chunk 2): ranks 0, 1, 2: (1 + 1) + 256 = 258, exact
    got = rp.ring_sum(grads, bf)
    assert got.tolist() == [256.0, 256.0, 258.0]
    assert rp.ring_sum(grads, torch.float32).tolist() == [258.0, 258.0, 258.0]
    assert rp.accumulate(torch.tensor([[256.0], [1.0], [1.0]]), bf).tolist() == [256.0]
    with pytest.raises(ValueError, match="ranks, elements"):
        rp.ring_sum(torch.zeros(3), bf)
    with pytest.raises(ValueError, match="ranks must lie in 1..4"):
        rp.reduction_errors(torch.zeros(4, 1, 8), ranks=(2, 8))
    with pytest.raises(ValueError, match="fp16"):
        rp.reduction_errors(torch.zeros(4, 1, 8), ranks=(2,), cases=(("fp16", "fp32"),))


def test_model_gradients_are_the_micro_batches_of_the_global_batch():
    """The rows are the course's data split into ranks x micro-batches: their mean is the
    gradient of the whole global batch, and no two rows are alike."""
    from shardlab.models import build_model, get_batch, loss_fn
    grads = rp.model_gradients("toy-tied", ranks=2, micro_batches=2, batch_size=2,
                               seq_len=8)
    net = build_model("toy-tied", 0)
    x, y = get_batch(0, 0, 1, 8, 8)
    loss_fn(net(x), y).backward()
    whole = torch.cat([p.grad.reshape(-1) for p in net.parameters() if p.requires_grad])
    assert grads.shape == (2, 2, whole.numel())
    assert torch.allclose(grads.mean(dim=(0, 1)), whole, atol=1e-6)
    assert not torch.equal(grads[0, 0], grads[1, 0])


def test_the_defaults_name_a_source_and_pytorchs_are_the_installed_ones():
    """Every row of the table names where its system decides; the rows about PyTorch are
    checked on the installed torch: FSDP2's MixedPrecisionPolicy leaves reduce_dtype None
    (the reduction then runs in param_dtype), and under torch.autocast the parameters and
    so their gradients stay fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    for row in rp.defaults_table():
        assert len(row) == 5 and all(row) and "/" in row[4], row
    assert MixedPrecisionPolicy().reduce_dtype is None
    layer = nn.Linear(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32
