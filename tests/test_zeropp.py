"""ZeRO++ (`zeropp`): block quantization's rules, the bytes each of qwZ, hpZ and qgZ sends
per link against the paper's counts (within 1%, the scales' share), the error each
quantization makes on the GPT's real weights and gradients, the losses of 20 steps against
fp32 communication within stated bounds, and bad options refused before any process.

One launch of 4 ranks, two simulated nodes of 2 (the strategy labels its groups
"intra-node" / "inter-node"), runs everything. Measured on a loaded 2-core machine:
about 25 s for the module.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardlab import comm
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.train import run, train_many
from shardlab.workers import run_all
from shardlab.zeropp import dequantize, payload_bytes, quantization_errors, quantize

WORLD, NODE = 4, 2
LOSS_STEPS = 20
LAUNCH_TIMEOUT = 900
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT * 2)

# the paper's setting: weights gathered and gradients reduced in bf16 without ZeRO++
BYTES = {"all": {}, "none": dict(qwz=False, hpz=False, qgz=False),
         "qwZ": dict(hpz=False, qgz=False), "hpZ": dict(qwz=False, qgz=False),
         "qgZ": dict(qwz=False, hpz=False)}
# fp32 training, every collective in fp32 but what each option quantizes
LOSSES = {"fp32": dict(qwz=False, hpz=False, qgz=False), "hpZ": dict(qwz=False, qgz=False),
          "qwZ": dict(hpz=False, qgz=False), "all, 256-element gradient blocks":
          dict(gradient_block=256)}
# the largest |loss - fp32's loss| over 20 steps each may reach (measured: 0.0 for hpZ,
# about 0.01 for qwZ, 0.05 for all three with 256-element gradient blocks)
BOUNDS = {"hpZ": 0.0, "qwZ": 0.03, "all, 256-element gradient blocks": 0.1}


def config(options: dict, **kw) -> TrainConfig:
    return TrainConfig(strategy="zeropp", world=WORLD, measure_memory=False,
                       options={"node_size": NODE, **options}, **kw)


@pytest.fixture(scope="module")
def results():
    byte_runs = [config({"reduce_dtype": "bf16", **o}, steps=2, precision="bf16-mixed")
                 for o in BYTES.values()]
    loss_runs = [config(o, steps=LOSS_STEPS, record_ledger=False) for o in LOSSES.values()]
    ranks = launch(run_all, WORLD, [(train_many, (byte_runs + loss_runs,)),
                                    (quantization_errors, (NODE,))],
                   backend="gloo", timeout=LAUNCH_TIMEOUT)
    reports = ranks[0][0]
    return {"bytes": [dict(zip(BYTES, r[0][:len(BYTES)])) for r in ranks],
            "losses": dict(zip(LOSSES, reports[len(BYTES):])),
            "errors": ranks[0][1]}


def sent_per_link(report, step: int = 1) -> dict[str, int]:
    sent: dict[str, int] = {}
    for r in report.ledger:
        if r.step == step:
            sent[r.link] = sent.get(r.link, 0) + r.sent_bytes
    return sent


@pytest.mark.parametrize("variant", list(BYTES))
def test_bytes_per_link_are_the_papers_counts(results, variant):
    """Each rank, each link, one step of bf16-mixed gpt-tiny: within 1% of
    `comm.zeropp_volume_per_link` (the paper's analysis made exact for N = 4, k = 2),
    above it by the fp32 scales alone (one per 2048 weights, per 1024 gradients)."""
    flags = {"qwz": True, "hpz": True, "qgz": True, **BYTES[variant]}
    for rank_reports in results["bytes"]:
        report = rank_reports[variant]
        predicted = comm.zeropp_volume_per_link(report.psi, WORLD, NODE, 2, **flags)
        sent = sent_per_link(report)
        for link, bytes_ in predicted.items():
            assert bytes_ <= sent.get(link, 0) <= 1.01 * bytes_, (variant, link, sent)
        assert set(sent) <= {"intra-node", "inter-node"}


def test_hpz_keeps_backward_inside_the_node_and_qgz_crosses_with_one_all_to_all(results):
    for rank_reports in results["bytes"]:
        hpz = {(r.link, r.op, r.world) for r in rank_reports["hpZ"].ledger}
        assert hpz == {("inter-node", "all_gather", 4), ("intra-node", "all_gather", 2),
                       ("inter-node", "reduce_scatter", 4)}
        qgz = {(r.link, r.op, r.world) for r in rank_reports["qgZ"].ledger}
        assert ("intra-node", "all_to_all", 2) in qgz and ("inter-node", "all_to_all", 2) \
            in qgz and not any(op == "reduce_scatter" for _, op, _ in qgz)


def test_four_and_a_half_times_fewer_bytes_leave_a_node(results):
    """The paper's count, bytes leaving a node per step: ZeRO-3's 3M(N-1)/N against
    ZeRO++'s M(N-1)/N·1/2 + (R-1)/R·M/4 (Table 1's 3M and 0.75M as N grows); for N = 4 in
    nodes of 2, 4.5 times fewer. Measured from one rank's ledger: its ring collectives
    over all ranks leave the node once (one rank's bytes), the second all-to-all from
    every rank of the node."""
    report = results["bytes"][0]
    none, every = report["none"], report["all"]

    def leaving(rep):
        ring = sum(r.sent_bytes for r in rep.ledger if r.step == 1 and r.link == "inter-node"
                   and r.op != "all_to_all")
        hop2 = sum(r.sent_bytes for r in rep.ledger if r.step == 1 and r.op == "all_to_all"
                   and r.link == "inter-node")
        return ring + NODE * hop2

    psi = none.psi
    zero3 = comm.zeropp_bytes_leaving_node(psi, WORLD, NODE, qwz=False, hpz=False, qgz=False)
    zeropp = comm.zeropp_bytes_leaving_node(psi, WORLD, NODE)
    assert zero3 / zeropp == pytest.approx(4.5)
    assert leaving(none) == zero3
    assert zeropp <= leaving(every) <= 1.01 * zeropp
    assert leaving(none) / leaving(every) == pytest.approx(4.5, rel=0.01)


def test_each_quantization_error_on_the_gpts_weights_and_gradients(results):
    """Relative errors ||x' - x|| / ||x||: int8 weights in 2048-element blocks about 1%;
    int4 gradients about 20%, the first hop's quantization nearly all of it (the second
    quantizes sums whose blocks are as wide)."""
    errors = results["errors"]
    assert 0 < errors["qwz"] < 0.02
    assert 0.1 < errors["qgz"] < 0.35
    assert errors["qgz"] == pytest.approx(errors["qgz_one_hop"], rel=0.1)


@pytest.mark.parametrize("variant", list(BOUNDS))
def test_losses_of_20_steps_against_fp32_communication(results, variant):
    """hpZ moves the weights bit for bit: the same losses. The quantizations stay within
    their stated bounds of fp32's losses over 20 steps."""
    fp32 = results["losses"]["fp32"].losses
    losses = results["losses"][variant].losses
    assert len(losses) == LOSS_STEPS
    worst = max(abs(a - b) for a, b in zip(losses, fp32))
    assert worst <= BOUNDS[variant], (variant, worst)
    assert losses[-1] < losses[0] - 1.0  # and it trains


