"""Wrap policies: which modules become units, children before parents, the root last; a
unit whose weight is tied outside it folded into their common parent, and the wraps
"auto" gives trained under ZeRO-3 and FSDP2 alike at a world size that divides neither a
vocabulary nor a mixture's experts."""

import pytest
from torch import nn

import sharded_workers as w
from shardlab import memory
from shardlab.launch import launch
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
        assert describe(model, "auto") == (f"3 units: 2 x {layer} + the root (auto: the "
                                           f"layers its _no_split_modules names)")


def test_auto_wraps_a_plain_sequential_by_its_layers_and_says_so():
    """A model that declares no layers is not made one unit (which gathers it whole, the
    failure chapter 8 measures): "auto" takes its list of layers of one class."""
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 64))
    assert unit_modules(model, "auto") == [model[0], model[2], model[4], model]
    assert describe(model, "auto") == \
        "4 units: 3 x Linear + the root (auto: its list of 3 Linear layers)"
    assert unit_modules(model, "model") == [model]
    assert describe(model, "model") == "1 unit: the root"


def test_auto_without_a_list_of_layers_wraps_by_size_and_a_small_model_whole():
    """No declared layers and no list of them: as `size_based_auto_wrap_policy`, the
    modules of at least a tenth of the model and 2^16 parameters; a model with none that
    large stays one unit, and the report line says why."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encode, self.norm = nn.Linear(512, 512), nn.LayerNorm(512)
            self.decode = nn.Linear(512, 64)

        def forward(self, x):
            return self.decode(self.norm(self.encode(x)))

    net = Net()
    assert unit_modules(net, "auto") == [net.encode, net]  # decode: 32,832 < 2^16
    assert describe(net, "auto").endswith("(auto: every module of at least 65,536 "
                                          "parameters (min-params:65536))")
    toy = build_model("toy-tied")  # 5,168 parameters: one unit is all it needs
    assert unit_modules(toy, "auto") == [toy]
    assert describe(toy, "auto") == ("1 unit: the root (auto: one unit: no declared "
                                     "layers, and no module of 65,536 parameters or more)")


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


# ----------------------------------------------------------------------------- tied weights


def test_a_unit_whose_weight_is_tied_outside_it_is_folded_into_their_common_parent():
    """BERT for masked LM ties its decoder (in `cls`) to the word embeddings, whose module
    `_no_split_modules` names as a layer: "auto" and the class policies fold that unit
    into the model (their common parent), keeping the layers; a weight tied inside one
    unit, or to nothing, changes nothing."""
    bert = build_model("hf-bert-mlm")
    layers = list(bert.bert.encoder.layer)
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    assert unit_modules(bert, "auto") == [*layers, bert]
    assert unit_modules(bert, "class:BertEmbeddings,BertLayer") == [*layers, bert]
    # an embedding picked alone: the tied one folds, the untied ones stay units
    picked = unit_modules(bert, nn.Embedding)
    assert bert.bert.embeddings.word_embeddings not in picked
    assert bert.bert.embeddings.position_embeddings in picked
    gpt = build_model("gpt-tiny")  # tied too, but embedding and head are the root's
    assert unit_modules(gpt, "auto") == [*gpt.blocks, gpt]


def test_a_tie_under_a_callable_parent_folds_into_that_parent():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.a(x))

    model = nn.Sequential(Pair(), nn.Linear(4, 4))
    assert unit_modules(model, "class:Linear") == [model[0], model[1], model]


def test_a_mixture_of_experts_decoder_is_wrapped_by_its_layers():
    model = build_model("hf-mixtral")
    assert unit_modules(model, "auto") == [*model.model.layers, model]


# One launch on 3 ranks, which divide neither the byte vocabulary (256 rows) nor the
# mixture's 4 experts: each model wrapped by "auto" under PyTorch's `fully_shard` first
# (the reference), then ZeRO-3 and FSDP2.
WORLD = 3
AUTO_CASES = [(model, strategy) for model in ("hf-bert-mlm", "hf-mixtral")
              for strategy in ("torch-fsdp2", "zero3", "fsdp2")]


@pytest.fixture(scope="module")
def auto_runs():
    pytest.importorskip("transformers")
    return launch(w.auto_wrap_cases, WORLD, AUTO_CASES, 1, timeout=600)


def test_auto_trains_a_tied_encoder_and_a_mixture_under_zero3_and_fsdp2(auto_runs):
    """A policy the course chooses gives a wrap both sharded strategies accept, and they
    train like one process and like PyTorch's `fully_shard`."""
    for rank in auto_runs:
        for case in rank:
            assert case["loss_diff"] <= 1e-5 and case["param_diff"] <= 1e-4, case
            assert case["loss_diff_vs_torch"] <= 1e-5, case
            assert case["param_diff_vs_torch"] <= 1e-5, case


def test_every_rank_s_shard_of_a_tied_weight_is_stepped(auto_runs):
    """The silent bug PyTorch once shipped: with a tied weight whose rows N does not
    divide, the last rank's shard was never updated. Every rank that holds a piece of a
    tied weight sees it change after a step, and under FSDP2 each rank's piece equals
    PyTorch's piece on that rank."""
    for rank, cases in enumerate(auto_runs):
        for case in cases:
            assert case["tied"], case  # both models tie their token embedding
            for name, piece in case["tied"].items():
                assert piece["changed"] or piece["numel"] == 0, (rank, case["strategy"], name)
                assert piece["vs_torch"] <= 1e-5, (rank, case["strategy"], name)
    embedding = [c["tied"]["model.embed_tokens.weight"]["numel"] for c in
                 (cases[4] for cases in auto_runs)]  # hf-mixtral under zero3
    assert all(embedding), embedding  # every rank holds some of it, and stepped it


def test_per_rank_bytes_of_an_uneven_dim0_split_are_the_planner_s(auto_runs):
    """4 experts on 3 ranks: rows 2, 2, 0, so the ranks hold unequal model states, none
    of them Ψ/N. `memory.dim0_states` gives each rank's bytes: padded storage for
    parameters, and for Adam's states ours pads too, PyTorch's holds the rows that exist."""
    model = build_model("hf-mixtral")
    shapes = memory.parameter_shapes(model)
    counters = 4 * len(shapes)  # Adam's step counter per parameter, one fp32 scalar
    for index, padded in ((3, False), (5, True)):
        expected = memory.dim0_states_per_rank(shapes, WORLD, "fp32", "adamw",
                                               optimizer_padded=padded)
        for rank, cases in enumerate(auto_runs):
            held, e = cases[index]["bytes"], expected[rank]
            assert (held["params"], held["optimizer"]) == (e.params, e.optimizer + counters), \
                (cases[index]["strategy"], rank, held, e)
    psi = sum(p.numel() for p in model.parameters())
    shares = [e.total / memory.model_states(psi, WORLD, 3, "fp32", "adamw").total
              for e in memory.dim0_states_per_rank(shapes, WORLD, "fp32", "adamw",
                                                   optimizer_padded=False)]
    assert shares[2] < 0.9 < 1.1 < shares[0], shares  # not the even split's 1.0
