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


def test_activations_follow_korthikanti():
    c = memory.get_model("llama-2-7b")
    s, b, h, a, L = 2048, 2, c.hidden, c.heads, c.layers
    assert memory.activation_bytes(c, b, s) == L * s * b * h * (34 + 5 * a * s // h)
    assert memory.activation_bytes(c, b, s, "selective") == L * 34 * s * b * h
    assert memory.activation_bytes(c, b, s, "full") == L * 2 * s * b * h


def test_transients():
    assert memory.gathered_unit_bytes(1000, "bf16-mixed") == 2000
    assert memory.gathered_unit_bytes(1000, "fp32", prefetch=True) == 8000
    assert memory.bucket_bytes(25 * 10**6 // 4, "fp32", buckets=2) == 50 * 10**6


def test_planner_finds_what_fits():
    rows = memory.plan("llama-2-7b", 80 * GB, 8, batch=1, seq=4096)
    assert len(rows) == 4 * 3 * 2
    fits = {(r.stage, r.checkpointing, r.offload) for r in rows if r.fits}
    assert (0, "none", False) not in fits  # 16 x 6.7B = 108 GB of states alone
    assert (3, "full", False) in fits
    for r in rows:
        assert r.total == r.states.total + r.activations + r.gathered
        if r.offload:
            assert r.states.optimizer == 0
        assert (r.gathered > 0) == (r.stage == 3)


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
    line = next(l for l in out.splitlines() if l.startswith("0 (DDP)"))
    assert line.split()[-1] == f"{16 * 6_738_415_616 / GB:,.2f}"


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