def test_block_quantization_rules():
    """Each element within half a step of its block (max|block| / (2 q_max)); int4 two to a
    byte, an odd count padded; an all-zero block stays zero; the payload's size."""
    torch.manual_seed(0)
    for bits, q_max in ((8, 127), (4, 7)):
        for n in (1, 7, 300, 1025):
            x = torch.randn(3, n) * torch.logspace(-3, 1, n)
            back = dequantize(quantize(x, bits, 64), n, bits, 64)
            blocks = torch.nn.functional.pad(x, (0, -n % 64)).view(3, -1, 64)
            step = blocks.abs().amax(dim=2).repeat_interleave(64, dim=1)[:, :n] / q_max
            assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all(), (bits, n)
            assert quantize(x, bits, 64).shape == (3, payload_bytes(n, bits, 64))
    assert payload_bytes(1025, 4, 64) == math.ceil(1025 / 2) + 4 * 17
    assert (dequantize(quantize(torch.zeros(5), 4, 4), 5, 4, 4) == 0).all()
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize(torch.ones(4), 2, 4)
    with pytest.raises(ValueError, match="a payload of 4 elements"):
        dequantize(torch.zeros(9, dtype=torch.uint8), 4, 8, 4)


@pytest.mark.parametrize("options, message", [
    ({}, "needs option node_size"),
    ({"node_size": 3}, r"node_size must be a whole number that divides the world size 4, "
                       r"got 3; use one of \[1, 2, 4\]"),
    ({"node_size": 2, "qgz": "yes"}, "qgz must be True or False"),
    ({"node_size": 2, "weight_block": 1000.0}, "weight_block must be an even whole number"),
    ({"node_size": 2, "gradient_block": 3}, "gradient_block must be an even whole number"),
    ({"node_size": 2, "qgZ": True}, r"unknown option\(s\) \['qgZ'\]"),
])
def test_bad_options_are_refused_before_any_process_starts(options, message):
    with pytest.raises(ValueError, match=message):
        run(TrainConfig(strategy="zeropp", world=4, options=options), timeout=1)
