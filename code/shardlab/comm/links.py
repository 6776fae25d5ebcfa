"""Which link a collective crosses, and a slower network simulated on one machine.

Past one node, a collective's cost depends on the link it runs over: NVLink inside a
node, the NICs between nodes. HSDP's point is to put its frequent collectives (the
all-gathers, the reduce-scatter) on the first, and only one all-reduce per unit and step
on the second. To show that, the ledger must say which records crossed which link, and one
machine must have a slower link to cross.

    label_link(group, "intra-node")    name the link a process group's collectives use
    per_link(records)                  the ledger's totals by link
    throttle_link(link, alpha, seconds_per_byte)     (in `shardlab.comm.ledger`)
                                       SIMULATION, blocking: every native collective of
                                       the groups labelled `link` takes rounds x (alpha +
                                       round bytes x seconds_per_byte) longer than it
                                       really does, slept by the rank that called it
    simulate_network(SimulatedNetwork(alpha, beta), link=None)
                                       SIMULATION, overlapping: every native collective
                                       (of the groups labelled `link`; None: of every
                                       group) lasts at least its ring's α-β time on that
                                       network, counted on a wire of its own while the
                                       rank goes on computing

Both are simulations, and say so wherever their numbers appear: on one machine all ranks
talk through shared memory, so "inter-node" is a label, and "the network" is gloo's
threads copying memory on the cores that compute. Both time a collective by the α-β
model of its ring (its rounds and bytes per round from `ring_traffic`, the rule the ledger
counts by). They differ in who waits:

* The throttle adds its time *after* the real collective, on the calling thread, as a
  blocking collective would hold it: an asynchronous collective on a throttled group
  loses its overlap. It stays that way because what it is for, chapter 5's comparison of
  FSDP and HSDP on a slow link between "nodes", is how exposed each schedule is to that
  link, and a ring spanning two nodes is as slow as its slowest hop: k x slower is this
  machine's time plus (k - 1) x its α-β time.
* The simulated network is a network apart from the cores that compute, as a GPU's
  NVLink and NICs are apart from its SMs. Each process group
  is a wire that carries its collectives one at a time, in the order they were launched,
  as NCCL runs one communicator's collectives in order on its stream. A collective
  launched at t starts on the wire when the wire is free, lasts its α-β time there, and
  is done when that time has passed *and* gloo has really finished it. A thread per wire
  waits for gloo and then sleeps out the rest (no core is used: no busy loop), then
  completes the collective's work: `work.wait()`, `work.is_completed()`, the work's future
  and a blocking collective's return all follow it. So a collective launched early (DDP's
  buckets in backward, FSDP's prefetch, ZeRO's overlapped all-gather) runs "in the
  background" while the rank computes, and a blocking one costs its whole time. With a
  network a few times slower than gloo, gloo's own time hides under the simulated time:
  the timing shows the shape a separate network gives, on any machine. What it leaves
  out: gloo still copies the bytes, on the cores, when the collective is launched (it
  hides gloo's time, not gloo's work); on a GPU NCCL's kernels take SMs and memory
  bandwidth from the compute beside them, so real overlap is partial (the `hiding` of the
  step-time chapter); and each rank's clock starts at its own launch, so a rank that
  launches before a slower peer waits for the peer but not the peer's full α-β time after.
  It applies to collectives of CPU tensors; collectives of CUDA tensors run on the real
  network (a host thread cannot hold a GPU stream).

Ring collectives (`shardlab.comm.ring`, send/recv inside) are neither throttled nor
simulated: only native ones.

A group is known by its c10d name, the same on every rank of it (`CollectiveRecord.group`).
A group with no label is "unlabelled".
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from shardlab.comm.records import CollectiveRecord, ring_traffic, totals

UNLABELLED = "unlabelled"
INTRA, INTER = "intra-node", "inter-node"   # the two links past one node

_LINKS: dict[str, str] = {}                 # group name -> link label
_THROTTLES: dict[str, "Throttle"] = {}      # link label -> its simulated slowness
EVERY_GROUP = "every group"                 # a simulated network for all groups at once
_NETWORKS: dict[str, "SimulatedNetwork"] = {}   # link label (or EVERY_GROUP) -> network
_WIRES: dict[str, "_Wire"] = {}             # group name -> its simulated wire
_real_wait = dist.Work.wait                 # taken before the ledger times `Work.wait`


@dataclass(frozen=True)
class Throttle:
    """The extra α-β cost a simulated slow link adds to each round of a ring."""

    alpha: float              # seconds added per round
    seconds_per_byte: float   # seconds added per byte of a round (1/β of the slowdown)

    def seconds(self, op: str, numel: int, world: int, elem_size: int, rank: int = 0,
                src: int = 0) -> float:
        _, _, rounds, round_bytes = ring_traffic(op, numel, world, elem_size, rank, src)
        return rounds * (self.alpha + round_bytes * self.seconds_per_byte)


def group_name(group) -> str:
    """The name c10d gave a process group (WORLD when None): the same on every rank."""
    try:
        group = group if group is not None else dist.group.WORLD
        return str(getattr(group, "group_name", ""))
    except (RuntimeError, ValueError):  # no default group
        return ""


def label_link(group, link: str) -> None:
    """Record the collectives of `group` (None: the default group) as crossing `link`
    (UNLABELLED to forget a label: a group of all ranks that crosses nodes in one run may
    be used as the loop's own group in the next)."""
    if not isinstance(link, str) or not link:
        raise ValueError(f"a link's label must be a non-empty string, got {link!r}")
    _LINKS[group_name(group)] = link


def link_of(name: str) -> str:
    """The link label of the group named `name` (a record's `group`)."""
    return _LINKS.get(name, UNLABELLED)


def set_throttle(link: str, alpha: float = 0.0, seconds_per_byte: float = 0.0) -> Throttle:
    """Register the simulated slowness of `link` (every group labelled so);
    `shardlab.comm.throttle_link` (in the ledger, whose kernels do the sleeping) is the
    call to use."""
    if not isinstance(link, str) or not link:
        raise ValueError(f"name the link to throttle by its label (e.g. 'inter-node'), "
                         f"got {link!r}")
    for name, value in (("alpha", alpha), ("seconds_per_byte", seconds_per_byte)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    throttle = Throttle(float(alpha), float(seconds_per_byte))
    _THROTTLES[link] = throttle
    return throttle


def unthrottle_link(link: str) -> None:
    """The link's collectives run at the machine's own speed again."""
    _THROTTLES.pop(link, None)


def throttle_of(name: str) -> Throttle | None:
    """The throttle of the link that the group named `name` is labelled with, if any."""
    return _THROTTLES.get(link_of(name))


def any_throttled() -> bool:
    return bool(_THROTTLES)


@dataclass(frozen=True)
class SimulatedNetwork:
    """SIMULATION: a network apart from the cores that compute, α seconds per ring round
    and β bytes per second (`simulate_network` says how a collective is timed on it)."""

    alpha: float   # seconds per round of a ring
    beta: float    # bytes per second, each way

    def __post_init__(self):
        def number(value) -> bool:
            return not isinstance(value, bool) and isinstance(value, (int, float)) \
                and not math.isnan(value)
        if not number(self.alpha) or math.isinf(self.alpha) or self.alpha < 0:
            raise ValueError(f"SimulatedNetwork: alpha must be a finite number of seconds "
                             f">= 0, got {self.alpha!r}")
        if not number(self.beta) or self.beta <= 0:
            raise ValueError(f"SimulatedNetwork: beta must be a number of bytes per second "
                             f"> 0 (math.inf for no bandwidth term), got {self.beta!r}")

    def seconds(self, op: str, numel: int, world: int, elem_size: int, rank: int = 0,
                src: int = 0) -> float:
        """The collective's α-β time on this network: rounds x (α + round bytes / β)."""
        _, _, rounds, round_bytes = ring_traffic(op, numel, world, elem_size, rank, src)
        return rounds * (self.alpha + round_bytes / self.beta)

    def __str__(self) -> str:
        return (f"simulated network: α = {self.alpha * 1e3:g} ms, "
                f"β = {self.beta / 1e6:g} MB/s")


def check_simulated_network(network) -> None:
    """None (the machine's own) or a `SimulatedNetwork`, refused in one line otherwise."""
    if network is not None and not isinstance(network, SimulatedNetwork):
        raise ValueError(f"simulated_network must be None or a "
                         f"shardlab.comm.SimulatedNetwork(alpha, beta), got {network!r}")


def set_network(network: SimulatedNetwork, link: str | None = None) -> None:
    """Register the simulated network of `link` (None: of every group);
    `shardlab.comm.simulate_network` (in the ledger, whose kernels feed the wires) is the
    call to use."""
    check_simulated_network(network)
    if network is None:
        raise ValueError("simulate_network needs a SimulatedNetwork(alpha, beta); "
                         "unsimulate_network() goes back to the machine's own")
    _NETWORKS[EVERY_GROUP if link is None else _checked_label(link)] = network


def unsimulate_network(link: str | None = None) -> None:
    """The collectives of `link` (None: of every group) run at the machine's pace again
    (those in flight finish on their wire)."""
    _NETWORKS.pop(EVERY_GROUP if link is None else link, None)


def network_of(name: str) -> SimulatedNetwork | None:
    """The simulated network the collectives of the group named `name` run on, if any."""
    return _NETWORKS.get(link_of(name)) or _NETWORKS.get(EVERY_GROUP)


def any_simulated() -> bool:
    return bool(_NETWORKS)


class _Wire:
    """One process group's simulated wire: a thread that takes its collectives in launch
    order, waits for gloo to finish each, sleeps until its α-β time on the wire has
    passed, and completes the work the caller holds. Sleeping, not spinning: the thread
    uses no core while the rank computes."""

    def __init__(self, name: str):
        self.pending: queue.SimpleQueue = queue.SimpleQueue()
        self.free_at = 0.0        # when the wire finishes the last collective it took
        self.carried = 0          # collectives carried, for `wires()`
        self.cpu_seconds = 0.0    # this thread's own CPU time, for `wires()`
        threading.Thread(target=self._run, name=f"simulated wire {name}", daemon=True).start()

    def carry(self, real: dist.Work, seconds: float, launched: float) -> dist.Work:
        """The work to hand the caller in place of `real`: done when `real` is and
        `seconds` on the wire have passed, counted from `launched` or from when the wire
        is free, whichever is later."""
        done = torch.futures.Future()
        self.pending.put((real, seconds, launched, done))
        return _create_work_from_future(done)

    def _run(self) -> None:
        while True:
            real, seconds, launched, done = self.pending.get()
            try:
                _real_wait(real)
                value = _result(real)
            except Exception as error:  # noqa: BLE001 - a timeout, a lost peer: the caller's
                self.free_at = time.perf_counter()
                done.set_exception(error)
                continue
            finish = max(launched, self.free_at) + seconds
            wait = finish - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            self.free_at = max(finish, time.perf_counter())
            self.carried += 1
            self.cpu_seconds = time.thread_time()
            done.set_result(value)


def _result(work: dist.Work):
    """What the real work's future holds (PyTorch's DDP reads its all-reduced bucket from
    it); gloo's reduce-scatter and send/recv have no future: None."""
    try:
        return work.get_future().value()
    except RuntimeError:
        return None


def carry_on_wire(group: str, real: dist.Work, seconds: float, launched: float) -> dist.Work:
    """The work that stands for `real` on the simulated wire of the group named `group`."""
    wire = _WIRES.get(group)
    if wire is None:
        wire = _WIRES[group] = _Wire(group)
    return wire.carry(real, seconds, launched)


def wires() -> dict[str, dict]:
    """{group name: {"collectives", "cpu_seconds"}} of this process's simulated wires:
    how many collectives each carried, and the CPU time its thread used doing so."""
    return {name: {"collectives": w.carried, "cpu_seconds": w.cpu_seconds}
            for name, w in _WIRES.items()}


# a forked process inherits the dict but not the threads: it starts with no wires
os.register_at_fork(after_in_child=_WIRES.clear)


def _checked_label(link: str) -> str:
    if not isinstance(link, str) or not link:
        raise ValueError(f"name the link by its label (e.g. 'inter-node'), got {link!r}")
    return link


def per_link(records: Iterable[CollectiveRecord]) -> dict[str, dict]:
    """{link: totals} of the records, by the link each was labelled with when it ran."""
    groups: dict[str, list] = defaultdict(list)
    for record in records:
        groups[record.link].append(record)
    return {link: totals(rs) for link, rs in groups.items()}
