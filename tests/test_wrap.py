"""Wrap policies: which modules become units, children before parents, the root last."""

import pytest
from torch import nn

from shardlab.models import GPT, Block, build_model
from shardlab.wrap import describe, layer_classes, unit_modules


def test_auto_wraps_the_course_gpt_by_its_blocks():
    model = build_model("gpt-tiny")
    assert unit_modules(model) == [*model.blocks, model]


def test_every_form_of_the_same_policy_gives_the_same_units():
    model = build_model("gpt-tiny")
    expected = [*model.blocks, model]
    for policy in ("blocks", "class:Block", Block, (Block,),
                   lambda m: isinstance(m, Block)):
        assert unit_modules(model, policy) == expected, policy


def test_a_callable_that_names_the_root_first_still_puts_it_last():
    """The form issue readers tried: `m is model` first in module order, root last anyway."""
    model = build_model("gpt-tiny")
    assert unit_modules(model, lambda m: m is model or isinstance(m, Block)) == \
        [*model.blocks, model]


def test_nested_classes_come_children_first():
    model = build_model("gpt-tiny")
    units = unit_modules(model, "class:Block,MLP")
    for block in model.blocks:
        assert units.index(block.mlp) < units.index(block)
    assert units[-1] is model and len(units) == 2 * len(model.blocks) + 1


def test_min_params_wraps_bottom_up_like_size_based_auto_wrap():
    model = build_model("gpt-tiny")
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    units = unit_modules(model, f"min-params:{per_block}")
    assert units == [*model.blocks, model]
    # smaller threshold: the MLPs (the largest submodules) are taken first
    mlp = sum(p.numel() for p in model.blocks[0].mlp.parameters())
    small = unit_modules(model, mlp)
    assert all(b.mlp in small for b in model.blocks)


def test_hugging_face_layers_found_from_no_split_modules():
    pytest.importorskip("transformers")
    for name, layer, layers in (("hf-gpt2", "GPT2Block", lambda m: m.transformer.h),
                                ("hf-llama", "LlamaDecoderLayer", lambda m: m.model.layers)):
        model = build_model(name)
        assert {c.__name__ for c in layer_classes(model)} == {layer}
        assert unit_modules(model, "auto") == [*layers(model), model]
        assert unit_modules(model, f"class:{layer}") == [*layers(model), model]
        assert describe(model, "auto") == f"3 units: 2 x {layer} + the root"


def test_a_model_without_layers_is_one_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert unit_modules(model, "auto") == [model]
    assert unit_modules(model, "model") == [model]


@pytest.mark.parametrize("policy,message", [
    ("class:GPT2Block", "no module of class ['GPT2Block']"),
    ("min-params:zero", "whole number N >= 1"),
    ("by-layer", "unknown wrap policy 'by-layer'"),
    (3.5, "unknown wrap policy 3.5"),
    (True, "unknown wrap policy True"),
])
def test_bad_policies_are_refused_with_what_to_use(policy, message):
    with pytest.raises(ValueError) as raised:
        unit_modules(build_model("gpt-tiny"), policy)
    assert message in str(raised.value)


def test_blocks_needs_blocks():
    with pytest.raises(ValueError, match="needs a model with `.blocks`"):
        unit_modules(nn.Linear(2, 2), "blocks")


def test_the_course_gpt_is_a_gpt():
    assert isinstance(build_model("gpt-small"), GPT)


def test_min_params_passes_over_containers_that_are_never_called():
    """Two blocks together pass 60,000 parameters but one does not: the ModuleList that
    holds them is never called (its members are), so no hook could gather it; as in
    PyTorch's size-based policy the parameters go up to the model."""
    model = build_model("gpt-tiny")
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    units = unit_modules(model, f"min-params:{per_block + 1}")
    assert units == [model]
    assert not any(isinstance(u, (nn.ModuleList, nn.ModuleDict)) for u in units)


@pytest.mark.parametrize("policy", ["class:ModuleList", nn.ModuleList,
                                    lambda m: isinstance(m, nn.ModuleList)])
def test_a_policy_that_picks_a_container_is_refused(policy):
    with pytest.raises(ValueError, match=r"picks containers \(ModuleList\).*pick the layers"):
        unit_modules(build_model("gpt-tiny"), policy)
