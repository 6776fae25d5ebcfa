"""The strategy cards (`shardlab.cards`) against the code they describe, and a strategy
added by its card alone.

Every reader of a strategy reads its card, so a card that says something its strategy does
not do is a bug in every reader at once (`--wrap` refused `hsdp`, which takes a `wrap`
option). These tests hold each card to its strategy's code, with no launch: the options its
wrap function accepts, the functions it names, its time model and volume; then a card
added at run time is taken by the command line, the config, the time model, the volume
formula and the benchmarks with no other edit.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed as dist

from shardlab import comm, plans
from shardlab.cards import CARDS, DEEPSPEED, OURS, PYTORCH, SINGLE_PROCESS, card, names
from shardlab.cli import _config, build_parser
from shardlab.deepspeed_ref import deepspeed_missing
from shardlab.models import build_model
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.steptime import Machine, predict_step
from shardlab.strategy import get_strategy, resolve

ROOT = Path(__file__).resolve().parents[1]
MACHINE = Machine(flops=1e9, alpha=1e-4, beta=1e8, adam_seconds=1e-8, hiding=1.0, gloo=False)
PHASES, HOWS = {"forward", "backward", "step"}, {"produced", "prefetched", "waited"}


@pytest.fixture(scope="module")
def accepted() -> dict[str, list[str]]:
    """Each strategy's options, as its own wrap function says them: called with an option
    no strategy has, in a process group of one rank made here, it refuses naming the
    options it accepts (every wrap function checks its options before any collective)."""
    assert not dist.is_initialized(), "a test left a process group open"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = {}
    try:
        for name in CARDS:
            if CARDS[name].family == DEEPSPEED and deepspeed_missing():
                continue
            with pytest.raises(ValueError, match="got unknown option") as refused:
                get_strategy(name)(build_model("gpt-tiny"), get_precision("fp32"),
                                   optimizer_spec("adamw", 1e-3), {"no-such-option": 1})
            said = str(refused.value).split("it accepts ", 1)[1]
            out[name] = [] if said == "no options" else ast.literal_eval(said)
    finally:
        dist.destroy_process_group()
    return out


def wrap_flag(name: str, *argv: str):
    """The command line's config for `--strategy name --wrap blocks`."""
    world = "1" if card(name).one_process else "4"
    return _config(build_parser().parse_args(
        ["--strategy", name, "--world", world, "--wrap", "blocks", *argv]))


def test_every_card_names_functions_and_strategies_that_exist():
    families = {OURS, PYTORCH, DEEPSPEED, SINGLE_PROCESS}
    for name, c in CARDS.items():
        assert c.name == name and c.family in families, c
        assert callable(resolve(c.wrap)), c.wrap
        assert c.launch_check is None or callable(resolve(c.launch_check)), c.launch_check
        assert c.reference is None or card(c.reference).family == PYTORCH, c
        assert c.deepspeed_reference is None or card(c.deepspeed_reference).family == DEEPSPEED
        assert c.checkpoint_refusal is None or c.checkpoint_refusal.strip()
    with pytest.raises(ValueError, match=r"unknown strategy 'zero4'; use one of \['ddp'"):
        card("zero4")


def test_takes_units_is_what_its_wrap_function_accepts(accepted):
    """A card takes units exactly when its strategy accepts the option `wrap`; and the
    option that makes its all-gather wait is one it accepts."""
    assert set(accepted) >= set(names(family=OURS)) | set(names(family=PYTORCH))
    for name, options in accepted.items():
        assert CARDS[name].takes_units == ("wrap" in options), (name, options)
        overlap = CARDS[name].gather_overlap_option
        assert overlap is None or overlap in options, (name, overlap)


@pytest.mark.parametrize("name", list(CARDS))
def test_the_wrap_flag_is_taken_by_the_strategies_that_take_units(name):
    if card(name).takes_units:
        assert wrap_flag(name).options == {"wrap": "blocks"}
    else:
        with pytest.raises(ValueError, match=f"--wrap chooses the units of "
                                             f"{', '.join(names(takes_units=True))}; "
                                             f"strategy '{name}' has none"):
            wrap_flag(name)


