"""Muon on the course's sharded strategies: every design equals PyTorch's own Muon.

Every design a strategy's card honours (`muon_designs`) trains gpt-tiny for 6 steps on 2,
3 and 4 gloo ranks (one launch per world size, all its cases inside), 8 rows per rank;
on 3 ranks each rank's rows come as 4 micro-batches of 2 (gradient accumulation). Each
run is compared with one process stepping `torch.optim.Muon` + `torch.optim.AdamW` on
the whole global batch in one micro-batch.

The parity bound. Muon orthogonalizes in bf16 (torch/optim/_muon.py casts the update to
bf16 first), so a last-bit difference of an fp32 gradient, the only thing N ranks change
(they sum the gradient in another order), can flip a bf16 rounding, and the update moves
by a bf16 ulp. PyTorch's own Muon in one process does the same when only its summation
order changes: the reference trained as 2, 4 or 8 micro-batches instead of 1 (one
variant on each rank past the first, beside the rank 0 that trains the reference) lands
at a `drift` from itself (2.5e-4 to 3.9e-4 in parameters, 4e-6 to 1.5e-5 in losses on
gpt-tiny after 6 steps, two orders of magnitude above AdamW's, test_zero.py).
Every run's parameters must land within twice the drift and within 1e-3 (a third of one
step of the widest matrix at lr 1e-3), its losses within 1e-4 (a loss is one number a
step, its drift too noisy to scale by). The bound would pass a small systematic error,
so three exact checks stand beside it: on 2 ranks (where a sum of two gradients has one
order) every design of every strategy equals PyTorch's Muon under DDP to 1e-6; on every
world size the gather and owner designs of one strategy equal each other bit for bit
(they differ only in which rank orthogonalizes the same bf16 input; the whole design
lays ZeRO's buckets out anew, so its gradients are summed in other orders on 3 and 4
ranks); and the bytes, held matrices and Newton-Schulz calls equal their formulas exactly.

Newton-Schulz calls: per step, the gather design calls it on every rank once per hidden
matrix (N x 8 calls summed over ranks: the redundant compute it buys simplicity with);
owner and whole once per hidden matrix in all (8), each call on a whole matrix's shape,
whatever the micro-batches. A Muon that switched itself off (DeepSpeed PR #8438, rehearsed
here) makes 0 calls and fails the check; one that ran per micro-batch (PR #8600) would
make 4x as many on 3 ranks.

Cost: three launches (2, 3 and 4 ranks, 13, 12 and 12 runs) and a few seconds without a
launch: 60 s on this 2-core machine while other suites ran beside it (load 9).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import muon_workers as w
from shardlab.cards import card
from shardlab.comm.whole_matrix import whole_layout_extra_bytes
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.muon import hidden_matrices
from shardlab.muon_costs import design_costs

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"),
                                reason="torch.optim.Muon is in torch >= 2.9")

STRATEGIES = ("zero1", "zero2", "zero3", "fsdp2", "torch-fsdp2")
STEPS, ROWS = 6, 8  # steps; rows per rank per step
MICRO = {2: 1, 3: 4, 4: 1}  # micro-batches per step, by world size
PARAM_BOUND, LOSS_BOUND = 1e-3, 1e-4
HIDDEN = 8  # gpt-tiny's hidden matrices: qkv, proj, fc, proj in each of 2 blocks


def config(world: int, strategy: str, optimizer: str, grad_accum: int = 1) -> TrainConfig:
    return TrainConfig(strategy=strategy, world=world, optimizer=optimizer, steps=STEPS,
                       batch_size=ROWS * world, seq_len=16, grad_accum=grad_accum,
                       measure_memory=False, keep_params=True)


def cases(world: int) -> list[TrainConfig]:
    out = [config(world, s, f"muon:{d}", MICRO[world])
           for s in STRATEGIES for d in card(s).muon_designs]
    if world == 2:  # PyTorch's Muon under DDP: the same gradient bits on 2 ranks
        out.append(config(world, "ddp", "muon"))
    return out


@pytest.fixture(scope="module", params=[2, 3, 4])
def launched(request):
    world = request.param
    ranks = launch(w.muon_cases, world, cases(world), world == 2, timeout=600)
    return world, ranks


def reference(ranks) -> tuple[dict, tuple[float, float]]:
    """The single-process run (rank 0 trained it in one micro-batch), and its drift: the
    farthest the same run in 2**r micro-batches (rank r's) lands from it (losses,
    parameters)."""
    ref, *others = [r["single"] for r in ranks]
    drifts = [distance(other, ref) for other in others]
    return ref, (max(d[0] for d in drifts), max(d[1] for d in drifts))


def distance(run, ref) -> tuple[float, float]:
    def get(x, key):
        return x[key] if isinstance(x, dict) else getattr(x, key)

    losses = max(abs(a - b) for a, b in zip(get(run, "losses"), get(ref, "losses")))
    params = max((get(run, "params")[k] - get(ref, "params")[k]).abs().max().item()
                 for k in get(ref, "params"))
    return losses, params


def check_newton_schulz_calls(ranks: list, design: str, shapes: Counter) -> None:
    """Per step: gather calls Newton-Schulz once per hidden matrix on every rank; owner
    and whole once per hidden matrix in all; every call on a whole matrix."""
    world = len(ranks)
    for step in range(len(ranks[0].calls)):
        calls = [tuple(shape) for r in ranks for shape in r.calls[step]]
        expected = Counter({s: n * (world if design == "gather" else 1)
                            for s, n in shapes.items()})
        assert Counter(calls) == expected, (design, step, Counter(calls), expected)


def hidden_shapes() -> Counter:
    model = build_model("gpt-tiny")
    return Counter(tuple(p.shape) for p in hidden_matrices(model).values())


def test_parity_with_torch_muon_in_one_process(launched):
    world, ranks = launched
    ref, (loss_drift, param_drift) = reference(ranks)
    assert param_drift <= PARAM_BOUND and loss_drift <= LOSS_BOUND
    for run in ranks[0]["runs"]:
        assert len(run.losses) == STEPS and run.grad_accum == MICRO[world]
        losses, params = distance(run, ref)
        assert losses <= LOSS_BOUND, (run.strategy, run.optimizer, losses)
        assert params <= 2 * param_drift and params <= PARAM_BOUND, \
            (run.strategy, run.optimizer, params, param_drift)
        assert run.losses[-1] < run.losses[0]
    for rank in ranks[1:]:  # every rank reports the same losses
        assert [r.losses for r in rank["runs"]] == [r.losses for r in ranks[0]["runs"]]


def test_designs_on_one_layout_agree_bit_for_bit(launched):
    world, ranks = launched
    by_strategy: dict[str, list] = {}
    for run in ranks[0]["runs"]:
        if run.design in ("gather", "owner"):
            by_strategy.setdefault(run.strategy, []).append(run)
    for strategy in STRATEGIES:
        first, *others = by_strategy[strategy]
        for run in others:
            assert run.losses == first.losses, (strategy, run.design)
            assert all(torch.equal(run.params[k], first.params[k]) for k in first.params), \
                (strategy, run.design)


def test_on_two_ranks_every_design_is_torch_muon_under_ddp(launched):
    world, ranks = launched
    if world != 2:
        pytest.skip("two ranks sum a gradient in one order; more ranks in several")
    *runs, ddp = ranks[0]["runs"]
    assert ddp.strategy == "ddp"
    for run in runs:
        assert distance(run, ddp)[1] <= 1e-6, (run.strategy, run.design)


def test_newton_schulz_runs_once_per_hidden_matrix_per_step(launched):
    world, ranks = launched
    shapes = hidden_shapes()
    assert sum(shapes.values()) == HIDDEN
    for i, run in enumerate(ranks[0]["runs"]):
        if run.strategy == "ddp":  # torch's own Muon: its calls are not ours to count
            continue
        assert run.hidden == HIDDEN
        check_newton_schulz_calls([r["runs"][i] for r in ranks], run.design, shapes)


def test_the_silent_off_of_deepspeed_8438_fails_the_count(launched):
    world, ranks = launched
    if world != 2:
        pytest.skip("rehearsed once, on 2 ranks")
    silent = [r["silent_off"] for r in ranks]
    assert all(calls == [] for rank in silent for calls in rank)

    class Calls:  # what the check reads of a run
        def __init__(self, calls):
            self.calls = calls

    with pytest.raises(AssertionError):
        check_newton_schulz_calls([Calls(c) for c in silent], "gather", hidden_shapes())


def test_bytes_held_matrices_and_compute_equal_the_formulas(launched):
    world, ranks = launched
    for rank in ranks:
        for run in rank["runs"]:
            if run.strategy == "ddp":
                continue
            p = run.predicted
            assert (run.sent, run.held) == (p["sent"], p["held"]), (run.strategy, run.design)
            assert all(len(step) == p["calls"] for step in run.calls)
            assert run.flops == p["flops"]
            if run.design == "whole":
                assert run.sent == run.held == 0


def test_the_cost_model_predicts_the_runs_bytes_memory_and_compute(launched):
    """`muon_costs.design_costs` (the chapter's figure of which design wins) reads the same
    formulas over FSDP2's cut: its slowest rank is the measured one."""
    world, ranks = launched
    shapes = [tuple(p.shape) for p in hidden_matrices(build_model("gpt-tiny")).values()]
    costs = design_costs(shapes, world, flops_per_s=1e12, alpha=0.0, beta=1e9)
    for design in ("gather", "owner"):
        runs = [r for rank in ranks for r in rank["runs"]
                if (r.strategy, r.design) == ("fsdp2", design)]
        assert (costs[design].sent, costs[design].held, costs[design].flops) == \
            (max(r.sent for r in runs), max(r.held for r in runs), max(r.flops for r in runs))


def test_whole_matrix_shards_pay_in_zero_s_padding(launched):
    """muon:whole sends nothing of its own; ZeRO's buckets of matrices, laid out whole,
    move their padding instead (gpt-tiny's 8 matrices fit one bucket)."""
    world, ranks = launched
    sizes = [p.numel() for p in hidden_matrices(build_model("gpt-tiny")).values()]
    extra = whole_layout_extra_bytes([sizes], world)
    for rank in ranks:
        by = {(r.strategy, r.design): r for r in rank["runs"]}
        for strategy in ("zero1", "zero2"):
            padded = by[(strategy, "whole")].strategy_sent - by[(strategy, "gather")].strategy_sent
            assert padded == extra, (strategy, padded, extra)
    if world == 4:
        assert extra > 0  # 4 ranks cannot share gpt-tiny's 8 matrices evenly


# ----------------------------------------------------------------------------- no launch


def test_newton_schulz_is_torch_s_bit_for_bit():
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    from shardlab.muon import adjusted_lr, newton_schulz
    from shardlab.muon.newton_schulz import COEFFICIENTS, EPS, STEPS

    torch.manual_seed(0)
    for shape in [(16, 64), (64, 16), (48, 16), (16, 16)]:
        g = torch.randn(shape)
        assert torch.equal(newton_schulz(g),
                           _zeropower_via_newtonschulz(g, COEFFICIENTS, STEPS, EPS)), shape
        bf16 = g.bfloat16()
        kept = bf16.clone()
        newton_schulz(bf16)
        assert torch.equal(bf16, kept)  # a bf16 input is left as it is
        for fn in (None, "original", "match_rms_adamw"):
            assert adjusted_lr(0.02, fn, torch.Size(shape)) == _adjust_lr(0.02, fn, shape)


def test_the_split_gives_muon_the_hidden_matrices_and_adamw_the_rest():
    model = build_model("gpt-tiny")
    hidden = hidden_matrices(model)
    assert sorted(hidden) == sorted(f"blocks.{i}.{m}.weight" for i in (0, 1)
                                    for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))
    # the tied embedding/head, the position embedding, norms and biases: AdamW's
    assert not {"tok_emb.weight", "lm_head.weight", "pos_emb.weight"} & set(hidden)
    toy = hidden_matrices(build_model("toy-tied"))  # its head is its embedding
    assert sorted(toy) == ["fc1.weight", "fc2.weight"]


