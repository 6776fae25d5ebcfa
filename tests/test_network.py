"""The node-aware communication model and the table of hardware figures."""

import pytest

from shardlab import hardware, memory, network
from shardlab.network import H100_NODES, Cluster
from shardlab.units import GiB


def test_the_h100_node_is_the_scaling_books():
    """Eight GPUs, eight 400 Gb/s NICs: 400 GB/s leave a node."""
    assert H100_NODES.gpus_per_node == 8 and H100_NODES.nics_per_node == 8
    assert H100_NODES.nic_bps * 8 / 1e9 == 400 / 8 * 8       # 400 Gb/s = 50 GB/s each
    assert H100_NODES.node_egress_bps == 400e9


def test_data_parallel_across_h100_nodes_needs_the_scaling_books_tokens():
    """The scaling book's bound for data parallelism across H100 nodes: about 2,500 tokens
    per GPU (F over the 400 GB/s leaving a node), not the 8x larger count of one NIC."""
    for nodes in (2, 8, 64, 512):
        t = network.tokens_to_hide("all_reduce", 8 * nodes, H100_NODES)
        assert 2000 <= t <= 2600, (nodes, t)
    # counted per GPU on its own NIC (what the course used to do) it is 8 times that
    per_gpu_nic = Cluster(8, hardware.NVLINK, hardware.NIC, 1, hardware.H100_BF16_FLOPS)
    ratio = (network.tokens_to_hide("all_reduce", 64, per_gpu_nic)
             / network.tokens_to_hide("all_reduce", 64, H100_NODES))
    assert ratio == pytest.approx(8)


def test_a_layer_gather_behind_its_forward_has_the_same_threshold():
    """All-gather behind 2ΨT FLOPs = all-reduce behind 4ΨT FLOPs."""
    for world in (8, 32, 64):
        assert network.tokens_to_hide("all_gather", world, flops_per_token=2) == \
            pytest.approx(network.tokens_to_hide("all_reduce", world, flops_per_token=4))


def test_inside_a_node_the_ring_runs_on_nvlink():
    t = network.collective_seconds_on_cluster("all_gather", 7e9, 8)
    assert t == pytest.approx(7 / 8 * 7e9 / hardware.NVLINK)
    assert network.bytes_leaving_node("all_gather", 7e9, 8) == 0


def test_one_rank_per_node_gets_one_nic():
    """A group with one rank per node (HSDP's replicas, TP across nodes): all 8 GPUs of a
    node send at once, each at one NIC's rate."""
    t = network.collective_seconds_on_cluster("all_reduce", 1e9, 8, ranks_per_node=1)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / hardware.NIC)


def test_alpha_adds_one_latency_per_round():
    t0 = network.collective_seconds_on_cluster("all_reduce", 1e9, 64)
    t1 = network.collective_seconds_on_cluster("all_reduce", 1e9, 64, alpha=5e-6)
    assert t1 - t0 == pytest.approx(2 * 63 * 5e-6)


def test_the_hsdp_sections_count_per_node():
    """Chapter 5's HSDP section, Llama-2-7B on 64 GPUs, 8 per node, bf16: FSDP's three
    rings over 64 ranks let 3·(N-1)/N·Ψb leave each node, HSDP's replica all-reduces
    2·(R-1)/R·Ψb; the closed form and the hop-by-hop walk agree."""
    psi, n, s, b = memory.num_params("llama-2-7b"), 64, 8, 2
    r = n // s
    node = lambda rank: rank // s  # noqa: E731
    fsdp = 3 * network.bytes_leaving_node("all_gather", psi * b, n)
    hsdp = network.bytes_leaving_node("all_reduce", psi * b / s, r, ranks_per_node=1)
    assert fsdp == pytest.approx(3 * (n - 1) / n * psi * b)
    assert hsdp == pytest.approx(2 * (r - 1) / r * psi * b)
    walk_fsdp = 3 * network.ring_walk_leaving(range(n), node, (n - 1) / n * psi * b)[0]
    walk_hsdp = sum(network.ring_walk_leaving([local + s * k for k in range(r)], node,
                                              2 * (r - 1) / r * psi * b / s).get(0, 0)
                    for local in range(s))
    assert fsdp == pytest.approx(walk_fsdp) and hsdp == pytest.approx(walk_hsdp)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="op"):
        network.collective_seconds_on_cluster("broadcast", 1, 8)
    with pytest.raises(ValueError, match="ranks_per_node"):
        network.collective_seconds_on_cluster("all_reduce", 1, 16, ranks_per_node=3)


def test_every_figure_has_a_unit_and_a_source():
    for f in hardware.FIGURES.values():
        assert f.unit in {"B", "B/s", "FLOP/s", "s"} and f.source
        assert f.text()
    # an "80GB" H100 is 80 GiB of HBM, of which CUDA reports about 79.6 GiB
    assert hardware.H100_MEMORY / GiB == pytest.approx(79.6, abs=0.05)
