"""A Hugging Face model folder: `config.json` beside `model.safetensors`, read and written.

The folder `save_pretrained` writes and `from_pretrained` reads. Read here straight into
the shards: safetensors stores each tensor row-major at a known offset, so
`safe_open(...).get_slice(name)[a:b]` reads rows a..b of one tensor and nothing else, and
each rank reads only the rows that cover its pieces (`shardlab.strategy.Piece`, a range
of the flattened parameter), whatever the strategy. No rank ever holds the whole file.

Everything a load or an export can refuse is checked on the file's header and the
model's names and shapes, before any weight is read or any file is written: a folder of
another model, a config.json that is not a model's, a folder that already holds weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from shardlab.memory.configs import read_config_json
from shardlab.models import HF_MODELS
from shardlab.strategy import Piece

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# files that mean "a model is already here": an export never writes over them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
SHOWN = 3  # mismatches named in an error; the count says how many more


def _safetensors():
    try:
        import safetensors.torch  # noqa: F401 - installed with transformers
        from safetensors import safe_open
    except ImportError:
        raise ValueError("reading and writing Hugging Face folders needs safetensors: "
                         "pip install safetensors") from None
    return safe_open


def read_model_config(path: str | os.PathLike) -> dict:
    """The dict of a Hugging Face model's config.json (a file, or the folder holding it),
    refused in one line when it is not one: no such file, not JSON, or no `model_type`
    of a family the course builds."""
    settings = read_config_json(path)
    families = sorted({spec.family for spec in HF_MODELS.values()})
    if settings.get("model_type") not in families:
        raise ValueError(f"{str(path)!r} is not a model config the course builds "
                         f"(model_type {settings.get('model_type')!r}); it needs a "
                         f"model_type among {families}")
    return settings


def header_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in the folder's model.safetensors, from its header
    (no weight is read)."""
    file = Path(folder) / WEIGHTS
    if not file.is_file():
        raise ValueError(f"no {WEIGHTS} in {str(folder)!r}: a Hugging Face folder holds "
                         f"{CONFIG} and {WEIGHTS} (save_pretrained writes both)")
    try:
        with _safetensors()(str(file), framework="pt") as f:
            return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{str(file)!r} is not a safetensors file "
                         f"({type(exc).__name__}: {exc})") from None