def test_the_single_process_reference_is_torch_s_muon_and_adamw():
    """`single` with "muon" steps exactly as torch.optim.Muon + torch.optim.AdamW built by
    hand over the split (with Moonshot's learning-rate adjustment)."""
    from shardlab.models import get_batch, loss_fn
    from shardlab.muon import MUON_DEFAULTS
    from shardlab.precision import get_precision
    from shardlab.optimizers import optimizer_spec
    from shardlab.strategy import get_strategy

    ours = get_strategy("single")(build_model("gpt-tiny"), get_precision("fp32"),
                                  optimizer_spec("muon", 1e-3), {})
    model = build_model("gpt-tiny")
    hidden = {id(p) for p in hidden_matrices(model).values()}
    params = list(model.parameters())
    by_hand = [torch.optim.Muon([p for p in params if id(p) in hidden], lr=1e-3,
                                **MUON_DEFAULTS),
               torch.optim.AdamW([p for p in params if id(p) not in hidden], lr=1e-3)]
    for step in range(2):
        x, y = get_batch(step, 0, 1, 4, 16)
        loss_fn(ours.model(x), y).backward()
        ours.optimizer.step()
        ours.optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        for opt in by_hand:
            opt.step()
            opt.zero_grad()
    for (name, a), b in zip(ours.model.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name


def test_bad_input_is_refused_in_one_line():
    from shardlab.muon import Place, ShardedMuon
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.strategy import get_strategy

    def refused(match, call):
        with pytest.raises(ValueError, match=match) as caught:
            call()
        assert "\n" not in str(caught.value)

    # a design the strategy cannot honour, named, before any rank starts
    refused(r"strategy 'fsdp2' cannot honour muon:whole: it honours muon:gather, "
            r"muon:owner", lambda: TrainConfig(strategy="fsdp2", world=2,
                                               optimizer="muon:whole").validate())
    refused(r"strategy 'ddp' cannot honour muon:owner: it honours muon:whole",
            lambda: TrainConfig(strategy="ddp", world=2, optimizer="muon:owner").validate())
    refused(r"strategy 'hsdp' cannot step muon; the strategies that can: \['single'",
            lambda: TrainConfig(strategy="hsdp", world=2, optimizer="muon").validate())
    refused(r"unknown optimizer 'muon:scatter'",
            lambda: TrainConfig(optimizer="muon:scatter").validate())
    refused(r"muon runs in fp32 here .* got precision 'bf16-mixed'",
            lambda: TrainConfig(strategy="zero1", world=2, optimizer="muon",
                                precision="bf16-mixed").validate())
    refused(r"cannot save_every with shardlab's checkpoints: Muon's momentum",
            lambda: TrainConfig(strategy="zero1", world=2, optimizer="muon", save_every=1,
                                checkpoint_dir="unused").validate())
    # Muon asked to step a parameter that is not 2-D: named
    everything = replace_rule(optimizer_spec("muon", 1e-3), lambda model, name, p: True)
    refused(r"Muon steps 2-D matrices only; parameter 'blocks.0.ln1.weight' has shape "
            r"\(64,\): leave it to AdamW",
            lambda: get_strategy("single")(build_model("gpt-tiny"), get_precision("fp32"),
                                           everything, {}))
    flat = torch.zeros(8)
    refused(r"parameter 'norm.weight' has shape \(8,\)",
            lambda: ShardedMuon([Place("norm.weight", torch.Size([8]), flat, slice(0, 8),
                                       ((0, 0, 8),))], design="gather",
                                hidden=frozenset({"norm.weight"}), lr=1e-3))
    # the whole design over a layout that cuts through a matrix: named
    cut = Place("w", torch.Size([4, 4]), flat, slice(0, 8), ((0, 0, 8), (1, 8, 16)))
    refused(r"muon:whole needs each matrix whole on one rank, and 'w' is cut across ranks "
            r"\[0, 1\]", lambda: ShardedMuon([cut], design="whole", hidden=frozenset({"w"}),
                                             lr=1e-3))


def replace_rule(spec, rule):
    from dataclasses import replace

    return replace(spec, rule=rule)


def test_whole_layout_puts_every_matrix_on_one_rank():
    from shardlab.zero.layout import whole_offsets

    sizes = [p.numel() for p in hidden_matrices(build_model("gpt-tiny")).values()]
    for world in (2, 3, 4):
        offsets, padded = whole_offsets(sizes, world)
        chunk = padded // world
        spans = sorted((o, o + n) for o, n in zip(offsets, sizes))
        assert all(a // chunk == (z - 1) // chunk for a, z in spans)  # one rank each
        assert all(z <= a2 for (_, z), (a2, _) in zip(spans, spans[1:]))  # no overlap
        assert padded == world * chunk >= sum(sizes)


def test_the_formulas_by_hand():
    """A 4 x 4 matrix on 2 ranks cut by rows (8 elements each), owned by rank 1; and a
    flat cut of 3 and 13 elements."""
    from shardlab.comm.whole_matrix import muon_sent_bytes
    from shardlab.memory.whole_matrix import muon_gathered_bytes
    from shardlab.muon import dim0_ranges, owners_by_size

    rows = dim0_ranges((4, 4), 2)
    assert rows == ((0, 0, 8), (1, 8, 16))
    assert muon_sent_bytes("gather", [rows], 2, 0) == 8 * 2
    assert muon_sent_bytes("owner", [rows], 2, 0, [1]) == 8 * 2  # its rows to rank 1
    assert muon_sent_bytes("owner", [rows], 2, 1, [1]) == 8 * 2  # rank 0's rows back
    assert muon_sent_bytes("whole", [rows], 2, 0) == 0
    flat = ((0, 0, 3), (1, 3, 16))
    assert muon_sent_bytes("gather", [flat], 2, 0) == 13 * 2  # padded to the longest
    assert muon_gathered_bytes("gather", [((4, 4), rows)], 2, 0) == 16 * 2
    assert muon_gathered_bytes("gather", [((4, 4), flat)], 2, 0) == (26 + 16) * 2
    assert muon_gathered_bytes("owner", [((4, 4), rows)], 2, 1, [1]) == 16 * 2
    assert muon_gathered_bytes("owner", [((4, 4), rows)], 2, 0, [1]) == 0
    assert owners_by_size([("a", 5), ("b", 4), ("c", 3), ("d", 2)], 2) == \
        {"a": 0, "b": 1, "c": 1, "d": 0}
    assert dim0_ranges((3, 2), 4) == ((0, 0, 2), (1, 2, 4), (2, 4, 6))  # rank 3: none
