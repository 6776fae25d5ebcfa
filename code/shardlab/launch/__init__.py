"""Run one function of the package on N ranks and collect what each rank returns.

    >>> from shardlab.launch import launch
    >>> from shardlab.workers import whoami
    >>> launch(whoami, world=4)          # one value per rank, in rank order

A file per part:

    launcher.py  `launch`: start the ranks, wait, collect; or run under torchrun
    starter.py   how ranks start: forked from a fork server that imported torch once
                 (milliseconds a rank), or spawned when the environment has changed
    in_forkserver.py  what the fork server does for itself: a session of its own, and
                 its socket's folder removed when it ends
    carry.py     how the function reaches the ranks: by name if importable, else by value
                 (a notebook cell's); what cannot travel (a lock, a file) named in one line
    devices.py   placement: NCCL with a GPU per rank, gloo sharing GPUs, gloo on the CPU;
                 `rank_device()`, the device this rank computes on
    hygiene.py   no process outlives a launch: stopping ranks, the reaper, the watchdog,
                 SIGTERM, the run folders of dead launches
    blame.py     which rank ended a launch: the one that died, not the peers it broke
    recorders.py what a failed launch's flight recorders say: PyTorch's, on in every rank
                 and dumped when a launch fails, or the course's (`flight_folder`)
    torchrun.py  under torchrun (one agent per node): each rank's node and local rank, the
                 world checked against torchrun's, the node that died named by the others
    quiet.py     what libraries print below Python (DeepSpeed, the profiler) kept out of
                 a rank's output
    errors.py    `LaunchError`, `RankFailed`, `LaunchTimeout`
"""

from shardlab.launch.devices import (BACKENDS, DEVICES, Placement, choose_placement,
                                     placement, rank_device, resolve_backend, visible_gpus)
from shardlab.launch.errors import LaunchError, LaunchTimeout, RankFailed
from shardlab.launch.hygiene import (OWNER, RUN_DIR_PREFIX, reaped_with_launches,
                                     reclaim_run_dirs)
from shardlab.launch.launcher import (DEFAULT_TIMEOUT, check_importable, check_main_guard,
                                      launch)
from shardlab.launch.quiet import quiet_stderr
from shardlab.launch.recorders import flight_folder
from shardlab.launch.torchrun import (Whereabouts, check_world, first_to_say, under_torchrun,
                                      whereabouts)

__all__ = ["launch", "rank_device", "placement", "under_torchrun", "choose_placement",
           "resolve_backend", "visible_gpus", "Placement", "BACKENDS", "DEVICES",
           "DEFAULT_TIMEOUT", "LaunchError", "RankFailed", "LaunchTimeout",
           "check_importable", "check_main_guard", "reclaim_run_dirs", "OWNER",
           "RUN_DIR_PREFIX", "reaped_with_launches", "Whereabouts", "whereabouts",
           "check_world", "first_to_say", "quiet_stderr", "flight_folder"]
