"""Nothing lost, nothing silent: a checkpoint is verified before a byte of it is used.

Fault injection on checkpoints of one process (fast; the verification does not depend on
the world size): flipped bytes, a truncated, emptied or deleted shard, garbage or
truncated metadata, a metadata file crafted to run code when unpickled. Each is refused
with one error naming the checkpoint and the file, and resuming falls back to the newest
checkpoint that verifies, saying which it skipped. And a `Wrapped` that cannot say how
its state is laid out is refused on save and on load, instead of resuming from wrong
weights. Saves that fail (a full disk, a folder removed, a file system turned read-only)
say why in one line and leave nothing half-written; a second run on a folder in use is
refused before it trains.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardlab import checkpoint
from shardlab.config import TrainConfig
from shardlab.launch import launch
from shardlab.manifest import MANIFEST, CheckpointError
from shardlab.train import run, train_worker

CONFIG = TrainConfig(steps=3, save_every=1, seq_len=16, measure_memory=False,
                     record_ledger=False, keep_params=True)


@pytest.fixture
def saved(tmp_path):
    """Checkpoints after steps 1, 2 and 3 of one run."""
    config = replace(CONFIG, checkpoint_dir=str(tmp_path))
    train_worker(config)
    return tmp_path, config


def shard(folder: Path) -> Path:
    return next(folder.glob("__0_*.distcp"))


def newest(root: Path) -> Path:
    return checkpoint.step_folder(root, 3)


def test_an_intact_checkpoint_verifies_and_resumes(saved):
    root, config = saved
    assert checkpoint.latest(root) == newest(root)
    assert (newest(root) / MANIFEST).is_file()


def test_flipped_bytes_are_refused_naming_the_file(saved):
    root, config = saved
    path = shard(newest(root))
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"file {path.name} does not match its SHA-256"):
        checkpoint.load(newest(root), object())


def test_resume_falls_back_to_the_newest_checkpoint_that_verifies(saved, capsys):
    root, config = saved
    path = shard(newest(root))
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    assert checkpoint.latest(root) == checkpoint.step_folder(root, 2)
    assert "skipping checkpoint step-000003" in capsys.readouterr().out
    resumed = train_worker(replace(config, save_every=0, resume=True, steps=4))
    assert resumed.first_step == 2


@pytest.mark.parametrize("damage", ["metadata-deleted", "marker-deleted", "marker-garbage"])
def test_a_checkpoint_missing_a_file_or_with_a_damaged_marker_is_skipped_by_name(saved,
                                                                                  damage,
                                                                                  capsys):
    """Not passed over in silence, not an error that stops the resume: the newest
    checkpoint is skipped, saying which file, and the one before it is taken."""
    root, config = saved
    folder = newest(root)
    if damage == "metadata-deleted":
        (folder / ".metadata").unlink()
        expected = "file .metadata is missing"
    elif damage == "marker-deleted":
        (folder / checkpoint.MARKER).unlink()
        expected = f"file {checkpoint.MARKER} is missing"
    else:
        (folder / checkpoint.MARKER).write_text("{not json")
        expected = f"its {checkpoint.MARKER} marker cannot be read"
    assert checkpoint.latest(root) == checkpoint.step_folder(root, 2)
    said = capsys.readouterr().out
    assert "skipping checkpoint step-000003" in said and expected in said
    assert train_worker(replace(config, save_every=0, resume=True, steps=4)).first_step == 2


def test_a_shard_that_verifies_but_does_not_read_gets_one_error_naming_it(saved):
    """A truncated shard whose manifest was rewritten to match passes verification; PyTorch's
    reader then fails with its own CheckpointException (a BaseException), which becomes
    one error naming the checkpoint."""
    from shardlab.manifest import describe, write_manifest
    root, _ = saved
    folder = newest(root)
    path = shard(folder)
    path.write_bytes(path.read_bytes()[:-100])
    write_manifest(folder, describe(sorted(p for p in folder.iterdir()
                                           if p.name.endswith(".distcp")
                                           or p.name == ".metadata")))
    with pytest.raises(CheckpointError, match=f"checkpoint {folder} could not be read: "):
        checkpoint.load(folder, checkpoint_wrapped())


def checkpoint_wrapped():
    """A single-process model and optimizer to load into."""
    from shardlab.models import build_model
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.strategy import get_strategy
    return get_strategy("single")(build_model("gpt-tiny"), get_precision("fp32"),
                                  optimizer_spec("adamw", 1e-3), {})


@pytest.mark.parametrize("damage", ["emptied", "deleted", "metadata-garbage",
                                    "metadata-truncated", "manifest-garbage"])
def test_damaged_files_get_one_clear_error(saved, damage):
    root, _ = saved
    folder = newest(root)
    if damage == "emptied":
        shard(folder).write_bytes(b"")
        expected = "has 0 bytes"
    elif damage == "deleted":
        name = shard(folder).name
        shard(folder).unlink()
        expected = f"file {name} is missing"
    elif damage == "metadata-garbage":
        (folder / ".metadata").write_bytes(b"not a pickle at all")
        expected = "file .metadata"
    elif damage == "metadata-truncated":
        meta = folder / ".metadata"
        meta.write_bytes(meta.read_bytes()[:20])
        expected = "file .metadata"
    else:
        (folder / MANIFEST).write_text("{]")
        expected = "MANIFEST.json is damaged"
    with pytest.raises(CheckpointError, match=expected) as raised:
        checkpoint.load(folder, object())
    assert str(folder) in str(raised.value)


class _Exploit:
    """Unpickling this runs `touch <path>`: what a crafted `.metadata` could do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_a_malicious_metadata_file_runs_no_code(saved, tmp_path_factory):
    """Even with a forged manifest that vouches for it, and even when the caller trusts
    the folder: the metadata is read by an unpickler that knows only DCP's classes."""
    root, _ = saved
    folder = newest(root)
    witness = tmp_path_factory.mktemp("witness") / "code-ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Exploit(witness)))
    from shardlab.manifest import describe, write_manifest
    files = describe(sorted(p for p in folder.iterdir() if p.name.endswith(".distcp")
                            or p.name == ".metadata"))
    write_manifest(folder, files)  # the attacker rewrote the manifest too
    for trusted in (False, True):
        with pytest.raises(CheckpointError, match="posix.system is not part of|"
                                                  "os.system is not part of"):
            checkpoint.load(folder, object(), trusted=trusted)
    assert not witness.exists()


