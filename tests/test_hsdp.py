"""HSDP (`hsdp`, the course's; `torch-hsdp`, PyTorch's `fully_shard` on a 2-D mesh):
the same losses and parameters as each other bit for bit and as a single process within
the fp32 bound, the model states of FSDP over S ranks, the ledger's bytes split by link
equal to the analysis, a checkpoint that resumes under `fsdp2` on another world size,
and the shard-group size refused before any process starts.

Two launches hold every run. 4 ranks, for (N, S) = (4, 2) (two "nodes" of two) and
(4, 1) (DDP-like: every rank its own shard group): parity of both strategies with each
other and with `single`; the training loop's runs, whose reports carry the ledger (each
record labelled with its group's link) and the bytes held; an `hsdp` run that saves a
checkpoint halfway. 2 ranks: `fsdp2`, and `hsdp` with S = 1, resume that checkpoint.

Ours and PyTorch's run the same arithmetic in the same order (one reduce-scatter per
unit in the shard group, then one all-reduce of the shard across groups, the division
by N after both), so they are compared for exact equality, as in `test_fsdp.py`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import sharded_workers as w
from shardlab import comm, network
from shardlab.comm import hsdp_volume_per_link, volume_per_rank
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.memory import model_states
from shardlab.train import run, train_many
from shardlab.workers import run_all, train_across_nodes

STEPS = 6
SHAPES = [(4, 2), (4, 1)]  # (N, S)
K = 2                      # the checkpoint's step
LOOP_STEPS = 2             # of the training loop's runs, which report bytes
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4  # another world size: the fp32 bound of the parity tests
LAUNCH_TIMEOUT = 900
pytestmark = pytest.mark.timeout(LAUNCH_TIMEOUT * 2)


def loop(strategy: str, shard_group: int | None = None, **kw) -> TrainConfig:
    options = {} if shard_group is None else {"shard_group": shard_group}
    return TrainConfig(strategy=strategy, world=4, steps=LOOP_STEPS, options=options, **kw)


LOOP_RUNS = {(s, n_s[1]): loop(s, n_s[1]) for n_s in SHAPES for s in ("hsdp", "torch-hsdp")}
LOOP_RUNS[("fsdp2", 4)] = loop("fsdp2")
# the simulated slow link: this α and β made 4 x slower for the inter-node groups
FAST, SLOWER = comm.Link(alpha=1e-4, beta=1e9), 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    folder, torch_folder = str(root / "ckpt"), str(root / "torch-ckpt")
    parity = []
    for _, s in SHAPES:
        parity.append(dict(strategy="hsdp", options={"shard_group": s}))
        parity.append(dict(strategy="torch-hsdp", options={"shard_group": s},
                           same_as=len(parity) - 1))
    full = TrainConfig(strategy="hsdp", world=4, steps=2 * K, options={"shard_group": 2},
                       keep_params=True, record_ledger=False, measure_memory=False)
    saving = replace(full, steps=K, save_every=K, checkpoint_dir=folder)
    torch_saving = replace(saving, strategy="torch-hsdp", checkpoint_dir=torch_folder)
    throttled = [(LOOP_RUNS[("hsdp", 2)], SLOWER)]
    ranks = launch(run_all, 4, [(w.parity_cases, (parity, STEPS)),
                                (train_many, ([*LOOP_RUNS.values(), full, saving, torch_saving],)),
                                (train_across_nodes, (throttled, 2, FAST))],
                   backend="gloo", timeout=LAUNCH_TIMEOUT)
    resumed_as = [replace(full, world=2, strategy=s, options=o, resume=True,
                          checkpoint_dir=folder)
                  for s, o in (("fsdp2", {}), ("hsdp", {"shard_group": 1}))]
    resumed_as.append(replace(resumed_as[0], checkpoint_dir=torch_folder))
    resumed = launch(train_many, 2, resumed_as, backend="gloo", timeout=LAUNCH_TIMEOUT)
    loops = [dict(zip(LOOP_RUNS, r[1][:len(LOOP_RUNS)])) for r in ranks]
    return {"parity": [r[0] for r in ranks], "loops": loops,
            "full": ranks[0][1][-3],
            "resumed": dict(zip(("fsdp2", "hsdp", "fsdp2 from torch-hsdp"), resumed[0])),
            "throttled": [r[2][1][0] for r in ranks]}


def test_hsdp_and_torch_hsdp_are_registered():
    from shardlab.cards import CARDS
    assert {"hsdp", "torch-hsdp"} <= set(CARDS)


def test_hsdp_matches_pytorch_hsdp_exactly(results):
    for rank_results in results["parity"]:
        compared = [r for r in rank_results if "same_as" in r["case"]]
        assert len(compared) == len(SHAPES)
        for r in compared:
            assert r["loss_diff_vs_same_as"] == 0.0, r["case"]
            assert r["param_diff_vs_same_as"] == 0.0, r["case"]


def test_hsdp_trains_like_a_single_process(results):
    for rank_results in results["parity"]:
        for r in rank_results:
            w.check_parity(r, STEPS)


@pytest.mark.parametrize("strategy", ["hsdp", "torch-hsdp"])
@pytest.mark.parametrize("shape", SHAPES)
def test_hsdp_holds_the_model_states_of_fsdp_over_s_ranks(results, strategy, shape):
    """Shards of Ψ/S, not Ψ/N: each rank of a replica holds what FSDP over S ranks does
    (gpt-tiny's dims divide by 1, 2 and 4: no padding). AdamW adds its step counter, one
    fp32 number per parameter."""
    _, s = shape
    for rank_loops in results["loops"]:
        report = rank_loops[(strategy, s)]
        predicted = model_states(report.psi, s, 3, "fp32", "adamw")
        counters = 4 * len(results["full"].params)
        held = report.state_bytes
        assert (held["params"], held["grads"], held["optimizer"]) == (
            predicted.params, predicted.grads, predicted.optimizer + counters), strategy


@pytest.mark.parametrize("strategy", ["hsdp", "torch-hsdp"])
@pytest.mark.parametrize("shape", SHAPES)
def test_ledger_bytes_per_link_equal_the_analysis(results, strategy, shape):
    """Every step: FSDP's 3Ψ(S-1)/S inside the shard group, an all-reduce of the Ψ/S shard
    (2(R-1)/R·Ψ/S) across the groups; nothing else. S = 1: inside, groups of one send
    nothing; across, DDP's all-reduce."""
    n, s = shape
    for rank_loops in results["loops"]:
        report = rank_loops[(strategy, s)]
        predicted = hsdp_volume_per_link(report.psi, n, s, bytes_per_elem=4)
        for step in range(LOOP_STEPS):
            sent: dict[str, int] = {}
            for r in report.ledger:
                if r.step == step:
                    sent[r.link] = sent.get(r.link, 0) + r.sent_bytes
            assert sent.get("intra-node", 0) == predicted["intra-node"], (strategy, step)
            assert sent["inter-node"] == predicted["inter-node"], (strategy, step)
            assert set(sent) <= {"intra-node", "inter-node"}, sent
        ops = {(r.link, r.op) for r in report.ledger}
        assert ("inter-node", "all_reduce") in ops
        assert not {op for link, op in ops if link == "inter-node"} - {"all_reduce"}


@pytest.mark.parametrize("strategy", ["hsdp", "torch-hsdp"])
def test_one_replica_all_reduce_per_unit_and_step(results, strategy):
    """PyTorch's FSDP2 on a 2-D mesh (and ours) all-reduces across the replicas once per
    unit and step, each unit's reduced shard after its reduce-scatter (`foreach_reduce`):
    as many inter-node all-reduces as units, not one per step. What `hsdp_step_seconds`
    and `network.hsdp_collectives_seconds` lay on the replica lane."""
    from shardlab.models import build_model
    from shardlab.wrap import unit_modules
    units = len(unit_modules(build_model("gpt-tiny"), "auto"))
    assert units > 1
    for rank_loops in results["loops"]:
        report = rank_loops[(strategy, 2)]
        for step in range(LOOP_STEPS):
            ops = [(r.link, r.op) for r in report.ledger if r.step == step]
            assert ops.count(("inter-node", "all_reduce")) == units, (strategy, step)
            assert ops.count(("intra-node", "reduce_scatter")) == units, (strategy, step)


def test_what_crosses_the_slow_link_hsdp_against_fsdp_over_all_ranks(results):
    """FSDP over all 4 ranks runs every collective on rings that span both "nodes":
    3Ψ·3/4 per rank and step. HSDP (4, 2) sends 2·(1/2)·Ψ/2 across: 4.5 × less."""
    fsdp = results["loops"][0][("fsdp2", 4)]
    hsdp = results["loops"][0][("hsdp", 2)]
    last = fsdp.ledger[-1].step
    fsdp_sent = sum(r.sent_bytes for r in fsdp.ledger if r.step == last)
    hsdp_across = sum(r.sent_bytes for r in hsdp.ledger
                      if r.step == last and r.link == "inter-node")
    assert fsdp_sent == volume_per_rank("fsdp2", fsdp.psi, 4, bytes_per_elem=4)
    assert fsdp_sent / hsdp_across == pytest.approx(4.5)


def test_an_hsdp_checkpoint_resumes_under_fsdp2_on_two_ranks(results):
    """Saved on 4 ranks by HSDP (replica 0 writes), resumed by `fsdp2` on 2 ranks and by
    HSDP with S = 1 (every rank a replica that reads its piece whole); saved by PyTorch's
    HSDP (its 2-D DTensors), resumed by `fsdp2`: the steps after the checkpoint match the
    uninterrupted HSDP run within the fp32 bound."""
    full = results["full"]
    for strategy, moved in results["resumed"].items():
        assert moved.first_step == K, strategy
        assert moved.losses == pytest.approx(full.losses[K:], abs=LOSS_TOL), strategy
        assert set(moved.params) == set(full.params)
        for name, p in full.params.items():
            assert (moved.params[name] - p).abs().max().item() <= PARAM_TOL, (strategy, name)


def test_the_simulated_slow_link_changes_time_and_nothing_else(results):
    """A throttled inter-node link: the same losses bit for bit and the same records by
    link; each inter-node collective lasts at least the sleep the throttle adds (a lower
    bound, which a sleep guarantees, not a timing), the intra-node ones are not slowed
    by it."""
    extra = comm.Throttle(FAST.alpha * (SLOWER - 1), (SLOWER - 1) / FAST.beta)
    for plain, slowed in zip((r[("hsdp", 2)] for r in results["loops"]),
                             results["throttled"]):
        assert slowed.losses == plain.losses
        assert [(r.link, r.op, r.sent_bytes) for r in slowed.ledger] == \
            [(r.link, r.op, r.sent_bytes) for r in plain.ledger]
        inter = [r for r in slowed.ledger if r.link == comm.INTER]
        assert inter
        for r in inter:
            assert r.seconds >= extra.seconds(r.op, r.numel, r.world, 4) > 0


def test_throttle_and_link_arithmetic():
    t = comm.Throttle(alpha=1e-3, seconds_per_byte=1e-9)
    # all-reduce of 1000 fp32 on 4 ranks: 6 rounds of 250 elements (1000 bytes)
    assert t.seconds("all_reduce", 1000, 4, 4) == pytest.approx(6 * (1e-3 + 1000e-9))
    with pytest.raises(ValueError, match="alpha must be a finite number"):
        comm.throttle_link(comm.INTER, alpha=-1.0)
    with pytest.raises(ValueError, match="seconds_per_byte must be a finite number"):
        comm.throttle_link(comm.INTER, seconds_per_byte=float("nan"))
    with pytest.raises(ValueError, match="name the link to throttle"):
        comm.throttle_link("", 1e-3)
    link = comm.Link(1e-5, 1e9)
    units = [4096, 8192]
    # S = N is FSDP inside a node; S = 1 is DDP's all-reduce across
    fsdp_like = comm.hsdp_step_seconds(units, 4, 4, link, link.slowed(8))
    assert fsdp_like.intra_node == pytest.approx(comm.fsdp_step_seconds(units, 4, link))
    assert fsdp_like.inter_node == 0.0
    assert fsdp_like.overlapped == pytest.approx(fsdp_like.serial)
    ddp_like = comm.hsdp_step_seconds(units, 4, 1, link, link)
    assert ddp_like.intra_node == 0.0
    assert ddp_like.inter_node == pytest.approx(sum(
        comm.predict_seconds("all_reduce", b, 4, link.alpha, link.beta) for b in units))
    assert hsdp_volume_per_link(1000, 8, 2) == {"intra-node": 1500.0, "inter-node": 750.0}
    with pytest.raises(ValueError, match="shard_group must divide world"):
        hsdp_volume_per_link(1000, 8, 3)


def test_the_node_model_of_hsdp_against_fsdp():
    """On the course's H100 nodes, HSDP inside a node is FSDP over the node plus an
    all-reduce of Ψ/S across nodes, one NIC per GPU; with one replica it is FSDP."""
    nbytes, world, s = 2e9, 64, 8
    h = network.hsdp_collectives_seconds(nbytes, world, s, units=4)
    assert h.intra_node == pytest.approx(network.fsdp_collectives_seconds(nbytes, s))
    assert h.inter_node == pytest.approx(network.collective_seconds_on_cluster(
        "all_reduce", nbytes / s, world // s, ranks_per_node=1))
    assert network.hsdp_collectives_seconds(nbytes, s, s, units=4).inter_node == 0.0
    with pytest.raises(ValueError, match="shard_group must divide"):
        network.hsdp_collectives_seconds(nbytes, world, 16, units=4)
    with pytest.raises(ValueError, match="units must be a whole number"):
        network.hsdp_collectives_seconds(nbytes, world, s, units=0)


def test_fsdp2_overlaps_each_units_replica_all_reduce_with_the_next_units_gathers():
    """FSDP2's schedule on two lanes (`comm.hsdp_overlap`), by hand: units in backward
    order with gathers g, reduce-scatters r, all-reduces a. In-node: the forward's
    gathers, then g1, g2 (prefetched), r1, g3, r2, r3. Each all-reduce starts when its
    unit's reduce-scatter and the previous all-reduce are done; the step ends with the
    later lane. With one unit nothing can overlap: the serial sum."""
    g, r, a = 1.0, 2.0, 5.0
    # forward 3g = 3; in-node r1 ends 3+g+g+r = 7, r2 at 10, r3 at 12; replicas: a1 7..12,
    # a2 12..17, a3 17..22
    assert comm.hsdp_overlap([g] * 3, [(g, r, a)] * 3) == 22.0
    # a short all-reduce hides behind the in-node lane but for the last one
    assert comm.hsdp_overlap([g] * 3, [(g, r, 0.5)] * 3) == 12.5
    assert comm.hsdp_overlap([g], [(g, r, a)]) == g + g + r + a
    link, slow = comm.Link(1e-5, 1e9), comm.Link(1e-4, 1e8)
    units = [8192] * 6
    h = comm.hsdp_step_seconds(units, 8, 2, link, slow)
    assert max(h.intra_node, h.inter_node) < h.overlapped < h.serial


def test_chapter_5_problem_4_hsdp_overlapped_is_ahead_of_fsdp_at_every_nic_rate():
    """Llama-2-7B in bf16 on 64 H100s, 8 a node, one unit per layer and the root (33),
    bandwidth only. FSDP: 3 rings over 64 GPUs, each as slow as the node's 400 GB/s of
    NICs, 99.5 ms. HSDP: 78.6 ms of NVLink and 59.0 ms of one NIC per GPU, 137.6 ms one
    after the other (what the course's model said before, FSDP ahead) but 87.5 ms as
    FSDP2 overlaps the all-reduces with backward's gathers and reduce-scatters. Ahead at
    every NIC rate: with NICs far faster both are NVLink-bound (78.6 against 88.4 ms),
    far slower the ratio tends to the bytes each puts on a NIC, 3·63/64 : 2·7/8 = 1.69."""
    from dataclasses import replace

    from shardlab.memory import num_params
    nbytes, n, s, units = 2 * num_params("llama-2-7b"), 64, 8, 33
    fsdp = network.fsdp_collectives_seconds(nbytes, n)
    hsdp = network.hsdp_collectives_seconds(nbytes, n, s, units=units)
    assert 1e3 * fsdp == pytest.approx(99.5, abs=0.05)
    assert 1e3 * hsdp.intra_node == pytest.approx(78.6, abs=0.05)
    assert 1e3 * hsdp.inter_node == pytest.approx(59.0, abs=0.05)
    assert 1e3 * hsdp.serial == pytest.approx(137.6, abs=0.05)
    assert 1e3 * hsdp.overlapped == pytest.approx(87.5, abs=0.05)
    for slower in (0.01, 0.1, 0.5, 1, 1.25, 2, 4, 16, 1000):
        nodes = replace(network.H100_NODES, nic_bps=network.H100_NODES.nic_bps / slower)
        f = network.fsdp_collectives_seconds(nbytes, n, nodes)
        h = network.hsdp_collectives_seconds(nbytes, n, s, nodes, units=units)
        assert h.overlapped < f, slower
    assert f / h.overlapped == pytest.approx(3 * 63 / 64 / (2 * 7 / 8), rel=0.01)


@pytest.mark.parametrize("strategy", ["hsdp", "torch-hsdp"])
@pytest.mark.parametrize("options, message", [
    ({}, "needs option shard_group=S"),
    ({"shard_group": 3}, "shard_group must be a whole number >= 1 that divides the world "
                         r"size 4, got 3; use one of \[1, 2, 4\]"),
    ({"shard_group": 0}, "got 0"),
    ({"shard_group": -2}, "got -2"),
    ({"shard_group": 2.0}, "got 2.0"),
    ({"shard_group": "2"}, "got '2'"),
    ({"shard_group": True}, "got True"),
    ({"shard_group": 2, "shard": 2}, r"unknown option\(s\) \['shard'\]"),
])
def test_a_bad_shard_group_is_refused_before_any_process_starts(strategy, options, message):
    with pytest.raises(ValueError, match=message):
        run(TrainConfig(strategy=strategy, world=4, options=options), timeout=1)
