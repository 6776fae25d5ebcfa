"""Tensor parallelism of one MLP: the same output and input gradient as the unsplit MLP,
two all-reduces of the activations per step against ZeRO-3's gathers of the weights, and
1/T of the hidden activations kept on each rank."""

import pytest
import torch

from shardlab import comm, memory
from shardlab.launch import launch
from shardlab.models import MLP, GPTConfig
from shardlab.tensor_parallel import TensorParallelMLP, mlp_traffic, tensor_parallel_bytes

HIDDEN, TOKENS = 32, [8, 96]


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_mlp_against_the_unsplit_mlp_and_zero3(world):
    ranks = launch(mlp_traffic, world, HIDDEN, TOKENS, backend="gloo", timeout=240)
    ffn = 4 * HIDDEN
    psi_mlp = 2 * HIDDEN * ffn + ffn + HIDDEN
    for rank in ranks:
        for r, T in zip(rank, TOKENS):
            assert r["max_error"] < 1e-5
            assert r["tp_ops"] == ["all_reduce", "all_reduce"]
            assert r["tp_sent"] == tensor_parallel_bytes(T, HIDDEN, world, 4)
            assert r["zero3_ops"] == ["all_gather", "all_gather", "reduce_scatter"]
            padded = world * memory.shard_numel(psi_mlp, world)
            assert r["zero3_sent"] == comm.volume_per_rank("zero3", padded, world, 4)
            # kept for backward: the input, and the GELU's input and output (fp32)
            assert r["tp_saved"] == 4 * T * (HIDDEN + 2 * ffn // world)
            assert r["zero3_saved"] == 4 * T * (HIDDEN + 2 * ffn)


def test_rank_pieces_add_up_to_the_mlp():
    torch.manual_seed(0)
    mlp = MLP(GPTConfig(d_model=8))
    pieces = [TensorParallelMLP(mlp, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p.fc_weight for p in pieces]), mlp.fc.weight)
    assert torch.equal(torch.cat([p.proj_weight for p in pieces], dim=1), mlp.proj.weight)
    x = torch.randn(5, 8, device="cpu")
    hidden = [torch.nn.functional.gelu(x @ p.fc_weight.T + p.fc_bias) for p in pieces]
    partial = sum(h @ p.proj_weight.T for h, p in zip(hidden, pieces)) + mlp.proj.bias
    torch.testing.assert_close(partial, mlp(x))


def test_an_uneven_split_is_refused():
    with pytest.raises(ValueError, match="divides 32"):
        TensorParallelMLP(MLP(GPTConfig(d_model=8)), 0, 3)