def test_metadata_that_points_a_tensor_at_pickled_bytes_runs_no_code(saved,
                                                                    tmp_path_factory):
    """A `.metadata` made only of DCP's own classes (so the safe unpickler admits it) can
    still declare an entry as bytes and point it at a pickle appended to a shard: DCP
    would unpickle those bytes with weights_only=False. The read is refused instead."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from shardlab.manifest import describe, safe_load_metadata, write_manifest
    root, config = saved
    folder = newest(root)
    witness = tmp_path_factory.mktemp("witness") / "code-ran"
    payload = pickle.dumps(_Exploit(witness))
    target = shard(folder)
    offset = target.stat().st_size
    target.write_bytes(target.read_bytes() + payload)
    metadata = safe_load_metadata(folder / ".metadata")
    metadata.state_dict_metadata["progress.step"] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items()
                             if k.fqn != "progress.step"}
    metadata.storage_data[MetadataIndex("progress.step")] = _StorageInfo(target.name, offset,
                                                                         len(payload))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(folder, describe(sorted(p for p in folder.iterdir()
                                           if p.name.endswith(".distcp")
                                           or p.name == ".metadata")))
    with pytest.raises(BaseException, match="declares 'progress.step' as pickled bytes"):
        train_worker(replace(config, save_every=0, resume=str(folder), steps=4))
    assert not witness.exists()


def test_an_interrupted_save_is_cleaned_by_the_next_save(saved):
    root, config = saved
    leftover = root / "step-000007.tmp"
    shutil.copytree(newest(root), leftover)
    train_worker(replace(config, steps=1))  # saves step 1 again
    assert not leftover.exists()


def wrapped_without_a_layout(folder: str) -> list[str]:
    """Worker: the silent case of a hand-built `Wrapped` around a per-block `fully_shard`
    model: it declares no layout, so saving and loading refuse (ours and PyTorch's)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardlab.fsdp import fully_shard
    from shardlab.models import build_model
    from shardlab.strategy import Wrapped

    errors = []
    for shard_fn in (fully_shard, lambda m: torch_fully_shard(
            m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))):
        model = build_model("gpt-tiny")
        for block in model.blocks:
            shard_fn(block)
        shard_fn(model)
        wrapped = Wrapped(model, torch.optim.AdamW(model.parameters()))
        for action in (lambda: checkpoint.save(folder, 1, wrapped),
                       lambda: checkpoint.load(Path(folder) / "step-000001", wrapped)):
            try:
                action()
                errors.append("no error")
            except ValueError as exc:
                errors.append(str(exc))
    return errors


def test_a_wrapped_without_a_declared_layout_is_refused(tmp_path):
    # a real checkpoint of the same model, which the hand-built Wrapped must not load
    launch(train_worker, 2, replace(CONFIG, strategy="fsdp2", world=2, steps=1,
                                    checkpoint_dir=str(tmp_path)))
    for error in launch(wrapped_without_a_layout, 2, str(tmp_path))[0]:
        assert "declares no checkpoint layout" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB file system of its own (a checkpoint of gpt-tiny is 1.7 MB: two fit, the
    third does not), or None where this process may not mount one."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
                          capture_output=True)
    if made.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fault_at_save(monkeypatch, at_step: int, fault, after: bool = False) -> None:
    """Run `fault(folder)` just before (or after) DCP writes step `at_step`'s files: what
    PyTorch or the file system then raises is their own, not one made up by the test."""
    real = dcp.save

    def save(state, storage_writer, **kwargs):
        hit = int(state["progress.step"]) == at_step
        if hit and not after:
            fault(Path(storage_writer.path))
        written = real(state, storage_writer=storage_writer, **kwargs)
        if hit and after:
            fault(Path(storage_writer.path))
        return written

    monkeypatch.setattr(dcp, "save", save)


