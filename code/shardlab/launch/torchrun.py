"""Under `torchrun`: one elastic agent per node starts the ranks; `launch` runs in each.

torchrun (PyTorch's elastic agent) does the starting, the rendezvous and the restarts;
this module does what is left to the ranks:

* where each rank runs: its node (torchrun's `GROUP_RANK`), its host, its local rank
  and how many ranks share its node (`LOCAL_RANK`, `LOCAL_WORLD_SIZE`), for the report;
* the numbers a user gave checked against the ones torchrun reports (`check_world`),
  in one line, before the process group is made;
* the node that died named. When a node dies, its peers' collectives fail with "closed
  by peer", which says neither which rank nor which node went. Each rank bumps a
  heartbeat counter in torchrun's own store (the agents' TCPStore, `MASTER_ADDR`:
  `MASTER_PORT`) twice a second from a thread, so that a rank stuck in a collective
  still beats; a rank whose collective failed watches the counters for a few beats,
  and the ranks whose counters stood still are the dead ones, named by node and host.
  Counters, not timestamps: the nodes' clocks need not agree. If the store itself no
  longer answers, the node that hosts it (node 0, whose agent holds the rendezvous) is
  the one named.

torchrun's own summary (its `ChildFailedError`) names this node's ranks that exited,
which after a peer node's death are the survivors: the line from here names the cause.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from shardlab.launch.blame import LOST_PEER
from shardlab.launch.devices import choose_placement, place_this_rank, visible_gpus
from shardlab.launch.errors import LaunchError

BEAT_SECONDS = 0.5   # how often each rank bumps its heartbeat
WATCH_BEATS = 6      # beats a failed rank watches the counters for (3 s)


def under_torchrun() -> bool:
    """True in a process started by torchrun (or any launcher that sets RANK/WORLD_SIZE)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))


@dataclass(frozen=True)
class Whereabouts:
    """Where a rank runs: its node (0 .. nodes-1), the host, its rank on that node."""

    node: int
    host: str
    local_rank: int
    local_world: int

    def __str__(self) -> str:
        return (f"node {self.node} ({self.host}), local rank {self.local_rank} of "
                f"{self.local_world}")


def whereabouts(rank: int = 0, world: int = 1) -> Whereabouts:
    """This rank's node, host and local rank: torchrun's, or (the launcher starts every
    rank on this machine) node 0 with local rank = rank."""
    if under_torchrun():
        return Whereabouts(int(os.environ.get("GROUP_RANK", 0)), socket.gethostname(),
                           int(os.environ["LOCAL_RANK"]),
                           int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    return Whereabouts(0, socket.gethostname(), rank, world)


def check_world(world: int | None, nodes: int | None) -> None:
    """Refuse, in one line naming both numbers, a world size or node count that is not
    the one torchrun started (its `WORLD_SIZE`, `GROUP_WORLD_SIZE`)."""
    ranks = int(os.environ["WORLD_SIZE"])
    if world is not None and world != ranks:
        raise LaunchError(f"world {world} asked, but torchrun started {ranks} ranks "
                          f"(WORLD_SIZE={ranks}, its --nnodes x --nproc-per-node): give "
                          f"world {ranks}, or leave it out under torchrun")
    started = os.environ.get("GROUP_WORLD_SIZE")
    if nodes is not None and started is not None and nodes != int(started):
        raise LaunchError(f"{nodes} node(s) asked, but torchrun's rendezvous has "
                          f"{started} (GROUP_WORLD_SIZE={started}, its --nnodes): give "
                          f"{started} node(s), or start torchrun with --nnodes={nodes}")


def run_in_this_process(fn: Callable, world: int | None, args: tuple, kwargs: dict,
                        backend: str, device: str, timeout: float) -> list[Any]:
    """Run `fn` as this rank of torchrun's world; return every rank's value (gathered).
    A collective that fails because a node died raises `LaunchError` naming that node."""
    check_world(world, None)
    env_world = int(os.environ["WORLD_SIZE"])
    here = whereabouts(int(os.environ["RANK"]), env_world)
    placement = choose_placement(backend, device, here.local_world, visible_gpus(),
                                 dist.is_nccl_available())
    created = not dist.is_initialized()
    if created:
        place_this_rank(here.local_rank, placement)
        dist.init_process_group(placement.backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout))
    heartbeat = None
    try:
        if env_world > 1:
            table: list[Any] = [None] * env_world
            # the run's key prefix comes from rank 0, so two runs never share counters
            dist.all_gather_object(table, (here, uuid.uuid4().hex))
            heartbeat = Heartbeat(f"shardlab/{table[0][1]}", dist.get_rank(),
                                  [w for w, _ in table])
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            if heartbeat is not None and any(s in str(exc) for s in LOST_PEER):
                raise LaunchError(heartbeat.name_the_dead(exc)) from exc
            raise
        gathered: list[Any] = [None] * env_world
        dist.all_gather_object(gathered, result)
        return gathered
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        if created:
            dist.destroy_process_group()


