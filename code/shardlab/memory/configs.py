"""Model configurations: the shapes of published transformers, enough to count Ψ.

GPT-2 (and GPT-3 175B) and Llama 2/3 as their config.json files give them, and Mixtral's
mixture of experts. A module of its own because it is data the formulas are applied to,
not a formula: the activations and the planner read a `ModelConfig`, the stage formulas
only its Ψ.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from shardlab.vocabulary import (GPT_CONFIGS, HF_MODELS, MODEL_NAMES, TOY_NAMES,
                                 did_you_mean, is_config_path)


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer, enough to count its parameters and the
    activations a layer keeps.

    style "gpt2": learned positions, LayerNorm (weight and bias), biases everywhere,
    a GELU MLP of two matrices, dropout after attention and after the MLP (GPT-2 and
    GPT-3 train with it). style "llama": rotary positions (no parameters), RMSNorm
    (weight only), no biases, a SwiGLU MLP of three matrices, grouped-query attention, no
    dropout. `experts` > 1 makes every MLP a mixture of that many SwiGLU experts, each
    token sent to `top_k` of them by a linear router (Mixtral's layer).
    """

    name: str
    style: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    positions: int = 0  # learned position embeddings (GPT-2 only)
    experts: int = 1  # MLP experts per layer (1: a dense MLP)
    top_k: int = 1  # experts each token is routed to
    # The longest sequence it was trained on (max_position_embeddings; GPT-2's is its
    # `positions`): the planner's sequence length unless it is given one.
    context: int = 0
    # Dropout after attention and after the MLP (it keeps masks for backward). None: the
    # style's (GPT-2 and GPT-3 train with it, Llama without).
    dropout: bool | None = None

    def __post_init__(self):
        if self.dropout is None:
            object.__setattr__(self, "dropout", self.style == "gpt2")

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @property
    def mlp(self) -> str:
        return "gelu" if self.style == "gpt2" else "swiglu"

    @property
    def longest_sequence(self) -> int | None:
        return self.context or self.positions or None

    def expert_params(self) -> int:
        """Parameters of one MLP expert (of the dense MLP when experts == 1)."""
        h, f = self.hidden, self.ffn
        return h * f + f + f * h + h if self.mlp == "gelu" else 3 * h * f

    def layer_params(self) -> int:
        h, kv = self.hidden, self.kv_dim
        router = h * self.experts if self.experts > 1 else 0
        mlp = self.experts * self.expert_params() + router
        if self.style == "gpt2":
            attention = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h  # qkv and output
            norms = 2 * 2 * h
        else:
            attention = h * (h + 2 * kv) + h * h
            norms = 2 * h
        return attention + mlp + norms

    def root_params(self) -> int:
        """Everything outside the layers: embeddings, final norm, untied head (the root
        unit of ZeRO-3 / FSDP when each layer is a unit of its own)."""
        return self.num_params() - self.layers * self.layer_params()

    def num_params(self) -> int:
        h = self.hidden
        embedding = self.vocab * h + self.positions * h
        head = 0 if self.tied else self.vocab * h
        final_norm = 2 * h if self.style == "gpt2" else h
        return embedding + self.layers * self.layer_params() + final_norm + head


    def parameter_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter's shape, as Hugging Face lays the model out (GPT-2's Conv1D
        holds (in, out); a mixture holds its experts fused, (experts, rows, cols)): what a
        dim-0 split cuts (`shardlab.memory.dim0`). Their elements add up to Ψ."""
        h, kv, f, E = self.hidden, self.kv_dim, self.ffn, self.experts
        shapes: list[tuple[int, ...]] = [(self.vocab, h)]
        if self.positions:
            shapes.append((self.positions, h))
        for _ in range(self.layers):
            if self.style == "gpt2":
                shapes += [(h, h + 2 * kv), (h + 2 * kv,), (h, h), (h,),
                           (h, f), (f,), (f, h), (h,), (h,), (h,), (h,), (h,)]
                continue
            shapes += [(h, h), (kv, h), (kv, h), (h, h), (h,), (h,)]
            if E > 1:  # the router, then the experts' matrices fused
                shapes += [(E, h), (E, 2 * f, h), (E, h, f)]
            else:
                shapes += [(f, h), (f, h), (h, f)]
        shapes += [(h,), (h,)] if self.style == "gpt2" else [(h,)]
        if not self.tied:
            shapes.append((self.vocab, h))
        return shapes


def _gpt2(name, layers, hidden, heads):
    return ModelConfig(name, "gpt2", layers, hidden, heads, heads, 4 * hidden, 50257,
                       tied=True, positions=1024)


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, context, experts=1, top_k=1):
    return ModelConfig(name, "llama", layers, hidden, heads, kv_heads, ffn, vocab, tied=False,
                       experts=experts, top_k=top_k, context=context)


# Configurations as published with the models (Hugging Face config.json files).
MODELS: dict[str, ModelConfig] = {c.name: c for c in [
    _gpt2("gpt2-small", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    # GPT-3 175B (Brown et al., 2020, table 2.1): the layer Korthikanti et al. count
    ModelConfig("gpt3-175b", "gpt2", 96, 12288, 96, 96, 4 * 12288, 50257, tied=True,
                positions=2048),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000, 4096),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000, 4096),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000, 4096),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 8192),
    _llama("llama-3-70b", 80, 8192, 64, 8, 28672, 128256, 8192),
    _llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, 32000, 32768, experts=8, top_k=2),
]}


def model_names() -> tuple[str, ...]:
    """Every model name `python -m shardlab memory` and `train` accept: the course's
    (`shardlab.vocabulary.MODEL_NAMES`), then the published sizes. (A Hugging Face
    config.json, by its path, is accepted too.)"""
    return MODEL_NAMES + tuple(MODELS)


def get_model(name: str, overrides: dict | None = None) -> ModelConfig:
    """The ModelConfig of a model name: a published size, or a model the course builds
    (the course's GPT and the hf-* architectures, with `overrides` of their settings as
    `--model-config` gives them). The toys are no transformers: refused."""
    if name in MODELS and not overrides:
        return MODELS[name]
    if name in GPT_CONFIGS:
        fields = {f.name for f in dataclasses.fields(GPT_CONFIGS[name])}
        unknown = sorted(set(overrides or {}) - fields)
        if unknown:
            raise ValueError(f"unknown GPT config field(s) {unknown}; use {sorted(fields)}")
        cfg = dataclasses.replace(GPT_CONFIGS[name], **(overrides or {}))
        # the course's GPT is GPT-2's layer without dropout, its head tied
        return ModelConfig(name, "gpt2", cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_head,
                           4 * cfg.d_model, cfg.vocab_size, tied=True,
                           positions=cfg.block_size, dropout=False)
    if name in HF_MODELS:
        spec = HF_MODELS[name]
        return from_hf_config({"model_type": spec.family, **dict(spec.config),
                               **(overrides or {})}, name)
    if name in MODELS:
        settings = {**to_hf_config(MODELS[name]), **overrides}
        return from_hf_config(settings, name)
    if name in TOY_NAMES:
        raise ValueError(f"{name!r} is a toy of a few layers, not a transformer the planner "
                         f"counts; plan gpt-tiny, an hf-* model or a published size")
    raise ValueError(f"unknown model {name!r}{did_you_mean(name, model_names())}; use one "
                     f"of {', '.join(model_names())}, or the path of a config.json")


def num_params(model: str | ModelConfig) -> int:
    """Ψ of a model preset, counted from its architecture."""
    return (get_model(model) if isinstance(model, str) else model).num_params()


def read_config_json(path) -> dict:
    """The dict of a config.json (a file, or the folder holding it), refused in one line
    when there is no such file or it is not a JSON object."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no config.json at {str(file)!r}: give a Hugging Face model "
                         f"folder or its config.json")
    try:
        settings = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(file)!r} is not a JSON file ({exc}); give a Hugging Face "
                         f"model's config.json") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(settings).__name__}, not a "
                         f"model config (an object with a model_type)")
    return settings


