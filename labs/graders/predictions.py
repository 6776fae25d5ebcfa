"""The check under a prediction: what you wrote beside what the run measured, one line each.

In a lab, a "Predict" prompt names the variables; you fill them in the cell below it (they
start as `None`); after the run, a check cell calls

    from graders.predictions import check
    check(prediction_rank_2, measured_rank_2)     # two dicts: yours, and the run's

which prints, for each name, `✓ all_reduce: [10, 20, 30, 40]` or
`✗ all_reduce: yours None, the run measured [10, 20, 30, 40]`, a line per key when the
measurement is a dict (`✓ zero2 grads: 80,384`). Integers (bytes, counts) must be exact;
floats agree within `rel` of the measurement; words ignore case and spaces at the ends;
lists and tuples agree element by element.
"""

from __future__ import annotations

from typing import Any


def agrees(yours: Any, measured: Any, rel: float = 0.0) -> bool:
    """Whether your prediction agrees with the measurement (see the module's docstring)."""
    if yours is None:
        return False
    if isinstance(measured, bool) or isinstance(yours, bool):
        return isinstance(yours, bool) and isinstance(measured, bool) and yours == measured
    if isinstance(measured, (int, float)) and isinstance(yours, (int, float)):
        return abs(yours - measured) <= rel * abs(measured)
    if isinstance(measured, str) and isinstance(yours, str):
        return yours.strip().lower() == measured.strip().lower()
    if isinstance(measured, dict) and isinstance(yours, dict):
        return yours.keys() == measured.keys() and all(
            agrees(yours[k], measured[k], rel) for k in measured)
    if isinstance(measured, (list, tuple)) and isinstance(yours, (list, tuple)):
        return len(yours) == len(measured) and all(
            agrees(a, b, rel) for a, b in zip(yours, measured))
    return yours == measured


def shown(value: Any) -> str:
    """A value as the lab prints it: integers grouped by thousands, floats to 4 significant
    digits (a stored output must not depend on the last bits of a float)."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{shown(k)}: {shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(shown(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return str(value)


def check(yours: dict[str, Any], measured: dict[str, Any], rel: float = 0.0,
          source: str = "the run measured") -> None:
    """Print one line per name in `measured`: ✓ and the value, or ✗, yours, and `source`'s.
    A name whose measurement is a dict (a strategy's bytes by category) gets a line per key."""
    for name, truth in measured.items():
        mine = yours.get(name) if isinstance(yours, dict) else None
        if isinstance(truth, dict):
            check({f"{name} {k}": mine.get(k) if isinstance(mine, dict) else None
                   for k in truth}, {f"{name} {k}": v for k, v in truth.items()}, rel, source)
        elif agrees(mine, truth, rel):
            print(f"✓ {name}: {shown(truth)}")
        else:
            print(f"✗ {name}: yours {shown(mine)}, {source} {shown(truth)}")
