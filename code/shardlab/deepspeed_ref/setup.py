"""Importing DeepSpeed: only when a deepspeed-* strategy runs, quietly, for the right device.

DeepSpeed is optional (the package's `deepspeed` extra) and picks its accelerator
once, at its first import: so it is found without importing it (`deepspeed_missing`), and
imported by one function that sets the accelerator first and silences what a CPU machine
would print. Apart from the strategies because the estimator imports it too.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings

import torch

from shardlab.launch.quiet import quiet_stderr


# The loop relies on the engine accepting a plain `loss.backward()` (in 0.19.0, not in
# 0.18.0) and on `managed_gradient_accumulation` (in 0.19.4); 0.19.8 is the one tested.
MINIMUM_VERSION = "0.19.8"
MISSING = (f"DeepSpeed is not installed: pip install 'deepspeed>={MINIMUM_VERSION}' (or, "
           "in the course's folder, pip install -e '.[deepspeed]')")


# DeepSpeed tests ZeRO with Adam, AdamW and Adagrad and asks for this flag with any other
# optimizer. SGD is elementwise like Adam; the parity tests are the test it asks for.
_UNTESTED_OPTIMIZER_WARNING = "You are using ZeRO with an untested optimizer"


def deepspeed_missing() -> str | None:
    """None when DeepSpeed can be imported, else the line that says how to install it
    (found without importing it: importing DeepSpeed picks its accelerator for good)."""
    return None if importlib.util.find_spec("deepspeed") is not None else MISSING


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def import_deepspeed(device: torch.device):
    """Import DeepSpeed for a rank that computes on `device`, quietly, and return it.

    DeepSpeed picks its accelerator once, when it is first imported: on a machine with no
    GPU it guesses the CPU and warns that it did. `DS_ACCELERATOR=cpu` says so instead,
    and must be set before the import; a rank on a GPU lets DeepSpeed find CUDA itself.
    """
    if deepspeed_missing():
        raise ValueError(MISSING)
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from packaging.version import Version

    if Version(deepspeed.__version__) < Version(MINIMUM_VERSION):
        raise ValueError(f"the deepspeed-* strategies need DeepSpeed >= {MINIMUM_VERSION}, "
                         f"found {deepspeed.__version__}: pip install -U "
                         f"'deepspeed>={MINIMUM_VERSION}'")

    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise ValueError(f"DeepSpeed runs on {accelerator!r} in this process "
                         f"(DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')!r}) but this "
                         f"rank computes on {device.type!r}: unset DS_ACCELERATOR, or set it "
                         f"to {device.type!r} before anything imports deepspeed")
    if accelerator == "cpu":
        # On the CPU, DeepSpeed's communication backend compiles a shared-memory all-reduce
        # (a C++ extension, built by each rank at start-up) that only its inference engine
        # calls. Training never does; marking it unavailable spares the compiler. (Reading
        # `__compatible_ops__` the first time probes every op, NVMe offload's with a
        # test program linked against libaio.)
        with quiet_stderr():
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed 0.19 calls torch.distributed's collectives by their old names, which
    # torch >= 2.10 renamed (`all_gather_single`, `reduce_scatter_single`) and warns about
    # on every call. The course calls the new names (through `shardlab.comm`).
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|"
                                    r"reduce_scatter_tensor)` is deprecated")
    ds_logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessage) for f in ds_logger.filters):
        ds_logger.addFilter(_DropMessage(_UNTESTED_OPTIMIZER_WARNING))
    return deepspeed
