"""Workers for the ZeRO-3 and FSDP2 tests: many cases per launch, each checked step by step.

Every rank also trains the single-process reference on the whole global batch (it is
small), so one launch compares a strategy with `single` without a second launch.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from shardlab.models import build_model, get_batch, loss_fn
from shardlab.optimizers import OptimizerSpec
from shardlab.precision import get_precision
from shardlab.step import NOTHING, HeldAfterStep, train_step
from shardlab.strategy import Wrapped, get_strategy

OPTIMIZERS = {
    "adamw": OptimizerSpec(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd-momentum": OptimizerSpec(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def train_steps(wrapped, rank, world, steps, batch_size=12, seq_len=16, grad_accum=1,
                keep_params=False):
    """The ordinary loop; returns the global-batch loss per step (and the parameters)."""
    losses, params = [], []
    for step in range(steps):
        micro_batches = [get_batch(step, rank, world, batch_size, seq_len, micro=micro,
                                   micro_steps=grad_accum) for micro in range(grad_accum)]
        total = train_step(wrapped, micro_batches,
                           lambda output, y: loss_fn(output, y) / grad_accum)
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
        if keep_params:
            params.append({k: v.float() for k, v in wrapped.full_parameters().items()})
    return losses, params


def parity_cases(cases: list[dict], steps: int = 10, batch_size: int = 12) -> list[dict]:
    """For each case {model, strategy, precision, optimizer, options, grad_accum, same_as},
    the largest differences from `single` (trained here on the whole batch) in losses and
    full parameters over all steps; with `same_as: i`, also from case i's run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    references, runs, results = {}, [], []
    for case in cases:
        precision = get_precision(case.get("precision", "fp32"))
        spec = OPTIMIZERS[case.get("optimizer", "adamw")]
        accum = case.get("grad_accum", 1)
        key = (case.get("model", "gpt-tiny"), precision.name, case.get("optimizer", "adamw"),
               accum)
        base = build_model(key[0], seed=0)
        if key not in references:
            ref = get_strategy("single")(copy.deepcopy(base), precision, spec, {})
            references[key] = train_steps(ref, 0, 1, steps, batch_size, grad_accum=accum,
                                          keep_params=True)
        ref_losses, ref_params = references[key]
        wrapped = get_strategy(case["strategy"])(copy.deepcopy(base), precision, spec,
                                                 dict(case.get("options", {})))
        losses, params = train_steps(wrapped, rank, world, steps, batch_size,
                                     grad_accum=accum, keep_params=True)
        runs.append((losses, params))
        result = {"case": case, "losses": losses, "names_match": all(set(p) == set(r) for p, r in
                                                   zip(params, ref_params))}
        result.update(_diffs(losses, params, ref_losses, ref_params))
        if "same_as" in case:
            other = _diffs(losses, params, *runs[case["same_as"]])
            result.update({f"{k}_vs_same_as": v for k, v in other.items()})
        results.append(result)
    return results


def _diffs(losses, params, ref_losses, ref_params) -> dict:
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max(max((p[k] - r[k]).abs().max().item() for k in r)
                              for p, r in zip(params, ref_params))}


def bytes_cases(cases: list[dict], steps: int = 3) -> list[dict]:
    """For each case: the ledger's logical bytes per step and op, the bytes this rank holds
    by category after the last step, the peak of one step, and the sizes that predict
    them (Ψ with and without padding, the largest unit)."""
    from shardlab.comm import Ledger
    from shardlab.measure import track_peak

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for case in cases:
        precision = get_precision(case.get("precision", "fp32"))
        spec = OPTIMIZERS[case.get("optimizer", "adamw")]
        model = build_model(case.get("model", "gpt-tiny"), seed=0)
        psi = sum(p.numel() for p in model.parameters())
        wrapped = get_strategy(case["strategy"])(model, precision, spec,
                                                 dict(case.get("options", {})))
        units = wrapped.extra_state[0].units
        padded_psi = sum(u.world * u.shard_numel for u in units)
        per_step = []
        states = HeldAfterStep(wrapped)  # what a rank holds at its fullest between steps
        with Ledger() as ledger:
            for step in range(steps):
                train_step(wrapped, [get_batch(step, rank, world, 12, 16)],
                           watch=states if step == steps - 1 else NOTHING)
                ledger.mark_step()
        held = states.held
        for step in range(steps):
            by_op: dict[str, int] = {}
            for r in ledger.records:
                if r.step == step:
                    by_op[r.op] = by_op.get(r.op, 0) + r.logical_bytes
            per_step.append(by_op)
        x, y = get_batch(steps, rank, world, 12, 16)
        with track_peak(*wrapped.holders()) as peak:
            train_step(wrapped, [(x, y)])
        n_opt_params = sum(len(g["params"]) for g in wrapped.optimizer.param_groups)
        out.append({
            "case": case, "psi": psi, "padded_psi": padded_psi, "per_step": per_step,
            "held": held, "peak": peak.bytes, "peak_by": peak.by_category,
            "largest_unit": max(u.world * u.shard_numel for u in units),
            "param_bytes": units[0].param_dtype.itemsize,
            "reduce_bytes": units[0].reduce_dtype.itemsize,
            "n_opt_params": n_opt_params,
        })
    return out