def expected_names(module: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """What a model's file must hold: {name: shape} of every parameter and persistent
    buffer, and {alias: name} of the other names of tied parameters, which
    `save_pretrained` writes once (under either name)."""
    shapes, aliases = {}, {}
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
            continue
        first[id(p)] = name
        shapes[name] = tuple(p.shape)
    persistent = set(module.state_dict(keep_vars=True))
    for name, b in module.named_buffers():
        if name in persistent:
            shapes[name] = tuple(b.shape)
    return shapes, aliases


def mismatches(module: nn.Module, saved: dict[str, tuple[int, ...]]) -> list[str]:
    """What differs between a model and a file's header, one phrase per tensor: missing
    from the file, of another shape, or in the file but not in the model."""
    shapes, aliases = expected_names(module)
    names_of = {name: [name] + [a for a, n in aliases.items() if n == name] for name in shapes}
    found = []
    for name, shape in shapes.items():
        in_file = next((n for n in names_of[name] if n in saved), None)
        if in_file is None:
            found.append(f"{name!r} missing from the file")
        elif saved[in_file] != shape:
            found.append(f"{name!r} is {list(saved[in_file])} in the file, {list(shape)} in "
                         f"the model")
    known = set(shapes) | set(aliases)
    found += [f"{name!r} in the file, not in the model" for name in saved if name not in known]
    return found


def check_matches(folder: str | os.PathLike, module: nn.Module) -> None:
    """Refuse, naming the first few, a file whose tensors are not the model's."""
    found = mismatches(module, header_shapes(folder))
    if found:
        more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise ValueError(f"{str(folder)!r} does not hold this model's weights: "
                         f"{'; '.join(found[:SHOWN])}{more}; build the model with the "
                         f"config it was saved from")


def _rows_of(tensor_slice, shape: tuple[int, ...], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor, reading only the rows that hold
    them (safetensors slices along dim 0 without reading the rest)."""
    if len(shape) == 0:
        return tensor_slice[...].reshape(-1)[start:stop]
    cols = max(1, int(torch.Size(shape[1:]).numel()))
    first, last = start // cols, -(-stop // cols)
    rows = tensor_slice[first:last].reshape(-1)
    return rows[start - first * cols:stop - first * cols]


def load_pieces(folder: str | os.PathLike, pieces: list[Piece], module: nn.Module) -> None:
    """Copy, on this rank, its range of every parameter (each piece) and every persistent
    buffer from the folder's model.safetensors. Call `check_matches` first."""
    safe_open = _safetensors()
    persistent = set(module.state_dict(keep_vars=True))
    with safe_open(str(Path(folder) / WEIGHTS), framework="pt") as f, torch.no_grad():
        names = set(f.keys())
        for piece in pieces:
            name = next(n for n in (piece.name, *piece.aliases) if n in names)
            if piece.stop <= piece.start:
                continue  # this rank holds none of it (a short last chunk)
            values = _rows_of(f.get_slice(name), tuple(piece.shape), piece.start, piece.stop)
            for target in (piece.master, piece.values):
                if target is not None:
                    target.copy_(values[:target.numel()])
        for name, buffer in module.named_buffers():
            if name in persistent and name in names:
                buffer.copy_(f.get_tensor(name))


def check_export_folder(out: str | os.PathLike, config: dict) -> None:
    """Refuse an export into a folder that holds another model: weights already there, or
    a config.json that differs from the one the export writes. Nothing is written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file, not a folder; choose a folder to export "
                         f"into")
    present = [name for name in WEIGHT_FILES if (out / name).exists()]
    if present:
        raise ValueError(f"{str(out)!r} already holds weights ({present[0]}); export into "
                         f"an empty folder, or remove them first")
    if (out / CONFIG).is_file():
        try:
            theirs = json.loads((out / CONFIG).read_text())
        except ValueError:
            theirs = None
        ignored = {"transformers_version", "architectures", "dtype", "torch_dtype"}
        ours = {k: v for k, v in config.items() if k not in ignored}
        if not isinstance(theirs, dict) or \
                {k: v for k, v in theirs.items() if k not in ignored} != ours:
            differ = sorted(k for k in set(ours) | set(theirs or {})
                            if k not in ignored and (theirs or {}).get(k) != ours.get(k))
            raise ValueError(f"{str(out)!r} holds another model's {CONFIG} (it differs in "
                             f"{differ[:SHOWN]}); export into an empty folder")


def load_into(folder: str | os.PathLike, wrapped) -> None:
    """Load a Hugging Face folder's weights into any strategy's shards (every rank calls
    it; each reads its own pieces), then let the strategy finish (`after_load`)."""
    from shardlab.checkpoint.layout import pieces_of  # the contract's reader

    pieces = pieces_of(wrapped)
    saved = header_shapes(folder)
    for piece in pieces:  # the shard's module shows shard shapes: check the full ones
        name = next((n for n in (piece.name, *piece.aliases) if n in saved), None)
        if name is None or saved[name] != tuple(piece.shape):
            raise ValueError(f"{str(folder)!r} does not hold this model's weights: "
                             f"{piece.name!r} is {list(saved.get(name, ())) or 'missing'} "
                             f"in the file, {list(piece.shape)} in the model")
    load_pieces(folder, pieces, wrapped.module)
    wrapped.after_load()


def load_module(folder: str | os.PathLike, module: nn.Module) -> None:
    """Load a Hugging Face folder's weights into a whole (unsharded) module."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    pieces = [Piece(name, p.shape, 0, p.numel(), p.detach().reshape(-1),
                    aliases=tuple(names[id(p)][1:])) for name, p in module.named_parameters()]
    load_pieces(folder, pieces, module)
