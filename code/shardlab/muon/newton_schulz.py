"""Newton-Schulz orthogonalization, the one step of Muon that needs a whole matrix.

Muon (Keller Jordan, 2024; `torch.optim.Muon`, torch/optim/_muon.py) replaces a 2-D
gradient's momentum G by an approximation of U Vᵀ, where G = U S Vᵀ is its SVD: five
iterations of a quintic polynomial, X ← a X + (b A + c A²) X with A = X Xᵀ, run in
bf16 on X = G / ‖G‖. Every iteration multiplies whole rows by whole columns, so no
element of the result can be computed from a slice of G: a rank holding rows of a matrix
(FSDP2) or a stretch of its flattened elements (ZeRO) cannot step it alone.

`newton_schulz` is PyTorch's `_zeropower_via_newtonschulz` written out (the same
operations in the same order: tests/test_muon.py checks the bits), so that the course
can count its calls and time them: `watching()` records every call made in this process.
`adjusted_lr` is PyTorch's `_adjust_lr`, and `newton_schulz_flops` the multiply-adds of
one call.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

# Keller Jordan's coefficients and step count, torch's defaults (torch/optim/_muon.py).
COEFFICIENTS = (3.4445, -4.7750, 2.0315)
STEPS = 5
EPS = 1e-7


@dataclass
class MuonWatch:
    """What Muon did on this rank inside `watching()`: every Newton-Schulz call (the
    shape of the matrix and its seconds), the bytes of gathered matrices held at the
    most at once, and the process groups Muon's exchanges ran on (their ledger records
    carry these names)."""

    calls: list[tuple[int, int]] = field(default_factory=list)
    seconds: float = 0.0
    held: int = 0
    held_peak: int = 0
    groups: set[str] = field(default_factory=set)

    @property
    def flops(self) -> int:
        return sum(newton_schulz_flops(shape) for shape in self.calls)

    def take(self, t: torch.Tensor) -> None:
        """A buffer of gathered matrices now held (`shardlab.memory.whole_matrix`
        predicts them), counted by its storage: a view of it is released as all of it."""
        self.held += t.untyped_storage().nbytes()
        self.held_peak = max(self.held_peak, self.held)

    def release(self, t: torch.Tensor) -> None:
        self.held -= t.untyped_storage().nbytes()


_WATCH: MuonWatch | None = None
_NOBODY = MuonWatch()  # where a design reports when nobody watches


@contextlib.contextmanager
def watching():
    """Record what Muon does in this process inside the block."""
    global _WATCH
    outer, _WATCH = _WATCH, MuonWatch()
    try:
        yield _WATCH
    finally:
        _WATCH = outer


def watch() -> MuonWatch:
    """The open watch, or one that nobody reads."""
    return _WATCH if _WATCH is not None else _NOBODY


def newton_schulz(matrix: torch.Tensor, steps: int = STEPS,
                  coefficients: tuple[float, float, float] = COEFFICIENTS,
                  eps: float = EPS) -> torch.Tensor:
    """The orthogonalized `matrix` (2-D), in bf16: `steps` quintic iterations on the
    matrix scaled to norm 1, with the wide orientation (rows <= columns) so that the Gram
    matrix X Xᵀ is the smaller one."""
    if matrix.dim() != 2:
        raise ValueError(f"Newton-Schulz orthogonalizes a 2-D matrix, got shape "
                         f"{tuple(matrix.shape)}")
    started = time.perf_counter()
    a, b, c = coefficients
    x = matrix.to(torch.bfloat16, copy=True)  # a bf16 input (gathered) is left as it is
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    if tall:
        x = x.T
    seen = watch()
    seen.calls.append(tuple(matrix.shape))
    seen.seconds += time.perf_counter() - started
    return x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's learning rate for a matrix of `shape`, as torch's `_adjust_lr`: "original"
    (None) scales by sqrt(max(1, rows/cols)), "match_rms_adamw" (Moonshot's) by
    0.2 sqrt(max(rows, cols)), so that the update's RMS matches AdamW's and AdamW's
    learning rate can be reused."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio  # the ratio first, as torch: the same last bit


def newton_schulz_flops(shape: tuple[int, int], steps: int = STEPS) -> int:
    """Floating-point operations of one call on a matrix of `shape`: with m <= n its two
    sides, each iteration forms A = X Xᵀ (2m²n), b A + c A² (2m³) and that times X
    (2m²n)."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m ** 3)
