"""Models and data: deterministic, identical for every split of the batch, and the toy
models really have the awkward properties the parity tests rely on."""

import pytest
import torch

from shardlab.models import (GPT, MODEL_NAMES, VOCAB_SIZE, build_model, corpus_tokens, logits_of,
                             get_batch, loss_fn)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_build_is_deterministic_and_leaves_the_global_rng_alone(name):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b = build_model(name, seed=5), build_model(name, seed=5)
    assert torch.equal(torch.rand(3), expected_next)
    pa, pb, pc = params(a), params(b), params(build_model(name, seed=6))
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    trained = [k for k, p in a.named_parameters() if p.requires_grad]
    assert any(not torch.equal(pa[k], pc[k]) for k in trained)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_returns_logits_over_the_byte_vocabulary(name):
    x, y = get_batch(0, 0, 1, batch_size=4, seq_len=16)
    output = build_model(name)(x)  # a tensor, or a Hugging Face ModelOutput
    assert logits_of(output).shape == (4, 16, VOCAB_SIZE)
    loss = loss_fn(output, y)
    # an untrained model is close to uniform over 256 symbols: loss near ln 256
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_gpt_has_blocks_and_ties_embedding_and_head():
    model = build_model("gpt-tiny")
    assert isinstance(model, GPT) and isinstance(model.blocks, torch.nn.ModuleList)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # counted once
    small = build_model("gpt-small")
    n_tiny = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in small.parameters()) > 5 * n_tiny


def test_toy_models_have_their_awkward_parts():
    frozen = build_model("toy-frozen")
    assert {n for n, p in frozen.named_parameters() if not p.requires_grad} == {
        "emb.weight", "fc1.bias"}
    unused = build_model("toy-unused")
    x, y = get_batch(0, 0, 1, 4, 8)
    loss_fn(unused(x), y).backward()
    assert unused.unused.weight.grad is None and unused.fc1.weight.grad is not None
    tied = build_model("toy-tied")
    assert tied.head.weight is tied.emb.weight
    buffers = build_model("toy-buffers")
    assert {n for n, _ in buffers.named_buffers()} == {"channel_scale", "calls"}


@pytest.mark.parametrize("world,micro_steps", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)])
def test_ranks_and_micro_batches_together_are_the_global_batch(world, micro_steps):
    x_all, y_all = get_batch(7, 0, 1, batch_size=8, seq_len=16, seed=3)
    parts = [get_batch(7, r, world, 8, 16, seed=3, micro=m, micro_steps=micro_steps)
             for r in range(world) for m in range(micro_steps)]
    assert all(x.shape == (8 // (world * micro_steps), 16) for x, _ in parts)
    assert torch.equal(torch.cat([x for x, _ in parts]), x_all)
    assert torch.equal(torch.cat([y for _, y in parts]), y_all)
    assert torch.equal(x_all[:, 1:], y_all[:, :-1])  # y is x shifted by one token


def test_batches_vary_with_step_and_seed_but_not_with_the_call():
    a = get_batch(0, 0, 1, 8, 16)[0]
    assert torch.equal(a, get_batch(0, 0, 1, 8, 16)[0])
    assert not torch.equal(a, get_batch(1, 0, 1, 8, 16)[0])
    assert not torch.equal(a, get_batch(0, 0, 1, 8, 16, seed=1)[0])
    assert len(corpus_tokens()) > 50_000 and int(corpus_tokens().max()) < VOCAB_SIZE


def test_bad_input_is_refused_with_a_message_that_says_what_to_do():
    with pytest.raises(ValueError, match="unknown model 'gpt-huge'.*gpt-tiny"):
        build_model("gpt-huge")
    with pytest.raises(ValueError, match="multiple of 3"):
        get_batch(0, 0, 3, batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match="multiple of 4"):
        get_batch(0, 0, 2, batch_size=6, seq_len=16, micro_steps=2)
    with pytest.raises(ValueError, match="rank"):
        get_batch(0, 2, 2, batch_size=8, seq_len=16)
    with pytest.raises(ValueError, match="block_size"):
        build_model("gpt-tiny")(torch.zeros(1, 65, dtype=torch.long))


def test_a_known_architecture_at_your_own_size():
    """`config` changes a known architecture's settings; a typo is refused (a Hugging Face
    config would keep an unknown keyword silently)."""
    assert len(build_model("gpt-tiny", config={"n_layer": 3}).blocks) == 3
    with pytest.raises(ValueError, match=r"unknown GPT config field\(s\) \['nlayer'\]"):
        build_model("gpt-tiny", config={"nlayer": 3})
    with pytest.raises(ValueError, match="takes no config"):
        build_model("toy-tied", config={"width": 3})
    pytest.importorskip("transformers")
    llama = build_model("hf-llama", config={"num_hidden_layers": 3})
    assert len(llama.model.layers) == 3
    with pytest.raises(ValueError, match=r"unknown GPT2Config field\(s\) \['nlayer'\]"):
        build_model("hf-gpt2", config={"nlayer": 3})
