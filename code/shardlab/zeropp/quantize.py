"""Block quantization: a tensor as small integers, one fp32 scale per block of them.

ZeRO++ sends weights in int8 (qwZ) and gradients in int4 (qgZ) (arXiv:2306.10209).
One scale for a whole tensor lets its largest element set the step for all of them, and
the small ones round to zero; one scale per block of B elements keeps each block's own
range (the paper's Figure 4, DeepSpeed's `CUDAQuantizer` in
`deepspeed/runtime/zero/partition_parameters.py`, which aims at 4k to 8k elements a block).
Symmetric, as DeepSpeed's: with q_max = 2**(bits-1) - 1 (127 for int8, 7 for int4),

    scale = max|x| over the block / q_max          q = round(x / scale) in [-q_max, q_max]
    x' = q * scale                                 |x - x'| <= scale / 2

What travels is one flat `uint8` payload, the values (int8 as they are, int4 two to a
byte) followed by the scales' bytes, so a collective moves it as it moves any tensor and
the ledger counts exactly the bytes that cross: `payload_bytes(n, bits, block)` of them.
`quantize` and `dequantize` take rows: each row of a [rows, n] tensor is one payload,
quantized on its own (an all-to-all sends one row to each rank).
"""

from __future__ import annotations

import math

import torch

SCALE_BYTES = 4  # one fp32 scale per block
BITS = (8, 4)


def check_block(name: str, block) -> int:
    """A block size must be a whole number >= 2 (an int4 block is whole bytes if even)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise ValueError(f"{name} must be an even whole number of elements >= 2 (one fp32 "
                         f"scale per block: 2048 costs 0.2% of int8 bytes), got {block!r}")
    return block


def payload_bytes(n: int, bits: int, block: int) -> int:
    """Bytes of the payload of `n` elements: the values, then a scale per block."""
    return math.ceil(n * bits / 8) + SCALE_BYTES * math.ceil(n / block)


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """[rows, n] (or [n]) floats -> [rows, payload_bytes(n)] (or [payload_bytes]) uint8."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {list(BITS)}, got {bits!r}")
    rows = x.reshape(-1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, -1)
    count, n = rows.shape
    blocks = math.ceil(n / block)
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=x.device)
    padded[:, :n] = rows
    padded = padded.view(count, blocks, block)
    q_max = 2 ** (bits - 1) - 1
    scale = padded.abs().amax(dim=2) / q_max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block
    q = torch.round(padded / scale[:, :, None]).clamp_(-q_max, q_max).to(torch.int8)
    q = q.view(count, -1)[:, :n]
    if bits == 8:
        values = q.view(torch.uint8)
    else:  # two 4-bit values a byte, each stored as q + 8 in [1, 15]
        nibbles = (q + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, torch.full((count, 1), 8, dtype=torch.uint8,
                                                     device=x.device)], dim=1)
        values = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    payload = torch.cat([values, scale.contiguous().view(torch.uint8).view(count, -1)], dim=1)
    return payload if x.dim() > 1 else payload[0]


def dequantize(payload: torch.Tensor, n: int, bits: int, block: int) -> torch.Tensor:
    """`quantize`'s inverse, up to rounding: [rows, bytes] uint8 -> [rows, n] fp32."""
    rows = payload.reshape(-1, payload.shape[-1]) if payload.dim() > 1 else payload.view(1, -1)
    count = rows.shape[0]
    blocks = math.ceil(n / block)
    value_bytes = math.ceil(n * bits / 8)
    if rows.shape[1] != value_bytes + SCALE_BYTES * blocks:
        raise ValueError(f"a payload of {n} elements in int{bits}, blocks of {block}, has "
                         f"{value_bytes + SCALE_BYTES * blocks} bytes, not {rows.shape[1]}")
    values = rows[:, :value_bytes]
    # copied to a storage of its own: viewing bytes as fp32 needs 4-byte alignment
    scale = rows[:, value_bytes:].flatten().clone().view(torch.float32).view(count, blocks)
    if bits == 8:
        q = values.contiguous().view(torch.int8)
    else:
        low = (values & 0x0F).to(torch.int8) - 8
        high = (values >> 4).to(torch.int8) - 8
        q = torch.stack([low, high], dim=2).view(count, -1)[:, :n]
    q = q.float()
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=payload.device)
    padded[:, :n] = q
    out = (padded.view(count, blocks, block) * scale[:, :, None]).view(count, -1)[:, :n]
    return out if payload.dim() > 1 else out[0]


def round_trip_error(x: torch.Tensor, bits: int, block: int) -> float:
    """The relative error ||x - x'|| / ||x|| of one quantization of `x`, flattened."""
    x = x.detach().reshape(-1).float()
    back = dequantize(quantize(x, bits, block), x.numel(), bits, block)
    norm = x.norm().item()
    return (x - back).norm().item() / norm if norm else 0.0