@pytest.mark.parametrize("name", ["hsdp", "torch-hsdp"])
def test_hybrid_sharding_takes_the_wrap_flag(name):
    """The command of the bug: `--strategy hsdp --option shard_group=2 --world 4 --wrap
    blocks` was refused, though hsdp takes a wrap option; checked as the launching
    process checks it, through the config's validation."""
    config = wrap_flag(name, "--option", "shard_group=2").validate()
    assert config.options == {"shard_group": 2, "wrap": "blocks"} and config.world == 4
    with pytest.raises(ValueError, match="shard_group must be a whole number >= 1 that "
                                         "divides the world size 4, got 3"):
        wrap_flag(name, "--option", "shard_group=3").validate()


def test_a_volume_factor_and_a_schedule_go_together():
    """The time model and the volume formula know the same strategies: a card has both or
    neither, and what its time model names exists."""
    for name, c in CARDS.items():
        assert (c.volume_factor is None) == (c.schedule is None) == (c.plan is None), name
        if c.schedule is None:
            assert not c.sharded_step and c.gather_overlap_option is None, name
            continue
        assert c.plan in plans.PLANS, (name, c.plan)
        for schedule in (c.schedule, c.gloo_schedule or {}):
            for op, where in schedule.items():
                places = where if isinstance(where[0], tuple) else (where,)
                assert all(p in PHASES and h in HOWS for p, h in places), (name, op, where)
        # on gloo the same collectives, placed otherwise
        assert c.gloo_schedule is None or set(c.gloo_schedule) == set(c.schedule), name
        assert c.gather_overlap_option is None or "all_gather" in c.schedule, name


def test_the_registry_hands_back_each_card_s_wrap_function_checked():
    """Each strategy comes wrapped by the registry's checks (a meta model refused where
    the card says the strategy cannot shard one, tests/test_modelio.py; the optimizer
    bound to the model, tests/test_muon.py) around the function its card names."""
    for name, c in CARDS.items():
        assert get_strategy(name).__wrapped__ is resolve(c.wrap), name


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_strategy_is_added_by_its_card_alone(monkeypatch):
    """A new card, a copy of ddp's and one of fsdp2's under other names (their wrap
    functions the same), is all that the command line, the config, the time model, the
    volume formula and the benchmarks need."""
    for base in ("ddp", "fsdp2"):
        monkeypatch.setitem(CARDS, f"my-{base}", replace(CARDS[base], name=f"my-{base}"))
    parse = build_parser().parse_args
    config = _config(parse(["--strategy", "my-ddp", "--world", "2"])).validate()
    assert config.strategy == "my-ddp" and get_strategy("my-ddp").__wrapped__ is \
        resolve(CARDS["ddp"].wrap)
    with pytest.raises(ValueError, match=r"--wrap chooses the units of .*my-fsdp2; "
                                         r"strategy 'my-ddp' has none"):
        _config(parse(["--strategy", "my-ddp", "--world", "2", "--wrap", "blocks"]))
    config = _config(parse(["--strategy", "my-fsdp2", "--world", "2", "--wrap", "blocks"]))
    assert config.validate().options == {"wrap": "blocks"}

    model = build_model("gpt-tiny")
    for base in ("ddp", "fsdp2"):
        ours, theirs = (predict_step(s, model, 4, {"bucket_mb": 0.1}, MACHINE, tokens=64)
                        for s in (f"my-{base}", base))
        assert ours.collectives == theirs.collectives and ours.compute == theirs.compute
        assert comm.volume_per_rank(f"my-{base}", 1000, 4) == \
            comm.volume_per_rank(base, 1000, 4) > 0

    bench = load_benchmark("bench_strategies")
    assert bench.reference_of("my-ddp") == "torch-ddp"
    assert bench.reference_of("my-fsdp2", "deepspeed") == "deepspeed-zero3"
    assert bench.parse_options(["my-ddp:bucket_mb=4"]) == {"my-ddp": {"bucket_mb": 4}}
