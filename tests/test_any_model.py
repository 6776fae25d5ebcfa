"""Any model, not only the course's: Hugging Face models under every strategy.

GPT-2 (its head tied to the token embedding) and a Llama (grouped-query attention, rotary
buffers), each also with its token embedding frozen, built from `transformers` configs
(random weights, nothing downloaded). The sharded strategies wrap them per layer by class,
as PyTorch users do (`"class:GPT2Block"`, `"class:LlamaDecoderLayer"`).

One launch per world size runs every strategy on every model (DeepSpeed's three stages too,
where it is installed): 2 ranks (an even split) and 3 (one that leaves padding). Four ranks
of GPT-2 and of the Llama with frozen embeddings run in `test_checkpoint_travel`, under
every strategy of ours and PyTorch's.
Checked against one process on the whole batch, and against the layout each strategy
promises:

* parity: the losses and the parameters after 3 steps, within the fp32 bound of the
  other parity tests (losses 1e-5, parameters 1e-4: a tenth of one Adam step);
* bytes held: every rank's parameters, gradients and optimizer states equal what the
  layout gives, computed here from the parameter shapes alone (the formula
  `shardlab.memory.model_states` applied to each flat buffer, `memory.dim0_states` to
  FSDP2's dim-0 cut of each parameter at any world size, with the
  padding to a multiple of N and Adam's 4-byte step counters it leaves out on purpose);
  a frozen parameter holds its parameter bytes and nothing else;
* bytes moved: the all-gathers carry every parameter, the reduce-scatters only the
  trainable ones (a frozen parameter has no gradient to reduce).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardlab import memory
from shardlab.config import TrainConfig
from shardlab.deepspeed_ref import deepspeed_missing, predicted_for
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.train import train_many, train_worker
from shardlab.wrap import unit_modules

pytest.importorskip("transformers", reason="the Hugging Face models need transformers")

MODELS = {"hf-gpt2": "class:GPT2Block", "hf-gpt2-frozen-emb": "class:GPT2Block",
          "hf-llama": "class:LlamaDecoderLayer",
          "hf-llama-frozen-emb": "class:LlamaDecoderLayer"}
STRATEGIES = ["ddp", "ddp-naive", "torch-ddp", "zero1", "zero2", "torch-zero1", "zero3",
              "fsdp2", "torch-fsdp2"]
# DeepSpeed's stages where DeepSpeed is installed (its tests say how, where it is not):
# the same parity, and the bytes its own rules give (an fp32 master copy, small
# parameters kept whole at stage 3), as `shardlab.deepspeed_ref` predicts them.
if deepspeed_missing() is None:
    STRATEGIES += ["deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3"]
SHARDED = ("zero3", "fsdp2", "torch-fsdp2")
WORLDS = [2, 3]
STEPS, BATCH, SEQ = 3, 12, 16  # 12 rows split evenly on 1, 2, 3 and 4 ranks
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4
COUNTER = 4  # Adam's step counter: one fp32 scalar per stepped tensor


def config(strategy: str, model: str, world: int) -> TrainConfig:
    options = {"wrap": MODELS[model]} if strategy in SHARDED else {}
    if strategy in ("zero1", "zero2"):
        options = {"bucket_numel": 1 << 30}  # one bucket: one padding, as the formula has
    return TrainConfig(strategy=strategy, world=world, model=model, steps=STEPS,
                       batch_size=BATCH, seq_len=SEQ, options=options, keep_params=True)


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread, as each rank: the same reduction order
    try:
        reference = {m: train_worker(config("single", m, 1)) for m in MODELS}
    finally:
        torch.set_num_threads(threads)
    results = {}
    for world in WORLDS:
        configs = [config(s, m, world) for m in MODELS for s in STRATEGIES]
        for rank, reports in enumerate(launch(train_many, world, configs, timeout=900)):
            for c, r in zip(configs, reports):
                results[(c.model, c.strategy, world, rank)] = r
    return reference, results


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_strategy_trains_like_one_process(runs, model, world):
    reference, results = runs
    ref = reference[model]
    for strategy in STRATEGIES:
        r = results[(model, strategy, world, 0)]
        for loss, expected in zip(r.losses, ref.losses, strict=True):
            assert abs(loss - expected) <= LOSS_TOL, (strategy, r.losses, ref.losses)
        assert r.params.keys() == ref.params.keys(), strategy
        for name, p in ref.params.items():
            diff = (r.params[name] - p).abs().max().item()
            assert diff <= PARAM_TOL, (strategy, name, diff)
        frozen = {n for n, p in build_model(model).named_parameters() if not p.requires_grad}
        for name in frozen:  # never stepped, on any rank
            assert torch.equal(r.params[name], ref.params[name]), (strategy, name)


# ----------------------------------------------------------------------------- bytes held


def tensors(model):
    """(trainable, frozen) parameters, each tied weight once."""
    params = list(model.parameters())
    return [p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def units_of(model, policy) -> list[tuple[int, int]]:
    """(trainable, frozen) elements of each ZeRO-3 unit: a parameter goes to the innermost
    unit containing every module that holds it (a tied weight to their common ancestor)."""
    modules = unit_modules(model, policy)
    subtrees = [{id(m) for m in u.modules()} for u in modules]
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(id(module))
    sizes = [[0, 0] for _ in modules]
    for p in model.parameters():
        unit = min((i for i, tree in enumerate(subtrees) if holders[id(p)] <= tree),
                   key=lambda i: len(subtrees[i]))
        sizes[unit][0 if p.requires_grad else 1] += p.numel()
    return [(t, f) for t, f in sizes if t or f]


def expected_state_bytes(model_name: str, strategy: str, world: int,
                         rank: int) -> dict[str, int]:
    """What a rank of `strategy` holds: the formula's per-parameter bytes (fp32 AdamW:
    4, 4, 8) over the elements the layout gives that rank, plus step counters."""
    if strategy.startswith("deepspeed-"):
        return predicted_for(model_name, int(strategy[-1]), world)
    model = build_model(model_name)
    per = memory.bytes_per_param("fp32", "adamw")
    trainable, frozen = tensors(model)
    psi_t = sum(p.numel() for p in trainable)
    psi_f = sum(p.numel() for p in frozen)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    N = world
    if strategy in ("ddp", "ddp-naive", "torch-ddp", "torch-zero1"):
        states = memory.model_states(psi_t, N, 0, "fp32", "adamw")
        params, grads = states.params + per.params * psi_f, states.grads
        if strategy in ("torch-ddp", "torch-zero1"):  # PyTorch DDP's bucket copy
            grads += memory.ddp_bucket_copy_bytes(psi_t, "fp32")
        optimizer = states.optimizer + COUNTER * len(trainable)  # torch-zero1: summed
    elif strategy in ("zero1", "zero2"):
        stage = int(strategy[-1])
        states = memory.model_states(psi_t, N, stage, "fp32", "adamw")
        padding = N * memory.shard_numel(psi_t, N) - psi_t  # one flat buffer, padded
        params = states.params + per.params * (padding + psi_f)
        grads = states.grads + (per.grads * padding if stage == 1 else 0)
        optimizer = states.optimizer + COUNTER
    elif strategy == "zero3":
        units = units_of(model, MODELS[model_name])
        params = sum(per.params * (ceil_div(t, N) + ceil_div(f, N)) for t, f in units)
        grads = sum(per.grads * ceil_div(t, N) for t, _ in units)
        optimizer = sum(per.optimizer * ceil_div(t, N) + COUNTER for t, _ in units if t)
    else:  # fsdp2, torch-fsdp2: each parameter cut along dim 0, ceil(d0/N) rows a rank
        # (the last ranks fewer): the planner's per-rank arithmetic, `memory.dim0_states`.
        # PyTorch's FSDP2 pads the storage of parameters and gradients, but Adam's states
        # are made from the unpadded local tensors; ours pads them too.
        states = memory.dim0_states(memory.parameter_shapes(model), N, rank, "fp32", "adamw",
                                    optimizer_padded=strategy == "fsdp2")
        params, grads = states.params, states.grads
        optimizer = states.optimizer + COUNTER * len(trainable)
    return {"params": params, "grads": grads, "optimizer": optimizer, "buffers": buffers}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("model", list(MODELS))
def test_every_rank_holds_the_bytes_of_the_formula(runs, model, world):
    _, results = runs
    for strategy in STRATEGIES:
        expected = [expected_state_bytes(model, strategy, world, rank)
                    for rank in range(world)]
        held = [results[(model, strategy, world, rank)].state_bytes for rank in range(world)]
        if strategy == "torch-zero1":  # whole tensors to ranks: only the sum is the formula
            summed = sum(h["optimizer"] for h in held)
            assert summed == expected[0]["optimizer"], (strategy, summed, expected)
            held = [{**h, "optimizer": e["optimizer"]} for h, e in zip(held, expected)]
        for rank, (h, e) in enumerate(zip(held, expected)):
            assert h == e, (strategy, rank, h, e)


def test_frozen_embeddings_cost_only_their_parameter_bytes(runs):
    """Freezing the embedding removes its gradient and optimizer state on every rank and
    under every strategy; zero3 holds 1/N of the frozen buffer, not all or nothing."""
    _, results = runs
    for base, frozen in (("hf-gpt2", "hf-gpt2-frozen-emb"),
                         ("hf-llama", "hf-llama-frozen-emb")):
        emb = build_model(base).get_input_embeddings().weight.numel()
        world = 2
        for strategy in ("ddp", "zero3", "fsdp2"):
            for rank in range(world):
                a = results[(base, strategy, world, rank)].state_bytes
                b = results[(frozen, strategy, world, rank)].state_bytes
                assert a["params"] == b["params"], (strategy, rank)
                share = emb if strategy == "ddp" else emb / world
                assert a["grads"] - b["grads"] == pytest.approx(4 * share, abs=4 * 64 * 4)
                assert b["grads"] < a["grads"] and b["optimizer"] < a["optimizer"]


# ----------------------------------------------------------------------------- bytes moved


def moved(report, op: str) -> int:
    """Logical bytes of `op` in the report's second step (the first may set up)."""
    return sum(r.logical_bytes for r in report.ledger if r.step == 1 and r.op == op)


