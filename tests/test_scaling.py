"""A strategy's step on N GPUs in nodes (`shardlab.scaling`): the bytes that leave a node
against the ZeRO paper's volumes, the links each collective is priced on, HSDP's only
cross-node traffic, the shape of the curves, and the crossover against
`network.tokens_to_hide`. Arithmetic on meta models: no process starts."""

import math

import pytest
import torch

from shardlab import hardware, network
from shardlab.models import GPT, GPTConfig
from shardlab.network import H100_NODES
from shardlab.scaling import (GPU_COUNTS, STRATEGIES, crossover_tokens, cluster_machine,
                              hybrid_step, one_group_step)
from shardlab.steptime import gpu_machine, predict_step

Q = 2  # bytes per element of the collectives (bf16)


@pytest.fixture(scope="module")
def model():
    with torch.device("meta"):  # shapes only
        return GPT(GPTConfig(n_layer=4, n_head=8, d_model=256, block_size=256))


@pytest.fixture(scope="module")
def psi(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


FREE_RINGS = cluster_machine(mfu=0.5, hiding=1.0, alpha=0.0)   # bandwidth alone
RINGS = cluster_machine(mfu=0.5, hiding=1.0)                   # and NCCL's α per round


@pytest.mark.parametrize("gpus", [16, 64, 1024])
def test_bytes_leaving_a_node_are_the_zero_papers_volumes(model, psi, gpus):
    """One ring over every GPU leaves each node once: 2qΨ(N-1)/N for DDP and ZeRO-1/2,
    3qΨ(N-1)/N for ZeRO-3 and FSDP2; HSDP's replicas, R = N/8, one GPU per node, all 8
    GPUs at once: 8 · 2(R-1)/R · qΨ/8."""
    ring = (gpus - 1) / gpus * Q * psi
    expected = {"DDP": 2 * ring, "ZeRO-1": 2 * ring, "ZeRO-2": 2 * ring,
                "ZeRO-3": 3 * ring, "FSDP2": 3 * ring}
    replicas = gpus // 8
    expected["HSDP"] = 2 * (replicas - 1) / replicas * Q * psi
    for name, step in STRATEGIES.items():
        assert step(model, gpus, 512, RINGS).leaving_node == pytest.approx(
            expected[name], rel=1e-9), name


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_inside_one_node_every_ring_runs_on_nvlink(model, gpus):
    """N <= 8: nothing leaves the node, and each collective costs what `steptime`'s
    single-link α-β ring prices it at on NVLink, with the same α per round."""
    nvlink = gpu_machine(RINGS.flops, hardware.NCCL_ALPHA, hardware.NVLINK, hiding=1.0)
    for name, step in STRATEGIES.items():
        on_cluster = step(model, gpus, 512, RINGS)
        alone = predict_step(on_cluster.prediction.strategy.replace("hsdp", "torch-fsdp2"),
                             model, gpus, {}, nvlink, tokens=512, bytes_per_elem=Q)
        assert on_cluster.leaving_node == 0, name
        assert [c.seconds for c in on_cluster.prediction.collectives] == pytest.approx(
            [c.seconds for c in alone.collectives], rel=1e-12), name
        assert on_cluster.step_seconds == pytest.approx(alone.step_seconds, rel=1e-12)


def test_across_nodes_a_ring_is_bounded_by_the_nics(model):
    """Past a node, DDP's all-reduce of b bytes takes max(r / NVLink, r / (8 NICs)),
    r = 2(N-1)/N · b; HSDP's replica all-reduce of b/8, each GPU on its own NIC,
    2(R-1)/R · b/8 / NIC."""
    gpus = 64
    ddp = one_group_step("ddp", model, gpus, 512, FREE_RINGS).prediction
    for c in ddp.collectives:
        r = 2 * (gpus - 1) / gpus * c.nbytes
        assert c.seconds == pytest.approx(max(r / hardware.NVLINK,
                                              r / (8 * hardware.NIC)), rel=1e-12)
    assert 8 * hardware.NIC < hardware.NVLINK  # so the NICs bound it
    hsdp = hybrid_step(model, gpus, 512, FREE_RINGS).prediction
    replicas = [c for c in hsdp.collectives if c.op == "all_reduce"]
    assert replicas
    for c in replicas:
        assert c.seconds == pytest.approx(2 * 7 / 8 * c.nbytes / hardware.NIC, rel=1e-6)


@pytest.mark.parametrize("gpus", [16, 128])
def test_hsdp_sends_across_nodes_only_its_replicas_all_reduce(model, psi, gpus):
    """HSDP's in-node collectives are FSDP2's over the node's 8 GPUs, priced on NVLink;
    what it adds is one all-reduce of each unit's 1/8 shard, over R = N/8, and the bytes
    that leave a node are those all-reduces' alone."""
    hsdp = hybrid_step(model, gpus, 512, RINGS)
    in_node = one_group_step("torch-fsdp2", model, 8, 512, RINGS).prediction.collectives
    added = hsdp.prediction.collectives[len(in_node):]
    assert hsdp.prediction.collectives[:len(in_node)] == in_node
    assert {c.op for c in added} == {"all_reduce"}
    scatters = [c for c in in_node if c.op == "reduce_scatter"]
    assert [c.nbytes for c in added] == [c.nbytes // 8 for c in scatters]
    replicas = gpus // 8
    assert hsdp.leaving_node == pytest.approx(sum(
        network.bytes_leaving_node("all_reduce", c.nbytes / 8, replicas, H100_NODES,
                                   ranks_per_node=1) for c in scatters), rel=1e-12)
    assert hsdp.leaving_node == pytest.approx(2 * (replicas - 1) / replicas * Q * psi)


def test_step_grows_with_gpus_and_exposed_falls_with_tokens(model):
    """At fixed tokens per GPU, each collective's ring bytes (N-1)/N and its rounds grow
    with N, compute does not: the step never shrinks. At fixed N, compute grows with the
    tokens and the bytes do not: exposed communication never grows."""
    for name, step in STRATEGIES.items():
        steps = [step(model, n, 512, RINGS).step_seconds for n in GPU_COUNTS]
        assert steps == sorted(steps), name
        assert steps[-1] > steps[0], name
        exposed = [step(model, 64, t, RINGS).exposed_seconds
                   for t in (1, 16, 256, 4096, 65536)]
        assert exposed == sorted(exposed, reverse=True), name


@pytest.mark.parametrize("gpus", [8, 64, 1024])
def test_ddp_crossover_is_tokens_to_hide_but_its_last_bucket(model, gpus):
    """With α = 0 and η = 1, DDP's buckets hide from T* = τ(all-reduce)·F/(4Ψ) tokens
    (`network.tokens_to_hide`), less the share of the last bucket, which never hides."""
    ddp = one_group_step("ddp", model, gpus, 512, FREE_RINGS).prediction
    total = sum(c.nbytes for c in ddp.collectives)
    hide = network.tokens_to_hide("all_reduce", gpus, H100_NODES, bytes_per_param=Q,
                                  flops_per_token=4, flops=FREE_RINGS.flops)
    expected = hide * (1 - ddp.collectives[-1].nbytes / total)
    found = crossover_tokens(STRATEGIES["DDP"], model, gpus, FREE_RINGS)
    assert math.ceil(expected) - 1 <= found <= math.ceil(expected) + 1
    at = one_group_step("ddp", model, gpus, found, FREE_RINGS)
    assert at.exposed_seconds == pytest.approx(ddp.collectives[-1].seconds)


@pytest.mark.parametrize("gpus, tokens, match", [
    (12, 512, "multiple of 8"), (0, 512, "whole number"), (2.5, 512, "whole number"),
    (True, 512, "whole number"), (16, 0, "tokens"), (16, 1.5, "tokens")])
def test_bad_gpus_or_tokens_are_refused_in_one_line(model, gpus, tokens, match):
    for step in STRATEGIES.values():
        with pytest.raises(ValueError, match=match):
            step(model, gpus, tokens, RINGS)


def test_a_machine_without_a_cluster_or_a_bad_mfu_is_refused(model):
    plain = gpu_machine(1e15, 0.0, hardware.NVLINK, hiding=1.0)
    with pytest.raises(ValueError, match="cluster_machine"):
        hybrid_step(model, 16, 512, plain)
    with pytest.raises(ValueError, match="mfu"):
        cluster_machine(mfu=0, hiding=1.0)
