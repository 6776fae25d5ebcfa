"""A one-node Slurm cluster for a test: munged, slurmctld and slurmd started as root in
a folder of their own, stopped by their pids however the test ends.

Debian's `slurm-wlm` and `munge` packages; the configuration keeps everything (the munge
key and socket, state, spool, logs) in the folder, so the machine's own services, if
any, are untouched. `ProctrackType=proctrack/linuxproc` and `TaskPlugin=task/none` need
no cgroups, which a container often lacks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


def why_not() -> str | None:
    """Why a one-node Slurm cannot start here (None: it can)."""
    missing = [d for d in DAEMONS if shutil.which(d) is None
               and not Path("/usr/sbin", d).exists()]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): "
                f"apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        return "a one-node Slurm is started as root (slurmd runs jobs as their user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _config(folder: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=shardlab",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={folder}/munge.socket",
        f"StateSaveLocation={folder}/state",
        f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid",
        f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log",
        f"SlurmdLogFile={folder}/slurmd.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/builtin",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        f"NodeName={host} CPUs={os.cpu_count() or 2} State=UNKNOWN",
        f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@contextlib.contextmanager
def one_node_slurm(folder: Path, timeout: float = 60.0):
    """Start the cluster in `folder`; yield the environment its commands need
    (`SLURM_CONF`); stop every daemon on the way out."""
    host = socket.gethostname().split(".")[0]
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[subprocess.Popen] = []
    logs = open(folder / "daemons.log", "ab")
    try:
        started.append(subprocess.Popen(
            [_binary("munged"), "--foreground", "--force", f"--key-file={key}",
             f"--socket={folder}/munge.socket", f"--pid-file={folder}/munged.pid",
             f"--seed-file={folder}/munge.seed", f"--log-file={folder}/munged.log"],
            stdout=logs, stderr=logs))
        _wait_for(lambda: (folder / "munge.socket").exists(), timeout, "munged", folder)
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([_binary(daemon), "-D", "-f", str(conf)],
                                            env=env, stdout=logs, stderr=logs))
        _wait_for(lambda: _node_idle(env, host), timeout, "the node to be idle", folder)
        yield env
    finally:
        # a job still running (the test failed) is cancelled; a job step's slurmstepd
        # reports to the daemons before it ends: let it, then stop the daemons, then
        # anything of this cluster still running, with what it started
        if len(started) > 1 and started[1].poll() is None:  # slurmctld answers
            with contextlib.suppress(subprocess.TimeoutExpired):
                subprocess.run(["scancel", "--user=root"], env=env, capture_output=True,
                               timeout=30)
        _wait_for(lambda: not _holding(folder, started), 15, None, folder)
        for process in reversed(started):
            process.terminate()
        for process in reversed(started):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        logs.close()
        for pid in _with_descendants(_holding(folder)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return parents


def _with_descendants(pids: list[int]) -> list[int]:
    parents = _parents()
    found, todo = list(pids), list(pids)
    while todo:
        pid = todo.pop()
        children = [c for c, p in parents.items() if p == pid]
        found += children
        todo += children
    return found


def _holding(folder: Path, daemons: list[subprocess.Popen] = ()) -> list[int]:
    """Processes with a file of `folder` open, other than this one and the `daemons`
    and their children: slurmstepd's (they write slurmd's log)."""
    parents = _parents()
    ours = {os.getpid(), *(d.pid for d in daemons)}
    found = []
    for pid, parent in parents.items():
        if pid in ours or parent in ours - {os.getpid()}:
            continue
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
            if any(os.readlink(fd).startswith(str(folder)) for fd in fds):
                found.append(pid)
        except OSError:
            continue
    return found


def _node_idle(env: dict, host: str) -> bool:
    done = subprocess.run(["sinfo", "-h", "-n", host, "-o", "%t"], env=env,
                          capture_output=True, text=True, timeout=10)
    return done.returncode == 0 and done.stdout.strip() == "idle"


def _wait_for(ready, timeout: float, what: str | None, folder: Path) -> None:
    """Wait until `ready()`; past `timeout`, raise with the daemons' logs (or, when
    `what` is None, give up quietly)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            if what is None:
                return
            logs = "\n".join(p.read_text(errors="replace")[-1500:]
                             for p in sorted(folder.glob("*.log")))
            raise TimeoutError(f"waited {timeout:g} s for {what}; the logs:\n{logs}")
        time.sleep(0.3)