# model_type -> the style of ModelConfig that counts its parameters
HF_STYLES = {"gpt2": "gpt2", "llama": "llama", "mistral": "llama", "mixtral": "llama"}


def from_hf_config(settings: dict, name: str = "config.json") -> ModelConfig:
    """The ModelConfig of a Hugging Face config (its config.json's dict): GPT-2, and the
    Llama family (Llama, Mistral, Mixtral's experts)."""
    kind = settings.get("model_type")
    if kind not in HF_STYLES:
        raise ValueError(f"{name} is not a model config the planner counts (model_type "
                         f"{kind!r}); it needs a model_type among {sorted(HF_STYLES)}")
    try:
        if kind == "gpt2":
            hidden = settings["n_embd"]
            # GPT2Config's dropouts are 0.1 unless the config says otherwise
            dropout = any(settings.get(k, 0.1) for k in ("resid_pdrop", "attn_pdrop"))
            return ModelConfig(name, "gpt2", settings["n_layer"], hidden, settings["n_head"],
                               settings["n_head"], settings.get("n_inner") or 4 * hidden,
                               settings["vocab_size"],
                               tied=settings.get("tie_word_embeddings", True),
                               positions=settings["n_positions"], dropout=bool(dropout))
        heads = settings["num_attention_heads"]
        return ModelConfig(name, "llama", settings["num_hidden_layers"],
                           settings["hidden_size"], heads,
                           settings.get("num_key_value_heads") or heads,
                           settings["intermediate_size"], settings["vocab_size"],
                           tied=bool(settings.get("tie_word_embeddings", False)),
                           experts=settings.get("num_local_experts", 1),
                           top_k=settings.get("num_experts_per_tok", 1),
                           context=settings.get("max_position_embeddings") or 0)
    except KeyError as exc:
        raise ValueError(f"{name} ({kind}) has no {exc.args[0]!r}: not a complete model "
                         f"config") from None


