"""A shardlab checkpoint of any strategy and world size, written as a Hugging Face folder
(`config.json` and `model.safetensors`) that `from_pretrained` loads; the command
`python -m shardlab export CHECKPOINT --hf OUT`.

The checkpoint is read by one process into one whole model: `shardlab.checkpoint.load`
already reads any world size's shards into any layout, here the unsharded one. The
weights written are the fp32 master copy when the run kept one ("bf16-mixed"), and
`save_pretrained` writes them (a tied weight once, as Hugging Face does). Everything
that can be refused is refused before a file is written: a checkpoint that is not an
hf-* model's, a folder that holds another model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from shardlab import checkpoint
from shardlab.checkpoint.layout import pieces_of
from shardlab.modelio.hf_files import check_export_folder
from shardlab.models import HF_MODELS, build_model
from shardlab.optimizers import optimizer_spec
from shardlab.precision import get_precision
from shardlab.strategy import wrap_single


@contextlib.contextmanager
def _quiet_transformers():
    """save_pretrained draws a progress bar on stderr: a notebook would store it. The
    bar's setting is the caller's again afterwards (a chapter that turned it off keeps
    it off for its own `from_pretrained`)."""
    from transformers.utils import logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def hf_config_json(module) -> dict:
    """The config.json `save_pretrained` writes for `module` (the settings that differ
    from the family's defaults)."""
    return json.loads(module.config.to_json_string(use_diff=True))


def export_hf(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the checkpoint `folder` (one `step-N` folder that shardlab saved) as a
    Hugging Face folder `out`; return `out`."""
    folder, out = Path(folder), Path(out)
    if not checkpoint.is_complete(folder):
        raise ValueError(f"{str(folder)!r} is not a complete shardlab checkpoint (a "
                         f"step-N folder with its {checkpoint.MARKER} marker)")
    saved = checkpoint.info(folder)
    name, settings = saved.get("model"), saved.get("model_config")
    if name not in HF_MODELS:
        raise ValueError(f"the checkpoint holds model {name!r}, which has no Hugging Face "
                         f"class; export --hf takes a checkpoint of an hf-* model "
                         f"({', '.join(HF_MODELS)})")
    target = build_model(name, seed=0, config=settings)  # fp32: what is written
    check_export_folder(out, hf_config_json(target))
    precision = get_precision(saved.get("precision", "fp32"))
    wrapped = wrap_single(build_model(name, seed=0, config=settings), precision,
                          optimizer_spec(saved.get("optimizer", "adamw"), 1e-3), {})
    checkpoint.load(folder, wrapped)
    params = dict(target.named_parameters())
    with torch.no_grad():
        for piece in pieces_of(wrapped):
            weights = piece.master if piece.master is not None else piece.values
            params[piece.name].copy_(weights.view(piece.shape))
        buffers = dict(wrapped.module.named_buffers())
        for buffer_name, buffer in target.named_buffers():
            buffer.copy_(buffers[buffer_name])
    with _quiet_transformers():
        target.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m shardlab export",
        description="Write a shardlab checkpoint (any strategy, any world size) as a "
                    "Hugging Face folder that from_pretrained loads.")
    p.add_argument("checkpoint", help="a step-N folder saved by shardlab")
    p.add_argument("--hf", required=True, metavar="OUT_DIR",
                   help="the folder to write config.json and model.safetensors into "
                        "(empty, or new)")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.checkpoint, args.hf)
    except (ValueError, checkpoint.CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0
