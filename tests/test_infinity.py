"""ZeRO-Infinity's disk tier (`shardlab.infinity`, zero3's option `offload`): the same
training as zero3 in memory, the bytes its formula says, the memory its formula says, and
one line for every fault of the disk.

Two launches of 2 ranks: one runs every case in turn (`shardlab.infinity_runs.disk_runs`),
one kills a rank. The rest runs in this process. Equality is exact, not within a
tolerance: a chunk of a shard is stepped by the same elementwise operations as the whole
shard, on one thread per rank (the launcher's default), and the chunks are whole
multiples of the vector width, so every element sees the same arithmetic.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from shardlab.disk_tier import DiskFolder, DiskTierError, aligned_buffer
from shardlab.infinity import DEFAULTS, DiskOptions, state_names
from shardlab.infinity_costs import bytes_per_element, disk_traffic, resident_states
from shardlab.infinity_runs import disk_runs
from shardlab.launch import launch
from shardlab.launch.errors import RankFailed
from shardlab.optimizers import OptimizerSpec, optimizer_spec
from shardlab.precision import get_precision

STEPS = 4
CHUNK = 4096  # elements: gpt-tiny's shards then span several chunks, stepped in a ring
# gpt-small on 2 ranks, fp32: zero3 in memory reached 38-39 MiB above its start (VmHWM),
# the disk tier 24-26 MiB, measured on a 2-core machine; the cap sits between the two
LIMIT = 32 << 20
pytestmark = pytest.mark.timeout(900)


def small_tmpfs(folder: Path) -> Path | None:
    """A 256 KiB tmpfs at `folder` (a disk that fills up), or None where this process may
    not mount one (not root, or a container without the capability)."""
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)],
                          capture_output=True)
    return folder if done.returncode == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    disk, kept = root / "states", root / "kept"
    full = small_tmpfs(root / "full")

    def on_disk(offload, **more):
        return {"offload": offload, "offload_dir": str(disk), "offload_buffer_numel": CHUNK,
                **more}

    sgd = dict(optimizer="sgd-momentum", lr=0.05)
    cases = [
        dict(name="fp32"),
        dict(name="fp32 optimizer", options=on_disk("optimizer"), same_as=0),
        dict(name="fp32 optimizer+params", options=on_disk("optimizer+params"), same_as=0),
        dict(name="bf16", precision="bf16-mixed"),
        dict(name="bf16 optimizer", precision="bf16-mixed", options=on_disk("optimizer"),
             same_as=3),
        dict(name="bf16 optimizer+params", precision="bf16-mixed",
             options=on_disk("optimizer+params"), same_as=3),
        dict(name="sgd once", options={"reshard_after_forward": False}, **sgd),
        dict(name="sgd once optimizer+params, 2 buffers", same_as=6, **sgd,
             options=on_disk("optimizer+params", reshard_after_forward=False,
                             offload_buffers=2)),
        dict(name="kept", options=on_disk("optimizer+params", offload_dir=str(kept),
                                          keep_offload_files=True)),
        dict(name="unwritable", options=on_disk("optimizer", offload_dir="/proc/no/such")),
        dict(name="truncated", options=on_disk("optimizer"),
             fault={"what": "truncate", "rank": 0, "step": 1}),
        dict(name="gpt-small", model="gpt-small"),
        dict(name="gpt-small optimizer+params", model="gpt-small",
             options=on_disk("optimizer+params", offload_buffer_numel=1 << 16)),
        # the proof run: under a real cap on what a rank may allocate (RLIMIT_DATA),
        # zero3 in memory runs out and the disk tier trains as it would have
        dict(name="gpt-small under the cap", model="gpt-small", limit=LIMIT),
        dict(name="gpt-small optimizer+params under the cap", model="gpt-small", limit=LIMIT,
             options=on_disk("optimizer+params", offload_buffer_numel=1 << 16), same_as=11),
    ]
    if full is not None:  # a tmpfs is memory: its own line; then a full one
        cases += [dict(name="tmpfs direct", options=on_disk("optimizer", offload_dir=str(full))),
                  dict(name="full", options=on_disk("optimizer", offload_dir=str(full),
                                                    direct_io=False))]
    try:
        ranks = launch(disk_runs, 2, cases, steps=STEPS, backend="gloo", timeout=600)
        left = {"states": sorted(os.listdir(disk)), "full": full and sorted(os.listdir(full))}
        kept_files = {p.parent.name.rsplit("-", 2)[1]: p.name for p in kept.glob("*/*")}
        kept_sizes = {p.name: p.stat().st_size for p in kept.glob("*/*")}
    finally:
        if full is not None:
            subprocess.run(["umount", str(full)], capture_output=True)
    by_name = [{r["case"]["name"]: r for r in rank["runs"]} for rank in ranks]
    return {"ranks": by_name, "left": left, "kept": kept_files, "kept_sizes": kept_sizes,
            "kept_dirs": sorted(p.name for p in kept.iterdir()), "tmpfs": full is not None}


DISK_CASES = ["fp32 optimizer", "fp32 optimizer+params", "bf16 optimizer",
              "bf16 optimizer+params", "sgd once optimizer+params, 2 buffers"]


@pytest.mark.parametrize("name", DISK_CASES)
def test_the_disk_tier_trains_exactly_as_zero3_in_memory(runs, name):
    for rank in runs["ranks"]:
        r = rank[name]
        assert r["error"] is None and len(r["losses"]) == STEPS, r["error"]
        assert r["same_losses"] is True, (r["losses"], name)
        assert r["param_diff"] == 0.0, name


def spec_of(case) -> OptimizerSpec:
    return optimizer_spec(case.get("optimizer", "adamw"), case.get("lr", 1e-3))


@pytest.mark.parametrize("name", DISK_CASES + ["kept", "gpt-small optimizer+params"])
def test_bytes_on_disk_per_step_are_the_formula(runs, name):
    for rank in runs["ranks"]:
        r = rank[name]
        case, options = r["case"], {**DEFAULTS, **r["case"]["options"]}
        gathers = 2 if options.get("reshard_after_forward", True) else 1
        predicted = disk_traffic(r["shards"], get_precision(case.get("precision", "fp32")),
                                 spec_of(case), options["offload"],
                                 options["offload_buffer_numel"], gathers)
        for moved in r["moved"]:  # every step, the first included
            assert moved == {"read setup": 0, "written setup": 0, "written gathers": 0,
                             "read gathers": predicted["gathers read"],
                             "read step": predicted["step read"],
                             "written step": predicted["step written"]}, name
        # and beside the per-element count of the shards, the rounding is less than a block
        # per chunk and state
        per = bytes_per_element(get_precision(case.get("precision", "fp32")), spec_of(case),
                                options["offload"], gathers)
        chunk = options["offload_buffer_numel"]
        transfers = 4 * sum(-(-n // chunk) for n, trained in r["shards"] if trained)
        rounding = predicted["step read"] - per["step read"] * sum(n for n, _ in r["shards"])
        assert 0 <= rounding < 4096 * transfers, name


def test_the_per_element_counts_are_the_module_table():
    adam = optimizer_spec("adamw", 1e-3)
    fp32, bf16 = get_precision("fp32"), get_precision("bf16-mixed")
    assert bytes_per_element(fp32, adam, "optimizer") == {
        "gathers read": 0, "step read": 8, "step written": 8}
    assert bytes_per_element(bf16, adam, "optimizer") == {
        "gathers read": 0, "step read": 12, "step written": 12}
    assert bytes_per_element(fp32, adam, "optimizer+params") == {
        "gathers read": 8, "step read": 12, "step written": 12}
    assert bytes_per_element(bf16, adam, "optimizer+params") == {
        "gathers read": 4, "step read": 12, "step written": 14}


@pytest.mark.parametrize("name", DISK_CASES + ["gpt-small optimizer+params"])
def test_what_stays_in_memory_is_the_formula(runs, name):
    """The model states a rank holds after the step: no parameter (with them on disk),
    the gradient shard, and the slots, to the byte."""
    for rank in runs["ranks"]:
        r = rank[name]
        case, options = r["case"], {**DEFAULTS, **r["case"]["options"]}
        predicted = resident_states(r["shards"], get_precision(case.get("precision", "fp32")),
                                    spec_of(case), options["offload"],
                                    options["offload_buffers"],
                                    options["offload_buffer_numel"])
        assert r["held"] == {**predicted, "buffers": 0}, name


def test_the_peak_drops_by_what_went_to_disk(runs):
    """Resident memory (VmHWM) during the steps above what the rank held before building
    the model, gpt-small (3.2 M parameters): the disk tier's peak is the in-memory one less
    the states that moved to disk (parameter shards, m and v) plus its slots, within 25%
    of that difference (what the allocator keeps, the shard of a read in flight: measured
    within 7% on a 2-core machine). The rest of either peak, activations and gathered
    units, is the same in both and cancels."""
    for rank in runs["ranks"]:
        memory, disk = rank["gpt-small"], rank["gpt-small optimizer+params"]
        adam, fp32 = optimizer_spec("adamw", 1e-3), get_precision("fp32")
        options = {**DEFAULTS, **disk["case"]["options"]}
        held = resident_states(memory["shards"], fp32, adam, None)
        offloaded = resident_states(disk["shards"], fp32, adam, "optimizer+params",
                                    options["offload_buffers"],
                                    options["offload_buffer_numel"])
        predicted = sum(held.values()) - sum(offloaded.values())
        measured = memory["peak_above_start"] - disk["peak_above_start"]
        assert abs(measured - predicted) <= 0.25 * predicted, (measured, predicted)


def test_under_a_memory_cap_zero3_runs_out_and_the_disk_tier_trains(runs):
    """Point 3 of ZeRO-Infinity's proof: the same cap, in memory a one-line out-of-memory
    on every rank (one names where, the other says another rank failed), on disk the
    losses and parameters of the run without a cap."""
    errors = [rank["gpt-small under the cap"]["error"] for rank in runs["ranks"]]
    assert any(e.startswith("out of memory in the ") and e.endswith("> limit 32.00 MiB")
               for e in errors), errors
    assert all(e == "another rank failed" or e.startswith("out of memory in the ")
               for e in errors) and all("\n" not in e for e in errors), errors
    for rank in runs["ranks"]:
        r = rank["gpt-small optimizer+params under the cap"]
        assert r["error"] is None and len(r["losses"]) == STEPS, r["error"]
        assert r["same_losses"] is True and r["param_diff"] == 0.0


def test_a_finished_run_leaves_nothing_and_a_kept_one_its_files(runs):
    assert runs["left"]["states"] == []  # unlinked once open, the folders removed
    assert len(runs["kept_dirs"]) == 2 and all(d.startswith("shardlab-offload-")
                                               for d in runs["kept_dirs"])
    assert set(runs["kept"]) == {"rank0", "rank1"}
    names = set(runs["kept_sizes"])
    assert {"root.0.param", "root.0.exp_avg", "root.0.exp_avg_sq"} <= names
    assert all(size % 4096 == 0 and size > 0 for size in runs["kept_sizes"].values())


def test_an_unwritable_folder_is_one_line(runs):
    for rank in runs["ranks"]:
        error = rank["unwritable"]["error"]
        assert error.startswith("offload_dir '/proc/no/such' cannot be written (")
        assert error.endswith("choose a folder on a disk this user can write")
        assert "\n" not in error


def test_a_file_truncated_under_the_running_job_is_one_line(runs):
    first, second = (rank["truncated"] for rank in runs["ranks"])
    assert len(first["losses"]) == 1 and len(second["losses"]) == 1  # step 1 stopped
    assert "(truncated or replaced under the running job)" in first["error"]
    assert first["error"].endswith("let nothing else write there, and train again from "
                                   "the start or from a checkpoint")
    assert "offload_dir '" in first["error"] and "\n" not in first["error"]
    assert second["error"] == "another rank failed"


def test_a_full_disk_and_a_tmpfs_are_one_line_each(runs):
    if not runs["tmpfs"]:
        pytest.skip("this process may not mount a small tmpfs (needs root and "
                    "CAP_SYS_ADMIN); the full disk's line is checked in "
                    "test_a_write_to_a_full_disk_is_one_line")
    assert runs["left"]["full"] == []  # what was made before the disk filled is gone
    for rank in runs["ranks"]:
        assert rank["tmpfs direct"]["error"].endswith(
            "/full' is on a tmpfs, which is memory, not disk: choose a folder on a disk (or "
            "set direct_io=False to keep the states there knowingly)")
        error = rank["full"]["error"]
        assert "is full (No space left on device) reserving" in error, error
        assert "free space there or choose another offload_dir" in error


def test_a_write_to_a_full_disk_is_one_line(tmp_path, monkeypatch):
    """A file system that cannot reserve blocks ahead (posix_fallocate) can still fill up
    during the run: the write's ENOSPC, as the kernel would return it."""
    folder = DiskFolder(tmp_path, rank=0, direct_io=False)
    f = folder.new_file("m", 8192)
    folder.ready()

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(DiskTierError, match=r"^offload_dir '.*' is full \(No space left on "
                                            r"device\) writing m: free space there or "
                                            r"choose another offload_dir \(this rank's "
                                            r"states need 0.0 MiB\)$"):
        folder.wait([folder.write(f, 0, aligned_buffer(4096), "step")])
    folder.close()
    assert os.listdir(tmp_path) == []