def to_hf_config(cfg: ModelConfig) -> dict:
    """The Hugging Face config of a ModelConfig's shape (`from_hf_config`'s inverse, its
    `model_type` included): what the trainer builds for a published size. The vocabulary
    is the model's own; the training data's bytes are tokens 0-255 of it."""
    if cfg.style == "gpt2":
        drop = 0.1 if cfg.dropout else 0.0
        return {"model_type": "gpt2", "n_layer": cfg.layers, "n_embd": cfg.hidden,
                "n_head": cfg.heads, "n_inner": cfg.ffn, "vocab_size": cfg.vocab,
                "n_positions": cfg.positions, "tie_word_embeddings": cfg.tied,
                "resid_pdrop": drop, "embd_pdrop": drop, "attn_pdrop": drop}
    settings = {"model_type": "mixtral" if cfg.experts > 1 else "llama",
                "num_hidden_layers": cfg.layers, "hidden_size": cfg.hidden,
                "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.kv_heads,
                "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab,
                "tie_word_embeddings": cfg.tied}
    if cfg.context:
        settings["max_position_embeddings"] = cfg.context
    if cfg.experts > 1:
        settings.update(num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k)
    return settings


def as_config(model, overrides: dict | None = None) -> ModelConfig:
    """A ModelConfig from what a reader has: a model's name (a published size, or one the
    course trains: `model_names()`), a ModelConfig, the path of a Hugging Face config.json
    (or its folder), its dict, a `transformers` config, or a model that carries one
    (`model.config`, as every `transformers` model does). `overrides`: settings that
    change a named or read config (`--model-config`)."""
    if isinstance(model, ModelConfig):
        return model
    if isinstance(model, str) and model in model_names():
        return get_model(model, overrides)
    if isinstance(model, (str, os.PathLike)):
        if isinstance(model, str) and not is_config_path(model):
            return get_model(model)  # an unknown name: refused by its name
        return from_hf_config({**read_config_json(model), **(overrides or {})},
                              Path(model).name)
    if isinstance(model, dict):
        return from_hf_config({**model, **(overrides or {})})
    config = getattr(model, "config", model)
    if hasattr(config, "to_dict"):
        return from_hf_config(config.to_dict(), type(config).__name__)
    raise ValueError(f"cannot plan a {type(model).__name__}: give a preset name, a "
                     f"ModelConfig, a Hugging Face config.json (path, dict or object) or a "
                     f"model with a .config")
