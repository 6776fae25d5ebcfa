"""Small deterministic models and the data they train on.

Every strategy of the course is checked against one question: does it train *exactly*
like one process on the whole batch? That needs models and data that are identical on
every rank and in every run, so everything here is a pure function of a seed:

* `build_model(name, seed)` builds the same weights on every rank (the RNG is forked, so
  building a model never disturbs the caller's random state);
* `get_batch(step, rank, world, ...)` cuts the same global batch of a step into `world`
  contiguous blocks of rows, so the ranks' batches concatenated are the single-process
  batch.

The GPT is nanoGPT's shape at toy size: token and position embeddings, `blocks` of
causal self-attention and MLP, and an output head that *is* the token embedding (tied
weights, which a data-parallel wrapper must count and average once). The corpus is
generated English-like text that ships with the package (`data/corpus.txt`), read as
bytes, so the vocabulary is the 256 byte values and nothing is downloaded.

The toy models exist for the awkward cases every wrapper has to survive: frozen
parameters, a parameter the forward never uses, two modules sharing one weight, buffers.
"""

from __future__ import annotations

import dataclasses
import threading
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# What each name stands for is data, read without torch by the command line
from shardlab.memory.configs import as_config, to_hf_config
from shardlab.vocabulary import (GPT_CONFIGS, HF_MODELS, LOSS_MEANS,  # noqa: F401
                                 MODEL_NAMES, VOCAB_SIZE, GPTConfig, HFModel,
                                 did_you_mean)

IGNORE_INDEX = -100  # the label of a padding token: the loss skips it (PyTorch's default)
CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"


# ----------------------------------------------------------------------------- the GPT


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one Parameter, two uses
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size "
                             f"{self.config.block_size}; use seq_len <= {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------- toy models


class ToyNet(nn.Module):
    """embedding -> Linear -> ReLU -> Linear to the vocabulary; the base of the toys."""

    def __init__(self, width: int = 16, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB_SIZE, width)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.head = nn.Linear(width, VOCAB_SIZE)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(F.relu(self.fc1(self.emb(idx)))))


class ToyFrozen(ToyNet):
    """The embedding and one bias are frozen: no gradient, no optimizer state, no traffic."""

    def __init__(self):
        super().__init__()
        self.emb.weight.requires_grad_(False)
        self.fc1.bias.requires_grad_(False)


class ToyUnused(ToyNet):
    """`unused` takes part in no forward, so its gradient stays None on every rank."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(16, 16)


class ToyTied(ToyNet):
    """The output head reuses the embedding matrix: one Parameter reached two ways."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, VOCAB_SIZE, bias=False)
        self.head.weight = self.emb.weight


