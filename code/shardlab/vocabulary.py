"""The names the package's commands and configs accept, and what each model name is,
without importing torch.

A module of its own so that `python -m shardlab train` and `python -m shardlab memory`
read one list of model names, and a misspelt name is answered ("did you mean zero3?")
before torch is imported, which takes seconds. What a name stands for is data here:

* the course's GPT at two sizes (`GPT_CONFIGS`), the toys (`TOY_NAMES`, whose classes
  are in `shardlab.models`), and Hugging Face architectures at toy size (`HF_MODELS`):
  the models `shardlab.models.build_model` builds and the planner counts;
* beside them, the published sizes of `shardlab.memory.configs.MODELS` (GPT-2, Llama,
  Mixtral), which the planner counts and the trainer builds as the Hugging Face model of
  their family (`shardlab.memory.configs.model_names` lists both);
* the precisions, optimizers, placements and loss means, whose implementations
  (`shardlab.precision`, `shardlab.optimizers`, `shardlab.launch`, `shardlab.models`) hold
  exactly these names (tests/test_cli.py checks it).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass

VOCAB_SIZE = 256  # byte-level tokens


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = VOCAB_SIZE
    block_size: int = 64  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64


GPT_CONFIGS = {
    "gpt-tiny": GPTConfig(n_layer=2, n_head=4, d_model=64),
    # big enough (about 3.2 M parameters, 12.6 MB of fp32 gradients) that the gradient
    # all-reduce costs about as much as the compute of a small CPU step
    "gpt-small": GPTConfig(n_layer=4, n_head=8, d_model=256),
}

# The awkward cases every wrapper has to survive (`shardlab.models` builds them).
TOY_NAMES = ("toy-frozen", "toy-unused", "toy-tied", "toy-buffers")


@dataclass(frozen=True)
class HFModel:
    """A `transformers` model built from a config (random weights, nothing downloaded):
    the architecture of a real checkpoint at toy size, with what real models bring that
    the course's GPT does not: layers under their own names (`model.transformer.h`,
    `model.model.layers`), rotary buffers, grouped-query attention, a `ModelOutput`."""

    family: str                       # "gpt2", "llama", "bert" or "mixtral"
    config: tuple[tuple[str, object], ...]
    freeze_embeddings: bool = False   # token embeddings frozen (requires_grad=False)


# Dropout is off (each rank would draw its own masks) and the byte vocabulary is the
# course's, so every rank computes exactly what one process computes.
_GPT2 = (("n_layer", 2), ("n_head", 4), ("n_embd", 64), ("vocab_size", VOCAB_SIZE),
         ("n_positions", 64), ("resid_pdrop", 0.0), ("embd_pdrop", 0.0),
         ("attn_pdrop", 0.0), ("bos_token_id", 0), ("eos_token_id", 0))
_LLAMA = (("num_hidden_layers", 2), ("hidden_size", 64), ("intermediate_size", 176),
          ("num_attention_heads", 4), ("num_key_value_heads", 2), ("vocab_size", VOCAB_SIZE),
          ("max_position_embeddings", 64), ("bos_token_id", 0), ("eos_token_id", 0),
          ("pad_token_id", 0))
# BERT for masked LM ties its decoder to the word embeddings, which `_no_split_modules`
# names as a layer (`BertEmbeddings`): the tie spans two would-be units. Trained here on
# the same next-byte targets as the others (it sees the whole row: a test model, not a
# language model).
_BERT = (("num_hidden_layers", 2), ("hidden_size", 64), ("intermediate_size", 128),
         ("num_attention_heads", 4), ("vocab_size", VOCAB_SIZE),
         ("max_position_embeddings", 64), ("hidden_dropout_prob", 0.0),
         ("attention_probs_dropout_prob", 0.0), ("pad_token_id", 0))
# A mixture-of-experts decoder: 4 experts, 2 per token; its router has 4 rows, which
# FSDP2's dim-0 split cannot share evenly among 3 ranks.
_MIXTRAL = (("num_hidden_layers", 2), ("hidden_size", 64), ("intermediate_size", 96),
            ("num_attention_heads", 4), ("num_key_value_heads", 2),
            ("num_local_experts", 4), ("num_experts_per_tok", 2), ("vocab_size", VOCAB_SIZE),
            ("max_position_embeddings", 64), ("bos_token_id", 0), ("eos_token_id", 0),
            ("pad_token_id", 0), ("tie_word_embeddings", True))
HF_MODELS = {
    "hf-gpt2": HFModel("gpt2", _GPT2),                       # tied embedding and head
    "hf-gpt2-frozen-emb": HFModel("gpt2", _GPT2, freeze_embeddings=True),
    "hf-llama": HFModel("llama", _LLAMA),                    # GQA: 4 query, 2 kv heads
    "hf-llama-frozen-emb": HFModel("llama", _LLAMA, freeze_embeddings=True),
    "hf-bert-mlm": HFModel("bert", _BERT),                   # decoder tied across layers
    "hf-mixtral": HFModel("mixtral", _MIXTRAL),              # 4 experts, tied head
}
# The models the course builds by name, small enough for a CPU.
MODEL_NAMES = tuple(GPT_CONFIGS) + TOY_NAMES + tuple(HF_MODELS)

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
LOSS_MEANS = ("tokens", "per-batch")


def is_config_path(name: str) -> bool:
    """Whether a model "name" is the path of a Hugging Face config.json or of its folder."""
    return name.endswith(".json") or os.sep in name or os.path.isdir(name)


def nearest(word: str, choices) -> str | None:
    """The choice closest to a misspelt `word` ("zero-3" -> "zero3"), or None."""
    choices = [str(c) for c in choices]
    lowered = {c.lower().replace("-", "").replace("_", ""): c for c in choices}
    squeezed = str(word).lower().replace("-", "").replace("_", "")
    if squeezed in lowered:
        return lowered[squeezed]
    found = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return found[0] if found else None


def did_you_mean(word: str, choices) -> str:
    """" (did you mean X?)" for a misspelt `word`, or "" when nothing is close."""
    close = nearest(word, choices)
    return f" (did you mean {close}?)" if close else ""
