"""The analytic model: parameter counts from architectures, the 16 bytes, the stage
formulas, the ZeRO paper's worked examples, the planner, and refusals of bad input."""

import pytest
from torch import nn

from shardlab import memory
from shardlab.memory import GB, Breakdown, bytes_per_param, model_states

# Totals published with the models (Hugging Face model cards / parameter counts).
PUBLISHED = {
    "gpt2-small": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_totals(name):
    assert memory.num_params(name) == PUBLISHED[name]


class Block(nn.Module):
    """A transformer block of either style, built from torch modules, to count against."""

    def __init__(self, c: memory.ModelConfig):
        super().__init__()
        gpt2 = c.style == "gpt2"
        norm = (lambda: nn.LayerNorm(c.hidden)) if gpt2 else (lambda: nn.RMSNorm(c.hidden))
        self.norm1, self.norm2 = norm(), norm()
        self.qkv = nn.Linear(c.hidden, c.hidden + 2 * c.kv_dim, bias=gpt2)
        self.out = nn.Linear(c.hidden, c.hidden, bias=gpt2)
        n_mlp = 2 if gpt2 else 3
        self.mlp = nn.ModuleList(
            [nn.Linear(c.hidden, c.ffn, bias=gpt2) for _ in range(n_mlp - 1)]
            + [nn.Linear(c.ffn, c.hidden, bias=gpt2)])


def torch_model(c: memory.ModelConfig) -> nn.Module:
    m = nn.Module()
    m.tok = nn.Embedding(c.vocab, c.hidden)
    if c.positions:
        m.pos = nn.Embedding(c.positions, c.hidden)
    m.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
    m.norm = nn.LayerNorm(c.hidden) if c.style == "gpt2" else nn.RMSNorm(c.hidden)
    if not c.tied:
        m.head = nn.Linear(c.hidden, c.vocab, bias=False)
    return m


@pytest.mark.parametrize("style,kv_heads,tied", [("gpt2", 4, True), ("llama", 2, False),
                                                 ("llama", 4, True)])
def test_the_count_is_that_of_a_real_module_of_the_same_shape(style, kv_heads, tied):
    c = memory.ModelConfig("small", style, layers=3, hidden=32, heads=4, kv_heads=kv_heads,
                           ffn=88, vocab=101, tied=tied, positions=16 if style == "gpt2" else 0)
    assert c.num_params() == sum(p.numel() for p in torch_model(c).parameters())
    assert c.root_params() + c.layers * c.layer_params() == c.num_params()


def test_gpt3_is_the_175b_of_its_paper():
    assert memory.num_params("gpt3-175b") / 1e9 == pytest.approx(175, rel=0.01)


def test_a_mixture_of_experts_layer_holds_every_expert_and_a_router():
    dense = memory.get_model("llama-2-7b")
    moe = memory.ModelConfig("moe", "llama", 2, 64, 4, 2, 176, 101, tied=False, experts=8,
                             top_k=2)
    plain = memory.ModelConfig("plain", "llama", 2, 64, 4, 2, 176, 101, tied=False)
    assert moe.layer_params() - plain.layer_params() == 7 * 3 * 64 * 176 + 64 * 8
    assert dense.expert_params() == 3 * dense.hidden * dense.ffn


def test_bytes_per_parameter_of_each_recipe():
    assert bytes_per_param("fp32", "adamw") == Breakdown(4, 4, 8)
    assert bytes_per_param("bf16-mixed", "adamw") == Breakdown(2, 2, 12)
    assert bytes_per_param("bf16-mixed", "adamw").total == 16
    assert bytes_per_param("bf16", "adamw") == Breakdown(2, 2, 4)
    assert bytes_per_param("fp32", "sgd") == Breakdown(4, 4, 0)
    assert bytes_per_param("fp32", "sgd-momentum") == Breakdown(4, 4, 4)
    assert bytes_per_param("bf16-mixed", "sgd") == Breakdown(2, 2, 4)  # the master copy
    assert bytes_per_param("bf16-mixed", "sgd-momentum") == Breakdown(2, 2, 8)
    assert bytes_per_param("bf16", "sgd-momentum") == Breakdown(2, 2, 2)


@pytest.mark.parametrize("precision", memory.PRECISIONS)
@pytest.mark.parametrize("optimizer", memory.OPTIMIZERS)
def test_stage_formulas(precision, optimizer):
    psi, N = 1_000_003, 7  # not divisible: sharded terms are ceil(psi / N)
    P, G, K = bytes_per_param(precision, optimizer).as_dict().values()
    shard = -(-psi // N)
    assert model_states(psi, N, 0, precision, optimizer) == Breakdown(P * psi, G * psi, K * psi)
    assert model_states(psi, N, 1, precision, optimizer) == Breakdown(P * psi, G * psi, K * shard)
    assert model_states(psi, N, 2, precision, optimizer) == Breakdown(P * psi, G * shard, K * shard)
    assert model_states(psi, N, 3, precision, optimizer) == Breakdown(P * shard, G * shard, K * shard)
    for stage in range(4):  # one rank: nothing to shard
        assert model_states(psi, 1, stage, precision, optimizer).total == (P + G + K) * psi


def test_mixed_precision_stages_in_the_papers_form():
    psi, N, K = 8 * 10**9, 64, 12
    assert model_states(psi, N, 0).total == 16 * psi
    assert model_states(psi, N, 1).total == 4 * psi + K * psi // N
    assert model_states(psi, N, 2).total == 2 * psi + (2 + K) * psi // N
    assert model_states(psi, N, 3).total == (4 + K) * psi // N


def test_zero_paper_worked_example_7_5B_on_64_gpus():
    psi = 7_500_000_000
    gb = [round(model_states(psi, 64, s).total / GB, 2) for s in range(4)]
    assert gb == [120.0, 31.41, 16.64, 1.88]  # the paper: 120, 31.4, 16.6, 1.88 GB


def test_zero_paper_worked_example_1T_on_1024_gpus():
    psi = 10**12
    assert model_states(psi, 1, 0).total == 16 * 10**12  # ~16 TB on one device
    assert model_states(psi, 1024, 3).total / GB == pytest.approx(15.6, abs=0.05)


def test_largest_model_inverts_the_formulas():
    for stage in range(4):
        psi = memory.largest_model(80 * GB, 64, stage)
        assert model_states(psi, 64, stage).total == pytest.approx(80 * GB)
    sizes = [memory.largest_model(32 * GB, 64, s) for s in range(4)]
    assert sizes == sorted(sizes)
    # ZeRO paper, Table 1 (32 GB V100s, N = 64): 2B, 7.6B, 14.4B, 128B
    assert [round(s / 1e9, 1) for s in sizes] == [2.0, 7.6, 14.4, 128.0]


def test_gpt3s_layer_is_korthikantis_34_plus_5as_over_h():
    c = memory.get_model("gpt3-175b")
    s, b, h, a = 2048, 1, c.hidden, c.heads
    layer = memory.layer_activations(c, b, s, attention="eager")
    assert sum(layer.values()) == s * b * h * (34 + 5 * a * s // h)
    assert layer["scores"] == 5 * a * s * s * b
    selective = memory.activations(c, b, s, "selective", "eager")
    assert selective.layers == c.layers * 34 * s * b * h  # their selective recomputation


def test_llama_layer_term_by_term():
    c = memory.get_model("llama-2-70b")  # GQA: 8 kv heads of 64, SwiGLU, no dropout
    s, b, h, f, a, kv = 4096, 2, c.hidden, c.ffn, c.heads, c.kv_dim
    sbh = s * b * h
    assert kv == h // 8
    sdpa = memory.layer_activations(c, b, s)
    assert sdpa == {"norms": 4 * sbh, "attention": 6 * sbh + 4 * s * b * kv + 4 * a * s * b,
                    "scores": 0, "mlp": 2 * sbh + 8 * s * b * f, "dropout": 0}
    eager = memory.layer_activations(c, b, s, attention="eager")
    assert eager["scores"] == 2 * a * s * s * b  # the softmax output; no dropout mask
    assert eager["attention"] == sdpa["attention"] - 4 * a * s * b


def test_recomputation_policies():
    c = memory.get_model("llama-2-7b")
    s, b = 4096, 1
    sbh, L = s * b * c.hidden, c.layers
    for attention in memory.ATTENTION:
        layer = sum(memory.layer_activations(c, b, s, attention).values())
        scores = memory.layer_activations(c, b, s, attention)["scores"]
        none = memory.activations(c, b, s, "none", attention)
        selective = memory.activations(c, b, s, "selective", attention)
        full = memory.activations(c, b, s, "full", attention)
        assert none.layers == L * layer and none.recompute == 0
        assert selective.layers == L * (layer - scores) and selective.recompute == scores
        assert full.layers == L * 2 * sbh and full.recompute == layer
        assert none.output == full.output == 4 * sbh + 4 * s * b * c.vocab
        assert memory.activation_bytes(c, b, s, "full", attention) == full.total
    # a fused kernel keeps no scores: selective recomputation has nothing left to drop
    assert memory.activations(c, b, s, "selective") == memory.activations(c, b, s, "none")


def test_a_mixture_of_experts_keeps_the_activations_of_top_k_experts():
    c = memory.get_model("mixtral-8x7b")
    s, b = 1024, 1
    sbh, sbf = s * b * c.hidden, s * b * c.ffn
    assert memory.layer_activations(c, b, s)["mlp"] == 2 * sbh + 2 * (2 * sbh + 8 * sbf)


def test_activations_measured_on_hugging_face_layers():
    """What autograd really saves in one layer of Hugging Face's Llama (GQA, SwiGLU) and
    GPT-2 (GELU, dropout), in bf16 on the CPU, is the formula plus named extras."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from shardlab.models import build_model

    s, b, h, heads = 128, 2, 128, 4

    def saved_by_layer(model, layer):
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, inside = {}, []
        layer.register_forward_pre_hook(lambda *_: inside.append(True))
        layer.register_forward_hook(lambda *_: inside.clear())

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if inside and ptr not in params:
                seen[ptr] = t.untyped_storage().nbytes()
            return t
        x = torch.randint(0, 256, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).logits.float().sum()
        return sum(seen.values())

    sbh, sb, ass = s * b * h, s * b, heads * s * s * b
    llama = dict(hidden_size=h, intermediate_size=344, num_attention_heads=heads,
                 num_key_value_heads=1, max_position_embeddings=s)
    for attention in memory.ATTENTION:
        m = build_model("hf-llama", config=llama).to(torch.bfloat16)
        m.set_attn_implementation(attention)
        cfg = memory.ModelConfig("l", "llama", 2, h, heads, 1, 344, 256, tied=False)
        formula = sum(memory.layer_activations(cfg, b, s, attention).values())
        # Hugging Face's RMSNorm computes in fp32: it keeps its fp32 input and the bf16
        # normalized tensor (not the bf16 input): +4sbh and a fp32 rstd per row, twice;
        # the rotary cos and sin tables, s x head_dim each
        extra = 2 * (4 * sbh + 4 * sb) + 2 * 2 * s * (h // heads)
        if attention == "eager":  # k and v repeated to every head, softmax in fp32
            extra += 2 * (2 * sbh - 2 * sb * cfg.kv_dim) + 4 * ass
        assert saved_by_layer(m, m.model.layers[0]) == formula + extra
    gpt2 = dict(n_embd=h, n_head=heads, n_positions=s, activation_function="gelu_pytorch_tanh",
                resid_pdrop=0.1, attn_pdrop=0.1)
    m = build_model("hf-gpt2", config=gpt2).to(torch.bfloat16)
    m.set_attn_implementation("eager")
    m.train()
    cfg = memory.ModelConfig("g", "gpt2", 2, h, heads, heads, 4 * h, 256, tied=True, positions=s)
    formula = sum(memory.layer_activations(cfg, b, s, "eager").values())
    assert formula == sbh * (34 + 5 * heads * s // h)
    # on a CPU a dropout mask has the activation's dtype (2 bytes, 1 on CUDA): +sbh for
    # each of the two masks, +as²b for the attention's; LayerNorm's mean and rstd in bf16
    extra = 2 * sbh + ass + 2 * 2 * 2 * sb
    assert saved_by_layer(m, m.transformer.h[0]) == formula + extra


def test_transients():
    assert memory.gathered_unit_bytes(1000, "bf16-mixed") == 2000
    assert memory.gathered_unit_bytes(1000, "fp32", prefetch=True) == 8000
    assert memory.bucket_bytes(25 * 10**6 // 4, "fp32", buckets=2) == 50 * 10**6
    c = memory.get_model("llama-3-8b")  # its root (embeddings, head) outweighs a layer
    assert c.root_params() > c.layer_params()
    # the largest unit's bf16 parameters and its unsharded bf16 gradient, plus a layer
    # prefetched
    assert memory.gathered_bytes(c) == 2 * (2 * c.root_params() + c.layer_params())
    assert memory.gathered_bytes(c, prefetch=False) == 2 * 2 * c.root_params()


def test_the_gathered_peak_counts_the_units_gradient():
    """Chapter 7's table: a Llama-2-70B layer gathered, with its gradient, and the next
    one prefetched is 3 x 2 bytes per parameter of a layer (its root is smaller)."""
    c = memory.get_model("llama-2-70b")
    assert c.layer_params() > c.root_params()
    assert memory.gathered_bytes(c) == 3 * 2 * c.layer_params()
    assert memory.gathered_bytes(c, "fp32", prefetch=False) == 2 * 4 * c.layer_params()


def test_offload_moves_the_ranks_shard_to_the_host():
    psi, N = 8 * 10**9, 8
    shard = psi // N
    for stage in (1, 2, 3):
        gpu, host = memory.offloaded_states(psi, N, stage, "optimizer")
        kept = model_states(psi, N, stage)
        assert gpu.optimizer == 0 and host.optimizer == 12 * shard
        assert host.grads == 2 * shard and host.params == 0
        assert gpu.params == kept.params
        assert gpu.grads == (2 * psi if stage == 1 else 0)
    gpu, host = memory.offloaded_states(psi, N, 3, "optimizer+params")
    assert gpu.total == 0 and host.total == 16 * shard
    gpu, host = memory.offloaded_states(psi, N, 2, "none")
    assert gpu == model_states(psi, N, 2) and host.total == 0
    with pytest.raises(ValueError, match="stage 1, 2 or 3"):
        memory.offloaded_states(psi, N, 0, "optimizer")
    with pytest.raises(ValueError, match="stage 3"):
        memory.offloaded_states(psi, N, 2, "optimizer+params")
    with pytest.raises(ValueError, match="optimizer\\+params"):
        memory.offloaded_states(psi, N, 2, "nvme")


def test_planner_finds_what_fits():
    rows = memory.plan("llama-2-7b", 80 * GB, 8, batch=1, seq=4096)
    # stage 0: no offload; 1 and 2: none or optimizer; 3: also optimizer+params
    assert len(rows) == 3 * (1 + 2 + 2 + 3)
    fits = {(r.stage, r.checkpointing, r.offload) for r in rows if r.fits}
    assert (0, "none", "none") not in fits  # 16 x 6.7B = 108 GB of states alone
    assert (3, "full", "none") in fits
    for r in rows:
        assert r.total == r.states.total + r.activations + r.gathered + r.buckets
        assert r.activations == memory.activation_bytes("llama-2-7b", 1, 4096, r.checkpointing)
        gpu, host = memory.offloaded_states(memory.num_params("llama-2-7b"), 8, r.stage,
                                            r.offload)
        assert (r.states, r.host) == (gpu, host)
        assert (r.gathered > 0) == (r.stage == 3)
    eager = memory.plan("llama-2-7b", 80 * GB, 8, attention="eager")
    assert all(e.activations >= r.activations for e, r in zip(eager, rows))


def test_the_planner_holds_pytorch_ddps_bucket_copy_at_stage_0():
    """PyTorch's DDP keeps flat buckets for all gradients beside their `.grad` unless
    gradient_as_bucket_view=True (measured in `test_measure.py`): Llama-2-7B in bf16 holds
    13.5 GB more per rank at stage 0 than the ZeRO paper's 16Ψ, and nothing more with
    views; the sharded stages are not DDP."""
    psi = memory.num_params("llama-2-7b")
    assert memory.ddp_bucket_copy_bytes(psi, "bf16-mixed") == 2 * psi == 13_476_831_232
    assert memory.ddp_bucket_copy_bytes(psi, "fp32") == 4 * psi
    assert memory.ddp_bucket_copy_bytes(psi, gradient_as_bucket_view=True) == 0
    rows = memory.plan("llama-2-7b", 80 * GB, 8)
    for r in rows:
        assert r.buckets == (2 * psi if r.stage == 0 else 0)
    stage0 = next(r for r in rows if r.stage == 0 and r.checkpointing == "full")
    assert stage0.total - stage0.states.total - stage0.activations == 2 * psi
    viewed = memory.plan("llama-2-7b", 80 * GB, 8, gradient_as_bucket_view=True)
    assert all(r.buckets == 0 for r in viewed)


def test_units():
    assert memory.parse_bytes("80GB") == 80 * 10**9
    assert memory.parse_bytes("80GiB") == 80 * 2**30
    with pytest.raises(ValueError, match="GiB"):
        memory.parse_bytes("eighty")


@pytest.mark.parametrize("call,match", [
    (lambda: model_states(0, 8, 0), "psi"),
    (lambda: model_states(-5, 8, 0), "psi"),
    (lambda: model_states(1000, 0, 0), "world"),
    (lambda: model_states(1000, 2.5, 0), "world"),
    (lambda: model_states(1000, 8, 4), r"\[0, 1, 2, 3\]"),
    (lambda: bytes_per_param("fp16", "adamw"), "bf16-mixed"),
    (lambda: bytes_per_param("fp32", "adam"), "sgd-momentum"),
    (lambda: memory.num_params("llama-4"), "llama-2-7b"),
    (lambda: memory.activation_bytes("gpt2-small", 0, 1024), "batch"),
    (lambda: memory.activation_bytes("gpt2-small", 1, 1024, "some"), "selective"),
    (lambda: memory.activation_bytes("gpt2-small", 1, 1024, attention="flash"), "sdpa"),
    (lambda: memory.plan("llama-2-7b", 80 * GB, 0), "world"),
    (lambda: memory.largest_model(-1, 8, 0), "memory"),
])
def test_bad_input_names_what_is_accepted(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_command_line(capsys):
    assert memory.main(["--model", "llama-2-7b", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616" in out
    assert "3 (Pos+g+p)" in out and "fits" in out
    assert "optimizer+params" in out
    line = next(l for l in out.splitlines() if l.startswith("0 (DDP)"))
    assert line.split()[-1] == f"{16 * 6_738_415_616 / GB:,.2f}"


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-small", "hf-gpt2", "hf-llama",
                                  "hf-llama-frozen-emb", "hf-mixtral"])
def test_the_planner_counts_the_models_train_builds(name):
    """One vocabulary: every model `train` builds by name, the planner counts, to the
    parameter (each tied weight once), with the sequence its config allows."""
    from shardlab.models import build_model
    model = build_model(name)
    assert memory.num_params(memory.as_config(name)) == \
        sum(p.numel() for p in model.parameters())
    assert memory.as_config(name).longest_sequence == 64


def test_the_published_sizes_train_builds_are_the_planner_s():
    """`train --model llama-2-7b` builds the Hugging Face model of its family at that shape
    (here on the meta device: no bytes), with exactly the planner's Ψ; and a config.json
    too, by its path."""
    pytest.importorskip("transformers")
    from shardlab.modelio import build_on_meta
    for name in ("gpt2-small", "llama-2-7b", "llama-3-8b", "mixtral-8x7b"):
        model = build_on_meta(name)
        assert sum(p.numel() for p in model.parameters()) == memory.num_params(name), name


def test_command_line_plans_the_names_train_takes_in_their_unit(capsys, tmp_path):
    """gpt-tiny and hf-llama, the names `train` takes: MiB (not 0.00 GB), and the
    sequence from the config (max_position_embeddings / n_positions) or --seq-len."""
    assert memory.main(["--model", "gpt-tiny", "--world", "2", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "gpt-tiny: psi = 120,576 parameters" in out
    assert "Model states per rank (MiB = 2^20 bytes)" in out
    line = next(l for l in out.splitlines() if l.startswith("0 (DDP)"))
    assert line.split()[-1] == f"{16 * 120_576 / 2**20:,.2f}"  # 1.84, not 0.00
    assert "micro-batch 1 x 64 tokens (the longest the model takes)" in out
    assert memory.main(["--model", "hf-llama", "--gpus", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "hf-llama: psi = 125,248 parameters" in out
    assert "micro-batch 1 x 16 tokens (--seq-len)" in out and "(MiB = 2^20 bytes)" in out
    # a Hugging Face config.json: its own max_position_embeddings
    config = dict(memory.to_hf_config(memory.get_model("llama-2-7b")),
                  max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    assert memory.main(["--model", str(tmp_path), "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 1 x 2,048 tokens" in out and "(GB = 10^9 bytes)" in out


def test_command_line_refuses_bad_input(capsys):
    with pytest.raises(SystemExit):
        memory.main(["--model", "llama-9", "--gpus", "8"])
    assert "llama-2-7b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory.main(["--model", "llama-2-7b", "--gpus", "0"])
    assert "world" in capsys.readouterr().err


def test_stage_figures_draw_the_formulas():
    import matplotlib
    matplotlib.use("Agg")
    from shardlab import viz

    psi = memory.num_params("llama-2-7b")
    anim = viz.stages_animation(psi, worlds=(1, 8), gpu_memory=80 * GB)
    html = anim.to_jshtml()  # the self-contained player the static page shows
    assert html.count("data:image/png") == 8  # 4 stages x 2 values of N
    assert "anim_step_forward" in html
    fig = viz.stages_figure(psi, 8)
    ax = fig.axes[0]
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x() + bar.get_width() / 2)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    assert [tops[s] for s in range(4)] == pytest.approx(
        [model_states(psi, 8, s).total / GB for s in range(4)])


@pytest.mark.parametrize("nbytes,block,segment", [
    (1, 512, 2 << 20),                                # the smallest block
    (512, 512, 2 << 20),
    (513, 1024, 2 << 20),
    (1 << 20, 1 << 20, 2 << 20),                      # the largest small block
    ((1 << 20) + 512, (1 << 20) + 512, 20 << 20),     # a large one, in a 20 MiB segment
    ((10 << 20) - 512, (10 << 20) - 512, 20 << 20),
    ((10 << 20) + 1, (10 << 20) + 512, 12 << 20),     # its own segment, to 2 MiB
])
def test_the_cuda_allocators_blocks_and_segments(nbytes, block, segment):
    """The sizes PyTorch's own allocator tests expect (test_cuda.py's memory-stats cases:
    512 B and 1 MiB requests in 2 MiB small-pool segments, 1 MiB + 512 B to 10 MiB - 512 B
    in 20 MiB segments, larger ones rounded to 2 MiB)."""
    assert memory.cuda_block_bytes(nbytes) == block
    assert memory.cuda_segment_bytes(nbytes) == segment


def test_the_allocator_refuses_nonsense():
    with pytest.raises(ValueError, match="nbytes must be a whole number > 0"):
        memory.cuda_block_bytes(0)


def test_fsdp2_s_dim0_split_at_a_world_size_that_does_not_divide_the_rows():
    """`torch.chunk` along dim 0: ceil(d0/N) rows for the first ranks, the rest after;
    a router of 4 experts on 3 ranks is rows 2, 2, 0. Storage is padded to ceil(d0/N)
    rows on every rank; the rows that exist add up to the parameter."""
    assert [memory.rows_of(4, 3, r) for r in range(3)] == [2, 2, 0]
    assert [memory.rows_of(256, 3, r) for r in range(3)] == [86, 86, 84]
    assert [memory.rows_of(5, 4, r) for r in range(4)] == [2, 2, 1, 0]
    router, embedding, bias = (4, 64), (256, 64), (64,)
    shapes = [router, embedding, (bias, False)]  # a frozen bias: parameter bytes only
    exist = [memory.shard_elements(shapes, 3, r, padded=False) for r in range(3)]
    assert sum(exist) == 4 * 64 + 256 * 64 + 64
    assert exist == [2 * 64 + 86 * 64 + 22, 2 * 64 + 86 * 64 + 22, 84 * 64 + 20]
    padded = memory.shard_elements(shapes, 3, 2)
    assert padded == 2 * 64 + 86 * 64 + 22
    ours = memory.dim0_states(shapes, 3, 2, "fp32", "adamw")
    theirs = memory.dim0_states(shapes, 3, 2, "fp32", "adamw", optimizer_padded=False)
    assert ours == memory.Breakdown(4 * padded, 4 * (2 + 86) * 64, 8 * (2 + 86) * 64)
    assert theirs == memory.Breakdown(4 * padded, 4 * (2 + 86) * 64, 8 * 84 * 64)
    # N dividing every d0: the even split of the formula, on every rank
    even = memory.dim0_states_per_rank([(6, 8), (12, 8)], 3, "bf16-mixed", "adamw")
    assert all(b == memory.model_states(18 * 8, 3, 3) for b in even)
    with pytest.raises(ValueError, match="rank must be in 0..2"):
        memory.rows_of(4, 3, 3)


def test_the_planner_gives_fsdp2_s_bytes_of_every_rank_at_any_world_size():
    """From a configuration alone: the shapes add up to Ψ for every model; Mixtral's 8
    experts (fused, 8 rows) on 3 GPUs are 3, 3 and 2 a rank, so the ranks' model states
    differ and the largest exceeds the even split; on 8 GPUs every rank holds Ψ/8."""
    from math import prod
    for cfg in memory.MODELS.values():
        assert sum(prod(s) for s in cfg.parameter_shapes()) == cfg.num_params(), cfg.name
    mixtral = memory.get_model("mixtral-8x7b")
    psi = mixtral.num_params()
    by_rank = memory.fsdp2_states_by_rank(mixtral, 3, "bf16-mixed", "adamw")
    even = memory.model_states(psi, 3, 3, "bf16-mixed", "adamw").total
    assert by_rank[0].total > 1.05 * even and by_rank[2].total < 0.95 * even
    assert sum(b.optimizer for b in by_rank) == 12 * psi  # the rows that exist, once
    assert len({b.total for b in memory.fsdp2_states_by_rank(mixtral, 8)}) == 1
