"""`python -m shardlab rendezvous HOST:PORT`: wait until node 0's torchrun answers.

With torchrun's static rendezvous, node 0's agent listens at `--master-addr:--master-port`
and every other node's agent connects there; a wrong host, a wrong port or a firewall
leaves those agents waiting, and their wait ends in a traceback (after `--rdzv-conf
timeout`, 600 s by default). Run first on every node but node 0 (the Slurm script does),
this says the same in one line naming the endpoint, after a timeout of your choice. It
imports no torch: it adds no second of start-up to a node.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


class RendezvousUnanswered(Exception):
    """Nobody answers at the endpoint, or it is not HOST:PORT."""


def wait_for_rendezvous(endpoint: str, timeout: float) -> None:
    """Wait until torchrun's rendezvous at `endpoint` ("host:port", node 0's agent)
    accepts a connection; after `timeout` seconds, raise `RendezvousUnanswered` naming
    it."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RendezvousUnanswered(f"the rendezvous endpoint must be HOST:PORT (node 0's "
                                   f"--master-addr:--master-port), got {endpoint!r}")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return
        except OSError as exc:
            why = exc.strerror or str(exc)
        if time.monotonic() >= deadline:
            raise RendezvousUnanswered(
                f"nobody answers at {host}:{port} after {timeout:g} s ({why}): start node "
                f"0's torchrun, and give every node its --master-addr and --master-port (a "
                f"firewall between the nodes?)")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """`python -m shardlab rendezvous HOST:PORT [--timeout S]`: exit 0 once node 0's
    torchrun answers there, or 2 with one line naming the endpoint."""
    p = argparse.ArgumentParser(prog="python -m shardlab rendezvous",
                                description="Wait until torchrun's rendezvous answers.")
    p.add_argument("endpoint", metavar="HOST:PORT")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S")
    args = p.parse_args(argv)
    try:
        wait_for_rendezvous(args.endpoint, args.timeout)
    except RendezvousUnanswered as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
