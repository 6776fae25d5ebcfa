"""Activations: the bytes a layer keeps from forward to backward, term by term.

What the stage formulas leave out, and what no ZeRO stage shards. Activations are counted
per architecture, not with one coefficient: GPT-3's layer (GELU MLP, dropout, attention
scores stored) keeps s·b·h·(34 + 5·a·s/h) bytes (Korthikanti et al., 2022); a Llama layer
(SwiGLU MLP, no dropout, grouped-query attention) keeps other terms, and an attention
kernel of the FlashAttention kind (PyTorch's SDPA) keeps no s×s scores at all.
`layer_activations` names every term; `activations` applies a recomputation policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.memory.configs import ModelConfig, as_config
from shardlab.memory.states import check_choice, check_positive


CHECKPOINTING = ("none", "selective", "full")
# "sdpa": a fused kernel (FlashAttention, torch's scaled_dot_product_attention) that keeps
# its inputs, its output and one log-sum-exp per row, never the s x s scores: today's
# baseline. "eager": the scores are materialized and kept, as in GPT-3's count.
ATTENTION = ("sdpa", "eager")


def layer_activations(model: str | ModelConfig, batch: int, seq: int,
                      attention: str = "sdpa") -> dict[str, int]:
    """Bytes one transformer layer keeps for its backward, term by term.

    Activations are 16-bit (2 bytes), dropout masks 1 byte (CUDA's; a CPU keeps them in
    the activation's dtype). s = seq, b = batch (micro-batch per rank), h = hidden,
    f = ffn, a = heads, kv = key/value width (h for multi-head attention, less with GQA):

    norms      each norm keeps its input                         2 x 2sbh
    attention  input of the q/k/v projections 2sbh, q 2sbh, k and v 2·2sb·kv,
               output (the input of the output projection) 2sbh; a fused kernel
               ("sdpa") also keeps a fp32 log-sum-exp per head and row, 4asb
    scores     "eager" only: the softmax output 2as²b, and with dropout its mask as²b
               and its output 2as²b (Korthikanti's 5as²b)
    mlp        GELU: input 2sbh, GELU input 2sbf, GELU output 2sbf;
               SwiGLU: input 2sbh, gate 2sbf, up 2sbf, silu(gate) 2sbf, product 2sbf;
               a mixture of experts: the router's input 2sbh and, for each of the top_k
               experts a token visits, its copy of the token 2sbh and 8sbf
    dropout    a mask after attention and one after the MLP, sbh each (GPT only)

    For GPT-3's layer (f = 4h, kv = h, dropout, "eager") the terms add up to
    sbh(34 + 5as/h), Korthikanti et al.'s count.
    """
    cfg = as_config(model)
    b = check_positive("batch", batch, integer=True)
    s = check_positive("seq", seq, integer=True)
    check_choice("attention", attention, ATTENTION)
    h, f, a, kv = cfg.hidden, cfg.ffn, cfg.heads, cfg.kv_dim
    sbh, sbf = s * b * h, s * b * f
    attn = 2 * sbh + 2 * sbh + 2 * 2 * s * b * kv + 2 * sbh
    if attention == "sdpa":
        attn += 4 * a * s * b
    scores = 0
    if attention == "eager":
        scores = 2 * a * s * s * b + (3 * a * s * s * b if cfg.dropout else 0)
    if cfg.experts > 1:
        mlp = 2 * sbh + cfg.top_k * (2 * sbh + 8 * sbf)
    elif cfg.mlp == "gelu":
        mlp = 2 * sbh + 2 * sbf + 2 * sbf
    else:
        mlp = 2 * sbh + 8 * sbf
    return {"norms": 2 * 2 * sbh, "attention": attn, "scores": scores, "mlp": mlp,
            "dropout": 2 * sbh if cfg.dropout else 0}


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one step on one rank, in three parts.

    layers     what the L layers keep from forward to backward
    recompute  what recomputation rebuilds during backward, one layer at a time (full:
               one whole layer; selective: one layer's attention scores)
    output     the final norm's and the head's inputs (2sbh each) and the fp32
               log-probabilities that cross-entropy keeps (4sbV: the loss upcasts the
               logits)
    """

    layers: int
    recompute: int
    output: int

    @property
    def total(self) -> int:
        return self.layers + self.recompute + self.output


def activations(model: str | ModelConfig, batch: int, seq: int, checkpointing: str = "none",
                attention: str = "sdpa") -> Activations:
    """The activations of a step: every layer's (`layer_activations`), under a
    recomputation policy, plus the output layer's.

    "none" keeps everything. "selective" recomputes the attention core (drops the
    scores; with "sdpa" there are none to drop, so it equals "none": a fused kernel *is*
    selective recomputation). "full" keeps each layer's 2sbh input and rebuilds one
    layer's activations during its backward. Embeddings keep only their token ids
    (GPT's dropout after the embeddings, one sbh mask, is left out).
    """
    cfg = as_config(model)
    check_choice("checkpointing", checkpointing, CHECKPOINTING)
    per_layer = layer_activations(cfg, batch, seq, attention)
    one_layer = sum(per_layer.values())
    sbh = seq * batch * cfg.hidden
    output = 2 * sbh + 2 * sbh + 4 * seq * batch * cfg.vocab
    if checkpointing == "none":
        return Activations(cfg.layers * one_layer, 0, output)
    if checkpointing == "selective":
        scores = per_layer["scores"]
        return Activations(cfg.layers * (one_layer - scores), scores, output)
    return Activations(cfg.layers * 2 * sbh, one_layer, output)


def activation_bytes(model: str | ModelConfig, batch: int, seq: int,
                     checkpointing: str = "none", attention: str = "sdpa") -> int:
    """Total activation bytes of a step on one rank: `activations(...).total`."""
    return activations(model, batch, seq, checkpointing, attention).total