def test_a_full_disk_is_told_plainly_and_leaves_no_tmp(small_disk, tmp_path, monkeypatch):
    """A save that fills the disk halfway: torch raises `[enforce fail at
    inline_container.cc] unexpected pos` (or an ENOSPC, by the writer); the run ends with
    one line naming the folder, the step, the cause and the last complete checkpoint."""
    root = (small_disk or tmp_path) / "ckpt"
    if small_disk is None:  # no privilege to mount: the writer fails as a full disk does
        def full(tmp):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / "__0_0.distcp"))
        fault_at_save(monkeypatch, 3, full)
    with pytest.raises(CheckpointError) as info:
        train_worker(replace(CONFIG, steps=4, checkpoint_dir=str(root)))
    message = str(info.value)
    assert "\n" not in message
    assert f"saving step 3 into {root} failed: no space left on the device" in message
    assert f"the last complete checkpoint is {root / 'step-000002'}" in message
    assert "the unfinished step-000003.tmp was removed" in message
    if small_disk is not None:  # the error torch really raises for a full disk
        assert "unexpected pos" in message or "No space left" in message
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000002"]
    checkpoint.load(root / "step-000002", train_worker_wrapped())  # intact


def train_worker_wrapped():
    from shardlab.models import build_model
    from shardlab.optimizers import optimizer_spec
    from shardlab.precision import get_precision
    from shardlab.strategy import get_strategy
    return get_strategy("single")(build_model("gpt-tiny"), get_precision("fp32"),
                                  optimizer_spec("adamw", 1e-3), {})


@pytest.mark.parametrize("fault,reason", [
    (lambda tmp: shutil.rmtree(tmp.parent), "the folder was removed while the run was"),
    (lambda tmp: shutil.rmtree(tmp), "a file of the save was removed while it was written"),
])
def test_a_folder_removed_mid_run_is_told_plainly(tmp_path, monkeypatch, fault, reason):
    root = tmp_path / "ckpt"
    fault_at_save(monkeypatch, 2, fault, after=True)  # before, DCP would make it again
    with pytest.raises(CheckpointError) as info:
        train_worker(replace(CONFIG, steps=3, checkpoint_dir=str(root)))
    assert f"saving step 2 into {root} failed: {reason}" in str(info.value)
    assert "\n" not in str(info.value)
    assert not (root / "step-000002.tmp").exists()


def test_a_permission_lost_mid_run_is_told_plainly(small_disk, monkeypatch):
    """The file system turns read-only between two saves (a remount, as a full or failing
    disk does): the next save names that, and the checkpoint before it stays whole."""
    if small_disk is None:
        pytest.skip("needs a file system this test can remount read-only")
    root = small_disk / "ckpt"
    fault_at_save(monkeypatch, 2, lambda tmp: subprocess.run(
        ["mount", "-o", "remount,ro", str(small_disk)], check=True))
    with pytest.raises(CheckpointError) as info:
        train_worker(replace(CONFIG, steps=3, checkpoint_dir=str(root)))
    message = str(info.value)
    assert f"saving step 2 into {root} failed: the folder can no longer be written" in message
    assert "Read-only file system" in message
    assert f"the last complete checkpoint is {root / 'step-000001'}" in message


def test_a_second_run_on_the_same_folder_is_refused_naming_the_first(tmp_path):
    """Two runs saving into one folder would each clean the other's unfinished save: the
    second is refused before a process starts (the timeout is far too short to launch),
    naming the first; resuming from a folder in use is refused too."""
    host = socket.gethostname()
    with checkpoint.writer_lock(tmp_path):  # the first run, still training
        for change in ({"save_every": 1}, {"resume": True}):
            with pytest.raises(ValueError, match=rf"checkpoint_dir '{tmp_path}' is in use by "
                                                 rf"another run \(pid {os.getpid()} on "
                                                 rf"{host}, since "):
                run(replace(CONFIG, checkpoint_dir=str(tmp_path), **change), timeout=1)
    # what a run killed by SIGKILL leaves: a lock file naming a dead process, unlocked
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (tmp_path / checkpoint.lock.LOCK_NAME).write_text(
        json.dumps({"pid": int(dead), "host": host, "since": 0}))
    with checkpoint.writer_lock(tmp_path) as lock:  # stale: the next run takes it
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()  # a run that ends leaves only its checkpoints