@pytest.mark.parametrize("world", [3])
def test_sharded_strategies_gather_everything_and_reduce_only_what_trains(runs, world):
    _, results = runs
    for model_name in MODELS:
        model = build_model(model_name)
        trainable, frozen = tensors(model)
        units = units_of(model, MODELS[model_name])
        r = results[(model_name, "zero3", world, 0)]
        gathered = 4 * sum(world * (ceil_div(t, world) + ceil_div(f, world)) for t, f in units)
        reduced = 4 * sum(world * ceil_div(t, world) for t, _ in units)
        assert moved(r, "all_gather") == 2 * gathered, model_name  # forward and backward
        assert moved(r, "reduce_scatter") == reduced, model_name

        def padded(ps):
            return 4 * sum(world * ceil_div(p.shape[0], world) * (p.numel() // p.shape[0])
                           for p in ps)
        r = results[(model_name, "fsdp2", world, 0)]
        assert moved(r, "all_gather") == 2 * padded(trainable + frozen), model_name
        assert moved(r, "reduce_scatter") == padded(trainable), model_name
        for strategy in ("zero1", "zero2"):
            r = results[(model_name, strategy, world, 0)]
            psi_t = sum(p.numel() for p in trainable)
            flat = 4 * world * math.ceil(psi_t / world)
            assert moved(r, "reduce_scatter") == flat and moved(r, "all_gather") == flat