class ToyBuffers(ToyNet):
    """Buffers travel with the model but are not trained: a fixed per-channel scale and a
    step counter. A wrapper must broadcast them, and must not average or optimize them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("channel_scale", 1.0 + 0.1 * torch.randn(16, device="cpu"))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long, device="cpu"))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.emb(idx) * self.channel_scale
        return self.head(self.fc2(F.relu(self.fc1(h))))


TOY_MODELS = {"toy-frozen": ToyFrozen, "toy-unused": ToyUnused, "toy-tied": ToyTied,
              "toy-buffers": ToyBuffers}  # in the order of vocabulary.TOY_NAMES


# ----------------------------------------------------------------------------- Hugging Face


def hf_classes(family: str) -> tuple[type, type]:
    """(config class, model class) of a family of HF_MODELS, by its `model_type`."""
    try:
        import transformers
    except ImportError:
        raise ValueError("the hf-* models need Hugging Face transformers: "
                         "pip install transformers") from None
    return {"gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "bert": (transformers.BertConfig, transformers.BertForMaskedLM),
            "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[family]


def build_hf_model(spec: HFModel, overrides: dict | None = None) -> nn.Module:
    config_class, model_class = hf_classes(spec.family)
    known = config_class().to_dict()
    unknown = sorted(set(overrides or {}) - set(known))
    if unknown:  # a Hugging Face config keeps any keyword silently: refuse a typo here
        raise ValueError(f"unknown {config_class.__name__} field(s) {unknown}"
                         f"{did_you_mean(unknown[0], known)}")
    config = config_class(**{**dict(spec.config), **(overrides or {})}, use_cache=False)
    config._attn_implementation = "sdpa"
    model = model_class(config)
    if spec.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def hf_spec(name: str) -> HFModel | None:
    """The Hugging Face model a name builds: an hf-* model's; a published size's or a
    config.json's (its path): the model of its family at that shape (`to_hf_config`);
    None for the course's GPT and the toys. An unknown name is refused, naming the
    nearest."""
    if name in HF_MODELS:
        return HF_MODELS[name]
    if name in MODEL_NAMES:
        return None
    settings = to_hf_config(as_config(name))
    return HFModel(settings.pop("model_type"), tuple(settings.items()))


# torch's default generator is one per process: where ranks are threads of one process
# (`shardlab.many_ranks.threads`), whoever seeds it or builds a model holds this lock, so that
# a rank's build is never reseeded halfway by another's
GENERATOR_LOCK = threading.Lock()


def build_model(name: str, seed: int = 0, config: dict | None = None) -> nn.Module:
    """The model `name` with weights drawn from `seed`: identical on every rank and run.

    `name`: one of the course's models (`MODEL_NAMES`), a published size the planner
    counts (`gpt2-small`, `llama-2-7b`, ...: the Hugging Face model of its family at that
    shape), or the path of a Hugging Face config.json. `config` changes the
    architecture's settings: the course GPT's fields (`n_layer`, `d_model`, ...) or a
    Hugging Face config's (`n_layer`, `hidden_size`, `num_key_value_heads`, ...), e.g.
    `build_model("hf-llama", config={"num_hidden_layers": 8})`. A spawned rank rebuilds
    the model from the name and this dict, so your own size of a known architecture
    needs no code of yours in the ranks."""
    if name not in MODEL_NAMES:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_hf_model(hf_spec(name), config)
    if config and name in TOY_MODELS:
        raise ValueError(f"the toy model {name!r} takes no config; use a gpt-* or hf-* model")
    with GENERATOR_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in GPT_CONFIGS:
            fields = {f.name for f in dataclasses.fields(GPTConfig)}
            unknown = sorted(set(config or {}) - fields)
            if unknown:
                raise ValueError(f"unknown GPT config field(s) {unknown}"
                                 f"{did_you_mean(unknown[0], fields)}; use {sorted(fields)}")
            return GPT(dataclasses.replace(GPT_CONFIGS[name], **(config or {})))
        if name in HF_MODELS:
            return build_hf_model(HF_MODELS[name], config)
        return TOY_MODELS[name]()


def logits_of(output) -> torch.Tensor:
    """The logits of a forward: the tensor itself, or a `ModelOutput`'s `.logits`."""
    return output if isinstance(output, torch.Tensor) else output.logits


