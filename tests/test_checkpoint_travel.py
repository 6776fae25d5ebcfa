"""Checkpoints that travel: Hugging Face models, every strategy, other world sizes, PyTorch.

GPT-2 (tied head) and a Llama with frozen embeddings, wrapped per layer by class. Three
launches hold every case:

* 4 ranks: every strategy trains K steps, saves and exports the full model; the same run
  goes on uninterrupted to 2K steps (the reference); a third run resumes the checkpoint
  on 4 ranks. A plain PyTorch program (`fully_shard`, AdamW, `get_state_dict`,
  `dcp.save`) trains K steps of the same data and saves too.
* 3 ranks (every parameter padded): every strategy resumes the 4-rank checkpoint.
* 2 ranks: plain PyTorch opens our ZeRO-1, ZeRO-3 and FSDP2 checkpoints into its own
  `fully_shard` model; our strategies resume PyTorch's checkpoint.

Same world: bit-identical to the uninterrupted run (the file restores every number the
next step reads). Another world size, or PyTorch's program: the first K steps reduced in
another order, so within the fp32 bound of the parity tests.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from shardlab import checkpoint
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.train import train_many

pytest.importorskip("transformers", reason="the Hugging Face models need transformers")

MODELS = {"hf-gpt2": "class:GPT2Block", "hf-llama-frozen-emb": "class:LlamaDecoderLayer"}
STRATEGIES = ["ddp", "ddp-naive", "torch-ddp", "zero1", "zero2", "torch-zero1", "zero3",
              "fsdp2", "torch-fsdp2"]
SHARDED = ("zero3", "fsdp2", "torch-fsdp2")
K = 2
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


def base(strategy: str, model: str, world: int, **kw) -> TrainConfig:
    options = {"wrap": MODELS[model]} if strategy in SHARDED else {}
    if strategy in ("torch-ddp", "torch-zero1"):
        # PyTorch's DDP rebuilds its gradient buckets in the order the first backward
        # produced the gradients, unless it looks for unused parameters: then it keeps
        # its first buckets. A resumed run's first step is a first backward again, so
        # with the rebuild it would all-reduce in other buckets than the uninterrupted
        # run, and gloo would add in another order (a few ulps).
        options = {"find_unused_parameters": True}
    return TrainConfig(strategy=strategy, world=world, model=model, steps=2 * K,
                       batch_size=12, seq_len=16, measure_memory=False, record_ledger=False,
                       keep_params=True, options=options, **kw)


def pytorch_saves(folder: str, model: str, steps: int) -> None:
    """Worker: PyTorch alone, as a reader's own script would do it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardlab.models import get_batch, loss_fn
    from shardlab.wrap import unit_modules

    module = build_model(model, seed=0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in unit_modules(module, MODELS[model]):
        fully_shard(unit, mesh=mesh)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad],
                                  lr=1e-3)
    for step in range(steps):
        x, y = get_batch(step, dist.get_rank(), dist.get_world_size(), 12, 16)
        loss_fn(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder)