def test_a_killed_rank_leaves_no_file(tmp_path):
    """SIGKILL runs no code of the rank: its files go because they were unlinked once
    open, and the launch says which rank died and how."""
    case = dict(name="killed", options={"offload": "optimizer+params",
                                        "offload_dir": str(tmp_path)},
                fault={"what": "kill", "rank": 1, "step": 1})
    with pytest.raises(RankFailed, match="rank 1 was killed by signal SIGKILL"):
        launch(disk_runs, 2, [case], steps=3, backend="gloo", timeout=300)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("options, message", [
    ({"offload": "everything"}, r"option offload takes one of \['optimizer', "
                                r"'optimizer\+params'\] \(or None\), got 'everything'"),
    ({"offload": "optimizer"}, "offload needs offload_dir, a folder on the disk"),
    ({"offload_dir": "/x"}, r"option\(s\) \['offload_dir'\] set the disk tier, which is "
                            r"off: add offload='optimizer' or 'optimizer\+params'"),
    ({"offload": "optimizer", "offload_dir": "/x", "offload_buffers": 1},
     "offload_buffers takes a whole number >= 2"),
    ({"offload": "optimizer", "offload_dir": "/x", "offload_buffer_numel": 1000},
     "offload_buffer_numel takes a multiple of 2048 elements"),
    ({"offload": "optimizer", "offload_dir": "/x", "direct_io": "yes"},
     "option direct_io takes True or False, got 'yes'"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        DiskOptions.from_options({**DEFAULTS, **options})


def test_an_optimizer_that_is_not_elementwise_is_refused():
    with pytest.raises(ValueError, match="Muon is not one of them: train it in memory"):
        state_names(OptimizerSpec(torch.optim.Muon, {"lr": 1e-3}))
    assert state_names(optimizer_spec("sgd", 0.1)) == ()
    assert state_names(optimizer_spec("adamw", 0.1)) == ("exp_avg", "exp_avg_sq")


@pytest.mark.parametrize("options, message", [
    ({"offload_optimizer": "disk"}, r"option offload_optimizer takes false, true \(the CPU\), "
                                    r"'cpu' or 'nvme', got 'disk'"),
    ({"offload_param": "nvme"}, "offload_param 'nvme' needs nvme_path, a folder on the disk"),
    ({"offload_optimizer": True}, r"this rank computes on the CPU already: leave it off \(or "
                                  r"put it on a disk: 'nvme' with nvme_path\)"),
    ({"offload_optimizer": "nvme", "nvme_path": 3}, "option nvme_path takes a folder, got 3"),
])
def test_deepspeeds_nvme_options_are_checked_in_one_line(options, message):
    from shardlab.deepspeed_ref.strategies import check_deepspeed_options
    with pytest.raises(ValueError, match=message):
        check_deepspeed_options(3, options, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^offload_optimizer 'nvme' is ZeRO-Infinity, a "
                                         r"stage-3 offload: use deepspeed-zero3$"):
        check_deepspeed_options(2, {"offload_optimizer": "nvme"}, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"on the CPU already: leave it off$"):
        check_deepspeed_options(2, {"offload_optimizer": True}, torch.device("cpu"))


def test_deepspeeds_nvme_config_is_its_offload_sections():
    from shardlab.deepspeed_ref.strategies import check_deepspeed_options, deepspeed_config
    opts = check_deepspeed_options(3, {"offload_optimizer": "nvme", "offload_param": "nvme",
                                       "nvme_path": "/data"}, torch.device("cpu"))
    zero = deepspeed_config(3, get_precision("fp32"), opts,
                            optimizer_spec("adamw", 1e-3))["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "nvme", "pin_memory": True,
                                         "nvme_path": "/data", "buffer_count": 4}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/data",
                                     "buffer_count": 5, "buffer_size": 100_000_000,
                                     "max_in_cpu": 1_000_000_000}
    assert "nvme_path" not in zero and zero["sub_group_size"] == 1_000_000_000


def test_a_refusal_inside_cpp_code_is_the_same_one_line():
    """gloo's C++ allocates its buffers with new: past the cap it throws std::bad_alloc,
    which reaches Python as MemoryError, not as torch's "can't allocate memory"."""
    from shardlab.faults import OutOfMemory, data_segment_bytes, host_memory_cap
    with pytest.raises(OutOfMemory, match=r"^out of memory in the backward of step 0: "
                                          r"[\d.]+ MiB held \+ an allocation of the "
                                          r"collectives > limit 512.00 MiB$"):
        with host_memory_cap(512 << 20, data_segment_bytes(), lambda: "the backward of step 0"):
            raise MemoryError("std::bad_alloc")