def error_cases(cases: list[str]) -> dict[str, str]:
    """Run each named misuse; return the message of the error it raised (or "no error")."""
    from shardlab.fsdp import fully_shard

    out = {}
    for name in cases:
        model = build_model("gpt-tiny", seed=0)
        precision, spec = get_precision("fp32"), OPTIMIZERS["adamw"]
        try:
            if name == "zero3-wrap-class-not-in-model":
                get_strategy("zero3")(model, precision, spec, {"wrap": "class:GPT2Block"})
            elif name == "zero3-differs-across-ranks":
                get_strategy("zero3")(build_model("gpt-tiny", seed=dist.get_rank()),
                                      precision, spec, {})
            elif name == "fsdp-twice":
                fully_shard(model.blocks[0])
                fully_shard(model.blocks[0])
            elif name == "fsdp-child-after-parent":
                fully_shard(model)
                fully_shard(model.blocks[0])
            elif name == "fsdp-tied-weight-split-across-units":
                fully_shard(model.tok_emb)  # the head uses the same weight, from the root
                fully_shard(model)
            elif name == "fsdp-differs-across-ranks":
                fully_shard(build_model("gpt-tiny", seed=dist.get_rank()).blocks[1])
            else:
                raise KeyError(name)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def helper_checks() -> dict:
    """fully_shard's view of the model, and the helpers between sharded and full."""
    from shardlab.fsdp import fully_shard, gather_full_parameters, load_full_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    original = build_model("gpt-tiny", seed=0)
    full_shapes = {k: tuple(v.shape) for k, v in original.state_dict().items()}
    model = copy.deepcopy(original)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    out = {"class": type(model).__name__, "block_class": type(model.blocks[0]).__name__,
           "state_dict_names_kept": set(model.state_dict()) == set(full_shapes),
           "shard_shapes_ok": all(
               tuple(p.shape) == (-(-full_shapes[n][0] // world), *full_shapes[n][1:])
               for n, p in model.named_parameters())}
    plain = Wrapped(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(2):
        train_step(plain, [get_batch(step, rank, world, 12, 16)])
    trained = gather_full_parameters(model)
    on_rank0 = gather_full_parameters(model, rank0_only=True)
    out["rank0_only"] = (all(torch.equal(on_rank0[k], trained[k]) for k in trained)
                         if rank == 0 else on_rank0 == {})
    # a fresh sharded model loads the trained full parameters and computes the same
    fresh = copy.deepcopy(original)
    for block in fresh.blocks:
        fully_shard(block)
    fully_shard(fresh)
    fresh(get_batch(0, rank, world, 12, 16)[0])  # one forward builds its state
    load_full_state_dict(fresh, trained)
    reloaded = gather_full_parameters(fresh)
    out["round_trip"] = set(reloaded) == set(trained) and all(
        torch.equal(reloaded[k], trained[k]) for k in trained)
    x, _ = get_batch(5, rank, world, 12, 16)
    with torch.no_grad():
        out["same_output"] = torch.equal(model(x), fresh(x))
    try:
        load_full_state_dict(fresh, {"nonsense.weight": torch.zeros(1)})
        out["bad_state_dict"] = "no error"
    except ValueError as exc:
        out["bad_state_dict"] = str(exc)
    return out


def gather_order(strategies: list[str]) -> dict[str, list[tuple[str, str]]]:
    """For each strategy (default options, fp32 gpt-tiny), the order of one steady step's
    events: the units' forward pre-hooks ("forward", unit), the blocks' backward
    pre-hooks ("backward", unit) and the collectives the ledger records
    ("all_gather" or "reduce_scatter", "" ). All on this rank's one thread, ordered by
    their times. A module's hooks run after FSDP2's own for that module (FSDP2
    prepends its forward pre-hook; its pre-backward hook is on the forward's outputs)."""
    import time

    from shardlab.comm import Ledger
    from shardlab.wrap import unit_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for strategy in strategies:
        model = build_model("gpt-tiny", seed=0)
        names = {id(m): name or "root" for name, m in model.named_modules()}
        events: list[tuple[float, str, str]] = []
        for unit in unit_modules(model, "auto"):
            name = names[id(unit)]
            unit.register_forward_pre_hook(
                lambda m, args, name=name: events.append((time.perf_counter(), "forward", name)))
            if unit is not model:  # the root's input (token ids) takes no gradient
                unit.register_full_backward_pre_hook(
                    lambda m, grad, name=name: events.append(
                        (time.perf_counter(), "backward", name)))
        wrapped = get_strategy(strategy)(model, get_precision("fp32"), OPTIMIZERS["adamw"], {})
        for step in range(2):  # the second is the steady one
            events.clear()
            x, y = get_batch(step, rank, world, 8, 16)
            with Ledger() as ledger:
                loss_fn(wrapped.model(x), y).backward()
            wrapped.optimizer.step()
            wrapped.optimizer.zero_grad()
        timeline = events + [(r.start, r.op.removeprefix("ring_"), "") for r in ledger.records]
        out[strategy] = [(what, who) for _, what, who in sorted(timeline)]
    return out


def suite(parity: list[dict] = (), sizes: list[dict] = (), errors: list[str] = (),
          helpers: bool = False, train: list = (), steps: int = 10,
          order: list[str] = ()) -> dict:
    """Everything one test file checks on one world size, in one launch; `train` are
    `shardlab.config.TrainConfig`s run by the course's own loop; `order`, strategies whose
    order of gathers and compute is recorded (`gather_order`)."""
    from shardlab.train import train_worker

    return {"parity": parity_cases(list(parity), steps) if parity else [],
            "bytes": bytes_cases(list(sizes)) if sizes else [],
            "errors": error_cases(list(errors)) if errors else {},
            "helpers": helper_checks() if helpers else {},
            "train": [train_worker(c) for c in train],
            "order": gather_order(list(order)) if order else {}}


def check_parity(result: dict, steps: int) -> None:
    """Assert one case's distance from the single-process reference, within the bounds the
    test modules justify in their docstrings: fp32 losses to 1e-5; fp32 AdamW parameters to
    1% of the total distance the learning rate lets them move, SGD's to 1e-6; bf16 to a
    bf16 step per parameter."""
    lr = OPTIMIZERS["adamw"].kwargs["lr"]
    case = result["case"]
    assert result["names_match"], case
    if case.get("precision", "fp32") == "fp32":
        tol = 1e-6 if case.get("optimizer") == "sgd-momentum" else 0.01 * lr * steps
        assert result["loss_diff"] <= 1e-5, case
        assert result["param_diff"] <= tol, case
    else:
        assert result["loss_diff"] <= 1e-2, case
        assert result["param_diff"] <= 2 * lr * steps, case


def auto_wrap_cases(cases: list[tuple[str, str]], steps: int = 1) -> list[dict]:
    """Each (model, strategy) wrapped by "auto", trained `steps` steps beside `single` on
    the whole batch and beside PyTorch's `fully_shard` of the same model (the case
    "torch-fsdp2", which must come first for its model). For each: the units, the
    largest differences in losses and full parameters from both, and for every tied
    weight this rank's piece: its elements, whether the steps changed it, and its
    largest difference from PyTorch's piece on this rank (dim-0 layouts only: ZeRO-3's
    pieces are ranges of a flat buffer, other ranges of the same parameter)."""
    from shardlab.measure import state_bytes
    from shardlab.wrap import describe

    rank, world = dist.get_rank(), dist.get_world_size()
    spec, fp32 = OPTIMIZERS["adamw"], get_precision("fp32")
    references, torch_runs, results = {}, {}, []
    for model_name, strategy in cases:
        base = build_model(model_name, seed=0)
        if model_name not in references:
            ref = get_strategy("single")(copy.deepcopy(base), fp32, spec, {})
            references[model_name] = train_steps(ref, 0, 1, steps, keep_params=True)
        wrapped = get_strategy(strategy)(copy.deepcopy(base), fp32, spec, {"wrap": "auto"})
        before = {p.name: p.values.clone() for p in wrapped.pieces() if p.aliases}
        losses, params = train_steps(wrapped, rank, world, steps, keep_params=True)
        pieces = {p.name: p.values.detach().clone() for p in wrapped.pieces() if p.aliases}
        if strategy == "torch-fsdp2":
            torch_runs[model_name] = (losses, params, pieces)
        theirs = torch_runs[model_name]
        result = {"model": model_name, "strategy": strategy,
                  "units": describe(base, "auto"),
                  "bytes": state_bytes(*wrapped.holders()),
                  "tied": {name: {"numel": v.numel(),
                                  "changed": not torch.equal(before[name], v),
                                  "vs_torch": ((v - theirs[2][name]).abs().max().item()
                                               if strategy != "zero3" and v.numel() else 0.0)}
                           for name, v in pieces.items()}}
        result.update(_diffs(losses, params, *references[model_name]))
        result.update({f"{k}_vs_torch": v
                       for k, v in _diffs(losses, params, *theirs[:2]).items()})
        results.append(result)
    return results
