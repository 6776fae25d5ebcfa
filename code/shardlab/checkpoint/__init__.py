"""Checkpoints of sharded state: every rank writes its own pieces, any world size and any
strategy reads them back, and so does PyTorch.

A checkpoint is PyTorch's distributed checkpoint (DCP): a file of chunks per rank and a
`.metadata` file, with every parameter under its own name and shape, as PyTorch's
`get_state_dict` writes a `fully_shard` model. So a plain PyTorch program reads it into
a `fully_shard` model (`get_state_dict`, `dcp.load`, `set_state_dict`) or into one file
(`dcp_to_torch_save`), and a checkpoint PyTorch wrote resumes here. A file per part:

    layout.py  each rank's pieces as DCP chunks (`boxes`), the state dict (`state_dict`)
    store.py   atomic saves, verified loads, `latest`, the folders (`save`, `load`)
    failures.py  why a save failed, in one line
    lock.py    one writer per folder (`writer_lock`)
    export.py  a full `torch.save` file, PyTorch's FSDP2 reading ours, timings and sizes
"""

from shardlab.checkpoint.export import (export_full_state_dict, files_per_rank,
                                        open_with_pytorch_fsdp2, timed_save_load)
from shardlab.checkpoint.layout import boxes, ensure_optimizer_state, state_dict
from shardlab.checkpoint.store import (MARKER, TMP_SUFFIX, clean_interrupted,
                                       complete_steps, info, is_complete, latest, load,
                                       save, step_folder)
from shardlab.checkpoint.lock import FolderInUse, writer_lock
from shardlab.manifest import CheckpointError

__all__ = ["save", "load", "latest", "is_complete", "complete_steps", "info", "step_folder",
           "clean_interrupted", "export_full_state_dict", "files_per_rank",
           "timed_save_load", "open_with_pytorch_fsdp2", "boxes", "state_dict",
           "CheckpointError", "MARKER", "TMP_SUFFIX", "ensure_optimizer_state",
           "writer_lock", "FolderInUse"]
