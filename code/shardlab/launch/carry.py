"""How the function reaches the ranks: by reference where a rank can import it, by value
where it was written somewhere no rank can import (a notebook cell, an interactive session,
a script read from standard input, a lambda or a nested function).

A rank (forked from the fork server, or spawned) does not share the launching process's
memory. A function of an importable module travels as its module and name, as `pickle`
sends it. A function written in a notebook cell has no module a rank could import, so it
travels as its code, its closure and the globals it uses, pickled by cloudpickle (the
serializer of Ray, Dask and PySpark does exactly this for `__main__`). Each rank loads
the job after taking the launch's directory and `sys.path`, so a failure to load it is
reported like any other failure of the rank.

What cannot travel is an object that only makes sense in the process that made it: a lock,
an open file, a socket, a CUDA stream. For those the launch stops before starting any rank
with one line that names the object and says what to change.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import types
from typing import Any, Callable, Iterator

import cloudpickle

from shardlab.launch.errors import LaunchError


def pack(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """The job a rank runs, as bytes: `fn` (by value where no rank could import it), its
    arguments. Raises one `LaunchError` line naming what cannot be sent."""
    try:
        return cloudpickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is reported the same way
        raise LaunchError(_name_the_culprit(fn, args, kwargs, exc)) from None



def lookup_path() -> list[str]:
    """The `sys.path` a rank looks the job's modules up in: this process's, each entry
    made absolute (the "" of a notebook or `python -c` means the directory now), then the
    folder of every module this process imported from a folder no longer on it.

    A notebook that imports `graders` from its own folder and then changes directory
    still holds the module; a rank that imports it by name from the new directory would
    not find it. So a rank gets the folders where this process really found its modules,
    after its own path: they cannot shadow anything the path finds first."""
    path = [os.path.abspath(entry) for entry in sys.path]
    known = set(path)
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if "." in name or name == "__main__" or not isinstance(file, str):
            continue
        folder = os.path.dirname(os.path.abspath(file))
        if os.path.basename(file) == "__init__.py":
            folder = os.path.dirname(folder)  # a package: the folder that holds it
        if folder not in known:
            known.add(folder)
            path.append(folder)
    return path

def unpack(job: bytes) -> tuple[Callable, tuple, dict]:
    return pickle.loads(job)


def dumps_result(result: Any) -> bytes:
    """A rank's result: by value too, so that an object of a class written in a notebook
    cell comes back (the launching process then rebuilds it)."""
    return cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)


def check_carriable(fn: Callable) -> None:
    """Refuse, before any rank starts, a function that cannot be sent to one."""
    pack(fn, (), {})


@contextlib.contextmanager
def main_not_reimported() -> Iterator[None]:
    """Start spawned ranks without re-running a `__main__` that has no file to re-run.

    A spawned or fork-server child re-imports the launching script, by the path in
    `__main__.__file__`. A script read from standard input has `__file__ == "<stdin>"`,
    which no child can open: every rank would die before running anything. Its functions
    travel by value, so the children need nothing from it; hiding the name while the
    ranks start tells multiprocessing so."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _name_the_culprit(fn: Callable, args: tuple, kwargs: dict, exc: Exception) -> str:
    fn_name = getattr(fn, "__qualname__", type(fn).__name__)
    suspects: list[tuple[str, Any, str]] = []
    for i, value in enumerate(args):
        suspects.append((f"argument {i + 1}", value, "argument"))
    for key, value in kwargs.items():
        suspects.append((f"argument {key}=", value, "argument"))
    suspects.extend(_captured_by(fn, fn_name, depth=3))
    for where, value, kind in suspects:
        if _picklable(value):
            continue
        what = f"a {type(value).__module__}.{type(value).__qualname__}"
        if kind == "argument":
            return (f"launch cannot send {where} of {fn_name!r} ({what}) to the ranks, which "
                    f"are separate processes: pass what it is made from and build it inside "
                    f"the function, on each rank.")
        return (f"launch cannot send {where} ({what}) to the ranks, which are separate "
                f"processes: create it inside the function, on each rank, instead of "
                f"capturing it from the notebook or script.")
    return (f"launch cannot send {fn_name!r} or its arguments to the ranks: {exc}. Create "
            f"what it uses inside the function, on each rank.")


def _captured_by(fn: Any, fn_name: str, depth: int) -> list[tuple[str, Any, str]]:
    """The objects a function takes with it: its closure, the globals its code names (in
    nested functions' code too), its defaults; through partials and bound methods."""
    found: list[tuple[str, Any, str]] = []
    if isinstance(fn, types.MethodType):
        found.append((f"the object {fn_name!r} is bound to", fn.__self__, "captured"))
        fn = fn.__func__
    if hasattr(fn, "func") and hasattr(fn, "args"):  # functools.partial
        found += [(f"argument {i + 1} of the partial", v, "argument")
                  for i, v in enumerate(fn.args)]
        found += [(f"argument {k}= of the partial", v, "argument")
                  for k, v in fn.keywords.items()]
        return found + _captured_by(fn.func, fn_name, depth)
    if not isinstance(fn, types.FunctionType) or depth == 0:
        return found
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):  # an empty cell
            found.append((f"{name!r}, which {fn_name!r} captures", cell.cell_contents,
                          "captured"))
    for name in sorted(_global_names(code)):
        if name in fn.__globals__:
            value = fn.__globals__[name]
            if isinstance(value, types.ModuleType):
                continue
            if isinstance(value, types.FunctionType):
                # a helper travels with what it captures: name that, not the helper
                if value is not fn:
                    found += _captured_by(value, value.__qualname__, depth - 1)
                continue
            found.append((f"the global {name!r}, which {fn_name!r} uses", value, "captured"))
    for i, value in enumerate(fn.__defaults__ or ()):
        found.append((f"default {i + 1} of {fn_name!r}", value, "captured"))
    return found


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _picklable(value: Any) -> bool:
    try:
        cloudpickle.dumps(value)
        return True
    except Exception:  # noqa: BLE001
        return False