def on_two_ranks(root: str, cases: list[TrainConfig]) -> dict:
    """Worker: PyTorch opens our checkpoints; then our strategies resume PyTorch's."""
    opened = {}
    for model in MODELS:
        for strategy in ("zero1", "zero3", "fsdp2"):
            folder = checkpoint.step_folder(f"{root}/w4/{model}/{strategy}", K)
            opened[(model, strategy)] = checkpoint.open_with_pytorch_fsdp2(
                str(folder), model, wrap=MODELS[model])
    return {"opened": opened, "resumed": train_many(cases)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("travel")
    on4, keys = [], []
    for model in MODELS:
        for s in STRATEGIES:
            here = str(root / "w4" / model / s)
            cfg = base(s, model, 4)
            on4 += [cfg, replace(cfg, steps=K, save_every=K, checkpoint_dir=here,
                                 export_path=f"{here}/export.pt"),
                    replace(cfg, resume=True, checkpoint_dir=here)]
            keys += [(model, s, "full"), (model, s, "saved"), (model, s, "resumed")]
    results = dict(zip(keys, launch(train_many, 4, on4, timeout=900)[0]))
    for model in MODELS:
        launch(pytorch_saves, 2, str(root / "pytorch" / model), model, K)
    on3 = [replace(base(s, model, 3), resume=True, checkpoint_dir=str(root / "w4" / model / s))
           for model in MODELS for s in STRATEGIES]
    results.update({(c.model, c.strategy, "from4"): r
                    for c, r in zip(on3, launch(train_many, 3, on3, timeout=900)[0])})
    from_pytorch = [replace(base(s, model, 2), resume=str(root / "pytorch" / model),
                            trust_checkpoint=True)
                    for model in MODELS for s in ("ddp", "zero2", "zero3", "fsdp2")]
    two = launch(on_two_ranks, 2, str(root), from_pytorch, timeout=900)[0]
    results.update({(c.model, c.strategy, "from-pytorch"): r
                    for c, r in zip(from_pytorch, two["resumed"])})
    return root, results, two["opened"]


@pytest.mark.parametrize("model", list(MODELS))
def test_same_world_resume_is_bit_exact(runs, model):
    """Every strategy, PyTorch's DDP and ZeroRedundancyOptimizer included (with the
    buckets they keep, see `base`): the file restores every number the next step reads."""
    _, results, _ = runs
    for s in STRATEGIES:
        full, saved, resumed = (results[(model, s, k)] for k in ("full", "saved", "resumed"))
        assert resumed.first_step == K, s
        assert saved.losses + resumed.losses == full.losses, s
        for name, p in full.params.items():
            assert torch.equal(resumed.params[name], p), (s, name)


@pytest.mark.parametrize("model", list(MODELS))
def test_every_strategy_exports_the_plain_models_state_dict(runs, model):
    """`export_path`: rank 0 writes the full parameters under their own names, which a
    plain (unsharded) model of the same config loads strictly, tied head included."""
    root, results, _ = runs
    for s in STRATEGIES:
        state = torch.load(root / "w4" / model / s / "export.pt", weights_only=True)
        plain = build_model(model, seed=1)
        plain.load_state_dict(state, strict=True)
        for name, p in results[(model, s, "saved")].params.items():
            assert torch.equal(plain.get_parameter(name).detach(), p), (s, name)


@pytest.mark.parametrize("model", list(MODELS))
def test_resume_on_three_ranks_within_the_fp32_bound(runs, model):
    _, results, _ = runs
    for s in STRATEGIES:
        full, moved = results[(model, s, "full")], results[(model, s, "from4")]
        assert moved.first_step == K, s
        assert moved.losses == pytest.approx(full.losses[K:], abs=LOSS_TOL), s
        for name, p in full.params.items():
            assert (moved.params[name] - p).abs().max().item() <= PARAM_TOL, (s, name)


@pytest.mark.parametrize("model", list(MODELS))
def test_pytorch_opens_our_checkpoints_exactly(runs, model):
    """PyTorch's own FSDP2 reads the parameters we saved, bit for bit, and Adam's step."""
    _, results, opened = runs
    for s in ("zero1", "zero3", "fsdp2"):
        saved = results[(model, s, "saved")].params
        loaded = opened[(model, s)]
        assert loaded["adam_step"] == K
        assert loaded["params"].keys() == saved.keys()
        for name, p in saved.items():
            assert torch.equal(loaded["params"][name], p), (s, name)


@pytest.mark.parametrize("model", list(MODELS))
def test_our_strategies_resume_pytorchs_checkpoint(runs, model):
    """Saved by a plain PyTorch program after K steps (no manifest: loaded because the
    config says it trusts it); the rest of the run is ours, and ends where ours does."""
    _, results, _ = runs
    full = results[(model, "ddp", "full")]
    for s in ("ddp", "zero2", "zero3", "fsdp2"):
        resumed = results[(model, s, "from-pytorch")]
        assert resumed.first_step == K, s  # from Adam's step counter
        assert resumed.losses == pytest.approx(full.losses[K:], abs=LOSS_TOL), s
        for name, p in full.params.items():
            assert (resumed.params[name] - p).abs().max().item() <= PARAM_TOL, (s, name)


def test_a_foreign_checkpoint_needs_trust(runs):
    root, _, _ = runs
    with pytest.raises(ValueError, match="pass trusted=True"):
        checkpoint.load(root / "pytorch" / "hf-gpt2", object())


def test_dcp_to_torch_save_gives_the_plain_models_state_dict(runs, tmp_path):
    """PyTorch's own converter turns our sharded ZeRO-3 folder into one file that a plain
    (unsharded) model loads strictly, every name and the tied head included."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    root, results, _ = runs
    for model_name in MODELS:
        folder = checkpoint.step_folder(root / "w4" / model_name / "zero3", K)
        dcp_to_torch_save(folder, tmp_path / "plain.pt")
        state = torch.load(tmp_path / "plain.pt", weights_only=False)
        model = build_model(model_name, seed=1)
        model.load_state_dict({k[len("model."):]: v for k, v in state.items()
                               if k.startswith("model.")}, strict=True)
        for name, p in results[(model_name, "zero3", "saved")].params.items():
            assert torch.equal(model.get_parameter(name).detach(), p), name