def loss_fn(output, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy over the tokens whose label is not `IGNORE_INDEX` (padding): their
    mean over the local batch, or their sum. Computed in fp32 even for bf16 logits, so
    the loss (and the first gradient) does not lose digits to the low-precision format."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)


# How a step's loss is averaged (TrainConfig.loss_mean).


def check_loss_mean(loss_mean) -> str:
    if loss_mean not in LOSS_MEANS:
        raise ValueError(f"loss_mean must be one of {list(LOSS_MEANS)} ('tokens': the summed "
                         f"loss over the global count of tokens), got {loss_mean!r}")
    return loss_mean


def micro_batch_loss(output, y: torch.Tensor, loss_mean: str, world: int, micro_steps: int,
                     global_tokens: int) -> torch.Tensor:
    """The loss of one micro-batch on one rank, scaled so that the gradients the ranks
    average (every strategy, ours and the references, divides their sum by N) are the
    gradient of the step's loss.

    "tokens": the step's loss is the sum over every token of every rank's micro-batches
    divided by `global_tokens`, their count; each micro-batch contributes its summed loss
    / global_tokens, times N to undo the strategies' division by N (torchtitan does the
    same the other way round: it turns FSDP's division off). One process over the whole
    batch computes exactly this loss.
    "per-batch": the mean of the micro-batches' and ranks' own means, the naive way. With
    micro-batches holding different counts of tokens (padding), a token of a short
    micro-batch weighs more than one of a long one: the loss and its gradient are not
    those of one process over the whole batch."""
    if loss_mean == "tokens":
        return loss_fn(output, y, "sum") * (world / global_tokens)
    return loss_fn(output, y) / micro_steps


# ----------------------------------------------------------------------------- data


def longest_sequence(name: str, config: dict | None = None) -> int | None:
    """The longest sequence the model `name` (with `config`'s settings) takes: what its
    position embedding covers. None for the toys, which have no positions. Read from the
    settings, without building the model, so that the launching process checks it."""
    overrides = config or {}
    longest = None
    if name in GPT_CONFIGS:
        longest = overrides.get("block_size", GPT_CONFIGS[name].block_size)
    elif name not in MODEL_NAMES or name in HF_MODELS:
        settings = {**dict(hf_spec(name).config), **overrides}
        longest = next((settings[k] for k in ("n_positions", "max_position_embeddings")
                        if k in settings), None)
    # a setting that is not a whole number is the model's to refuse, by its name
    return longest if isinstance(longest, int) and not isinstance(longest, bool) else None


@lru_cache(maxsize=1)
def corpus_tokens() -> torch.Tensor:
    """The shipped corpus as a 1-D tensor of byte values (int64)."""
    data = CORPUS_PATH.read_bytes()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def check_batch_split(batch_size: int, world: int, micro_steps: int = 1) -> None:
    """Refuse a global batch that does not split evenly into ranks and micro-batches."""
    if batch_size < 1 or world < 1 or micro_steps < 1:
        raise ValueError(f"batch_size, world and grad_accum must be >= 1, got "
                         f"{batch_size}, {world}, {micro_steps}")
    if batch_size % (world * micro_steps):
        raise ValueError(f"the global batch of {batch_size} rows does not split evenly "
                         f"among {world} ranks x {micro_steps} micro-batches; use a "
                         f"batch_size that is a multiple of {world * micro_steps}")


def row_lengths(step: int, batch_size: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """How many real tokens each row of step `step`'s global batch holds, with
    `variable_lengths`: drawn from (seed, step) between seq_len/8 and seq_len, the rest of
    the row padding. A pure function of its arguments, so every rank can read the whole
    batch's lengths without a collective."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step + 500_009)
    return torch.randint(max(1, seq_len // 8), seq_len + 1, (batch_size,), generator=gen,
                         device="cpu")


def global_token_count(step: int, batch_size: int, seq_len: int, seed: int = 0,
                       variable_lengths: bool = False) -> int:
    """The tokens the loss counts in step `step`'s global batch (every rank, every
    micro-batch). Read from the batch itself, which every rank can draw because the data
    is a function of (seed, step): no all-reduce of the count before backward, so the
    ledger holds the strategy's traffic only. A data loader that sees only its own rank's
    rows would all-reduce its count (one scalar) instead, as torchtitan does."""
    if not variable_lengths:
        return batch_size * seq_len
    return int(row_lengths(step, batch_size, seq_len, seed).sum())


def batch_rows(rank: int, world: int, batch_size: int, micro: int = 0,
               micro_steps: int = 1) -> range:
    """The rows of a step's global batch that rank `rank` reads in micro-batch `micro`:
    the rank's contiguous block of B/N rows, and the micro-batch's equal slice of it. The
    global batch of a step does not depend on N, so a run resumed on another number of
    ranks reads the same rows of each step, split another way."""
    check_batch_split(batch_size, world, micro_steps)
    if not 0 <= rank < world or not 0 <= micro < micro_steps:
        raise ValueError(f"need 0 <= rank < world and 0 <= micro < micro_steps, got "
                         f"rank={rank}, world={world}, micro={micro}, micro_steps={micro_steps}")
    rows = batch_size // (world * micro_steps)
    first = rank * (batch_size // world) + micro * rows
    return range(first, first + rows)


def sample_ids(step: int, rank: int, world: int, batch_size: int, micro: int = 0,
               micro_steps: int = 1) -> list[int]:
    """The ids of the samples `get_batch` returns, counted from the run's first: row i of
    step s is sample s·B + i. A run that trains steps 0..T-1, resumed or not, on any
    number of ranks, reads each of the samples 0..T·B-1 once."""
    return [step * batch_size + row
            for row in batch_rows(rank, world, batch_size, micro, micro_steps)]


def get_batch(step: int, rank: int, world: int, batch_size: int, seq_len: int, seed: int = 0,
              micro: int = 0, micro_steps: int = 1,
              variable_lengths: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of micro-batch `micro` of step `step`'s global batch.

    The global batch of a step is `batch_size` windows of `seq_len + 1` bytes at offsets
    drawn from (seed, step). Rank r takes the contiguous rows r*B/N ... (r+1)*B/N - 1 and
    micro-batch m the m-th equal slice of those, so that, whatever `world` and
    `micro_steps` are, all ranks' micro-batches together are exactly the same rows.
    Returns (x, y) of shape (B / (N * micro_steps), seq_len), y shifted by one token.
    With `variable_lengths`, row i holds `row_lengths(...)[i]` real tokens, and the rest
    is padding: token 0 in x, `IGNORE_INDEX` in y (at the end of the row, so a causal
    model's real tokens never attend to it).
    """
    rows = batch_rows(rank, world, batch_size, micro, micro_steps)
    tokens = corpus_tokens()
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    offsets = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=gen,
                            device="cpu")
    windows = torch.stack([tokens[o:o + seq_len + 1] for o in offsets[rows.start:rows.stop]])
    x, y = windows[:, :-1], windows[:, 1:]
    if variable_lengths:
        lengths = row_lengths(step, batch_size, seq_len, seed)[rows.start:rows.stop]
        padding = torch.arange(seq_len, device="cpu") >= lengths[:, None]
        x, y = x.masked_fill(padding, 0), y.masked_fill(padding, IGNORE_INDEX)
    return x, y
