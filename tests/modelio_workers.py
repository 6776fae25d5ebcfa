"""The worker of test_modelio: every case of the meta path in one launch."""

from __future__ import annotations

import torch

from shardlab import checkpoint
from shardlab.launch import rank_device
from shardlab.modelio import wrap_on_meta
from shardlab.models import build_model, get_batch
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.step import HeldAfterStep, train_step
from shardlab.strategy import named_full_parameters

SEED = 3  # the weights written to the folders; a build with any other seed differs


def meta_cases(cases: list[dict], train: dict) -> dict:
    """Each case {model, folder, strategy, options, skip}: load through meta, then compare every
    parameter and every buffer with a build without meta (the folder's weights). `train`
    {model, folder, strategy, steps, checkpoint_dir}: load, train, save a checkpoint,
    return the full parameters and the losses."""
    device = rank_device()
    precision, spec = get_precision("fp32"), optimizer_spec("adamw", 1e-2)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = []
    for case in cases:
        wrapped = wrap_on_meta(case["model"], None, case["strategy"], precision, spec,
                               case.get("options", {}), device, case["folder"],
                               skip_buffers=case.get("skip", ()))
        full = (wrapped.full_parameters() if wrapped.full_parameters
                else named_full_parameters(wrapped.module))
        reference = build_model(case["model"], seed=SEED)
        buffers = dict(wrapped.module.named_buffers())
        held = None
        if case.get("measure"):  # one step, then the bytes this rank holds
            x, y = (t.to(device) for t in get_batch(0, rank, world, 4, 16))
            states = HeldAfterStep(wrapped)
            train_step(wrapped, [(x, y)], watch=states)
            held = states.held
        results.append({"state_bytes": held,
            "params": [n for n, p in reference.named_parameters()
                       if not torch.equal(full[n].cpu(), p)],
            "buffers": [n for n, b in reference.named_buffers()
                        if not torch.equal(buffers[n].cpu(), b)],
            "count": (len(full), len(buffers))})
    wrapped = wrap_on_meta(train["model"], None, train["strategy"], precision, spec, {},
                           device, train["folder"])
    losses = []
    for step in range(train["steps"]):
        x, y = (t.to(device) for t in get_batch(step, rank, world, 4, 16))
        losses.append(train_step(wrapped, [(x, y)]).item())
    checkpoint.save(train["checkpoint_dir"], train["steps"], wrapped,
                    {"model": train["model"], "model_config": None, "precision": "fp32",
                     "optimizer": "adamw"})
    full = (wrapped.full_parameters() if wrapped.full_parameters
            else named_full_parameters(wrapped.module))
    return {"cases": results, "losses": losses,
            "params": {k: v.cpu() for k, v in full.items()}}