def first_to_say() -> bool:
    """Whether this rank is the first of its node to report the run's failure: every
    rank of a node meets the same one (a bad flag, a dead peer), and the first to fail
    may be stopped by the agent before the rest reach their line, so the first speaks,
    not a rank chosen in advance. Claimed in torchrun's store; if that no longer
    answers, every rank speaks (twice is better than never)."""
    key = (f"shardlab/said/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
           f"{os.environ.get('GROUP_RANK', '0')}")
    rank = os.environ["RANK"]
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=datetime.timedelta(seconds=2))
        return store.compare_set(key, "", rank).decode() == rank
    except Exception:  # noqa: BLE001 - no store: say it
        return True


class Heartbeat:
    """This rank's beat in torchrun's store, and the verdict on who stopped beating."""

    def __init__(self, prefix: str, rank: int, where: list[Whereabouts]):
        self.prefix, self.rank, self.where = prefix, rank, where
        self.endpoint = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        self._stopped = threading.Event()
        self._store = self._connect()
        self._thread = threading.Thread(target=self._beat, name="shardlab-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _connect(self) -> dist.TCPStore:
        host, port = self.endpoint
        return dist.TCPStore(host, port, is_master=False,
                             timeout=datetime.timedelta(seconds=5))

    def _beat(self) -> None:
        key = f"{self.prefix}/beat/{self.rank}"
        while not self._stopped.is_set():
            try:
                self._store.add(key, 1)
            except Exception:  # noqa: BLE001 - the store's host is gone; the verdict says so
                return
            self._stopped.wait(BEAT_SECONDS)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _counts(self, store: dist.TCPStore) -> list[int]:
        return [store.add(f"{self.prefix}/beat/{r}", 0) for r in range(len(self.where))]

    def name_the_dead(self, exc: BaseException) -> str:
        """One line naming the node(s) whose ranks stopped beating, and what this rank
        saw (its collective's error)."""
        # gloo's "[.../pair.cc:553] Connection closed by peer [127.0.0.1]:949. This is
        # typically caused by ...": its first sentence, without the source location
        text = str(exc).strip()
        seen = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[-1]).split(". ")[0] \
            if text else repr(exc)
        host, port = self.endpoint
        try:
            store = self._connect()
            verdict_key = f"{self.prefix}/verdict"
            if store.check([verdict_key]):  # a peer that failed first has watched already
                return store.get(verdict_key).decode()
            before = self._counts(store)
            time.sleep(WATCH_BEATS * BEAT_SECONDS)
            after = self._counts(store)
        except Exception:  # noqa: BLE001 - nobody holds torchrun's store any more
            return (f"node 0, which holds torchrun's rendezvous store at {host}:{port}, no "
                    f"longer answers: it died or was stopped (rank {self.rank} saw: {seen})")
        silent = [r for r in range(len(self.where)) if after[r] == before[r]]
        if not silent:
            return (f"rank {self.rank}'s collective failed, yet every rank still beats: "
                    f"{seen}")
        nodes = sorted({self.where[r].node for r in silent})
        parts = []
        for node in nodes:
            ranks = [r for r in silent if self.where[r].node == node]
            everyone = [r for r, w in enumerate(self.where) if w.node == node]
            what = "every rank" if ranks == everyone else "rank(s) " + ", ".join(map(str, ranks))
            parts.append(f"node {node} ({self.where[ranks[0]].host}: "
                         f"{what} of {', '.join(map(str, everyone))})")
        verdict = (f"{' and '.join(parts)} stopped answering: killed, out of memory or cut "
                   f"off; the ranks on the other node(s) ended (rank {self.rank} saw: {seen})")
        try:
            store.compare_set(verdict_key, "", verdict)
        except Exception:  # noqa: BLE001 - the verdict stands without the store
            pass
        return verdict

