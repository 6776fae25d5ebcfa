"""Models in and out of shards (`shardlab.modelio`): a Hugging Face folder loaded into
every kind of strategy through the meta device, equal to a build without meta, parameter
by parameter and buffer by buffer (and found unequal when one buffer is skipped); a
trained checkpoint exported and read back by `from_pretrained` with equal logits; bad
folders and configs refused in one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modelio_workers import SEED, meta_cases
from shardlab import memory
from shardlab.cards import CARDS
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.memory.planner import main as memory_main
from shardlab.modelio import build_on_meta, check_matches, read_model_config
from shardlab.modelio.export import export_hf, main as export_main
from shardlab.modelio.host_memory import WARM_UP, load_one_way, predicted_bytes
from shardlab.models import build_model, get_batch
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import get_strategy

transformers = pytest.importorskip("transformers")
SKIPPED = "model.rotary_emb.inv_freq"
MEASURED = ("ddp", "torch-fsdp2")  # the planner's prediction from config.json, checked
ON_META = [name for name, card in CARDS.items() if card.shards_on_meta]
OPTIONS = {"hsdp": {"shard_group": 1}}  # 2 replicas of 1 shard
COUNTER = 4  # Adam's step counter: one fp32 scalar per stepped tensor


def write_folder(path, name, seed=SEED, config=None):
    from transformers.utils import logging
    logging.disable_progress_bar()
    build_model(name, seed=seed, config=config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: write_folder(root / name, name) for name in ("hf-llama", "hf-gpt2")}


@pytest.fixture(scope="module")
def ran(folders, tmp_path_factory):
    """One launch on 2 ranks: every case, then a run that trains and saves."""
    cases = [{"model": "hf-llama", "folder": folders["hf-llama"], "strategy": s,
              "measure": s in MEASURED, "options": OPTIONS.get(s, {})}
             for s in ("ddp", *ON_META)]  # every strategy that shards a meta model
    cases += [{"model": "hf-gpt2", "folder": folders["hf-gpt2"], "strategy": s}
              for s in ("zero1", "fsdp2", "torch-fsdp2")]  # a tied head
    cases += [{"model": "hf-llama", "folder": folders["hf-llama"], "strategy": s,
               "skip": [SKIPPED]} for s in ("fsdp2", "torch-fsdp2")]
    root = tmp_path_factory.mktemp("ckpt")
    train = {"model": "hf-llama", "folder": folders["hf-llama"], "strategy": "zero3",
             "steps": 3, "checkpoint_dir": str(root)}
    out = launch(meta_cases, 2, cases, train)[0]
    return cases, out, root


def test_meta_path_equals_a_build_without_meta(ran):
    cases, out, _ = ran
    for case, result in zip(cases, out["cases"]):
        if case.get("skip"):
            continue
        assert result["params"] == [] and result["buffers"] == [], case
        assert result["count"][0] > 0


def test_a_skipped_buffer_is_found(ran):
    """The trap: a non-persistent buffer (Llama's rotary inv_freq) is in no file; left
    uninitialized, the comparison must fail on it, and on it alone."""
    cases, out, _ = ran
    skipped = [r for c, r in zip(cases, out["cases"]) if c.get("skip")]
    assert len(skipped) == 2
    for result in skipped:
        assert result["buffers"] == [SKIPPED] and result["params"] == []


def test_our_fsdp2_loads_through_meta_holding_its_shards_not_the_model(tmp_path):
    """The course's `fsdp2` cuts a meta model, giving storage to its shards alone, and
    reads only its rows: each rank's peak host memory stays nearer the meta formula (its
    shards, and the file's pages that hold them) than the whole model's (an init and the
    file), which is where a rank that materialized the model before sharding would be."""
    settings = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4}
    big, small = tmp_path / "big", tmp_path / "small"
    write_folder(big, "hf-llama", config=settings)
    write_folder(small, "hf-llama", config={**settings, **WARM_UP})
    for r in launch(load_one_way, 2, "meta", str(big), "hf-llama", settings, str(small),
                    "fsdp2"):
        meta, whole = (predicted_bytes(way, r["psi_bytes"], r["largest_bytes"], 2, r["rank"])
                       for way in ("meta", "full"))
        assert r["peak"] < (meta + whole) / 2, (r["rank"], r["peak"] / 2**20, meta / 2**20)


@pytest.mark.parametrize("strategy", [n for n, c in CARDS.items() if not c.shards_on_meta])
def test_a_strategy_that_keeps_the_whole_model_refuses_a_meta_model(strategy):
    """In one line, before any collective or any read of a value the model lacks."""
    wrap = get_strategy(strategy)
    with pytest.raises(ValueError, match=f"strategy '{strategy}' keeps the whole model on "
                                         f"every rank and cannot wrap a model on the meta"):
        wrap(build_on_meta("gpt-tiny"), get_precision("fp32"),
             optimizer_spec("adamw", 1e-3), {})
    assert wrap.__name__.startswith("wrap_")  # still the strategy's own, as registered


def test_export_loads_with_from_pretrained_and_gives_equal_logits(ran, tmp_path, one_thread):
    _, out, root = ran
    assert out["losses"][-1] < out["losses"][0]
    exported = export_hf(root / "step-000003", tmp_path / "export")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    trained = build_model("hf-llama")
    trained.load_state_dict(out["params"], strict=False)  # rotary buffers: not in it
    x, _ = get_batch(0, 0, 1, 4, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, trained(x).logits)
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] \
        == "llama"


def test_export_refuses_a_folder_holding_another_model(ran, tmp_path, capsys):
    _, _, root = ran
    step = str(root / "step-000003")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"x")
    assert export_main([step, "--hf", str(tmp_path / "weights")]) == 2
    assert "already holds weights (model.safetensors)" in capsys.readouterr().err
    other = write_folder(tmp_path / "other", "hf-llama", config={"num_hidden_layers": 3})
    (tmp_path / "other" / "model.safetensors").unlink()
    assert export_main([step, "--hf", other]) == 2
    err = capsys.readouterr().err
    assert "holds another model's config.json" in err and "num_hidden_layers" in err
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == \
        ["config.json", "generation_config.json"]  # nothing written


def test_a_config_that_is_not_a_model_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"learning_rate": 0.1}')
    with pytest.raises(ValueError, match="not a model config the course builds"):
        read_model_config(tmp_path)
    with pytest.raises(ValueError, match="not a model config"):
        TrainConfig(model="hf-llama", init_from=str(tmp_path)).validate()
    with pytest.raises(SystemExit) as planned:  # the planner's command refuses it too
        memory_main(["--model", str(tmp_path / "config.json"), "--gpus", "2"])
    assert planned.value.code == 2
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a JSON file"):
        read_model_config(tmp_path / "config.json")


def test_init_from_a_mismatched_folder_names_the_first_mismatches(folders):
    with pytest.raises(ValueError) as info:
        TrainConfig(model="hf-llama", model_config={"hidden_size": 32},
                    init_from=folders["hf-llama"]).validate()
    message = str(info.value)
    assert "'model.embed_tokens.weight' is [256, 64] in the file, [256, 32]" in message
    assert message.count(" in the file") == 3 and "more" in message and "\n" not in message
    with pytest.raises(ValueError, match="holds a gpt2 model, and model 'hf-llama'"):
        TrainConfig(model="hf-llama", init_from=folders["hf-gpt2"]).validate()
    with pytest.raises(ValueError, match="not in the model"):
        check_matches(folders["hf-llama"],
                      build_on_meta("hf-llama", {"num_hidden_layers": 1}))


def test_the_planner_reads_a_config_json_and_predicts_the_bytes_measured(ran, folders, capsys):
    """`plan` and `python -m shardlab memory --model config.json` on the reader's own
    model: Ψ counted from the config alone is the model's, and the bytes it predicts per
    rank are those each rank measured holding that model (fp32 AdamW, 2 ranks)."""
    cases, out, _ = ran
    config = memory.as_config(Path(folders["hf-llama"]) / "config.json")
    model = build_model("hf-llama")
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert memory.as_config(model).num_params() == config.num_params()
    tensors = len(list(model.parameters()))
    for case, result in zip(cases, out["cases"]):
        if not case.get("measure"):
            continue
        if case["strategy"] == "ddp":
            want = memory.model_states(config.num_params(), 2, 0, "fp32", "adamw")
        else:  # PyTorch's fully_shard: dim-0 rows; rank 0's share (launch returned rank 0)
            want = memory.fsdp2_states_by_rank(config, 2, "fp32", "adamw")[0]
        got = result["state_bytes"]
        assert (got["params"], got["grads"], got["optimizer"]) == \
            (want.params, want.grads, want.optimizer + COUNTER * tensors), case
    assert len(memory.plan(str(Path(folders["hf-llama"]) / "config.json"), 80e9, 2)) > 0
    assert memory_main(["--model", folders["hf-llama"], "--gpus", "2"]) == 0
    assert "psi = 125,248 parameters" in capsys.readouterr().out
