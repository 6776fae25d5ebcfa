"""What a collective costs: ring collectives from send/recv, a ledger of every byte, the
volumes of ZeRO, and the one shim over torch's renamed collectives.

One idea, *what a collective costs*, in a file per part, so that each reads alone:

    ring.py      the ring collectives, written with nothing but `isend`/`irecv`
    ledger.py    `with Ledger():` records every collective this rank runs, ring or native,
                 with its bytes, its launch, its completion and the waits for it
    records.py   what a record holds, `ring_traffic` (the bytes it counts), and the sums
    volumes.py   the ZeRO paper's volumes and the α-β cost model of a ring, one (α, β)
                 per link past one node; HSDP's two lanes as FSDP2 overlaps them; the
                 bytes of an optimizer step under gradient accumulation; ZeRO++'s by link
    compat.py    `all_gather_into` / `reduce_scatter_into` over torch's renamed collectives
    links.py     which link a collective crosses (its group's label), and a slower network
                 simulated on one machine: `throttle_link` (a sleep on the calling thread)
                 and `simulate_network` (a wire of its own that overlaps the compute)
    flight.py    a flight recorder: the ledger's last K collectives in a file per rank
    hang_diagnosis.py  the ranks' flight files compared: who is behind, what mismatched
    reduction_precision.py  what a reduction loses in bf16: the ring's sum replayed in
                 one process against fp64, over N ranks and M micro-batches; each
                 system's default reduce dtype, with its source

Import from `shardlab.comm` (as every chapter and lab does); the parts import each other
one way only: compat and records import nothing of the course, links builds on the records,
the ledger on both, the ring and the flight recorder on the ledger, the diagnosis on the recorder.
"""

from shardlab.comm.compat import all_gather_into, reduce_scatter_into
from shardlab.comm.flight import FlightDump, FlightEntry, FlightRecorder, read_flight
from shardlab.comm.hang_diagnosis import HangDiagnosis, diagnose
from shardlab.comm.ledger import (Ledger, clock_offset, simulate_network,
                                  simulated_network, throttle_link)
from shardlab.comm.links import (INTER, INTRA, UNLABELLED, SimulatedNetwork, Throttle,
                                 label_link, link_of, per_link, unsimulate_network,
                                 unthrottle_link, wires)
from shardlab.comm.records import (CollectiveRecord, format_table, per_op, per_step,
                                   ring_traffic, totals)
from shardlab.comm.ring import (check_same_tensor, ring_all_gather, ring_all_reduce,
                                ring_broadcast, ring_reduce_scatter)
from shardlab.comm.volumes import (HsdpSeconds, Link, data_parallel_accumulation_volume,
                                   fit_alpha_beta, fsdp_accumulation_volume, fsdp_step_seconds,
                                   hsdp_overlap, hsdp_step_seconds, hsdp_volume_per_link,
                                   predict_seconds, sharded_collectives_per_step,
                                   volume_per_rank, zeropp_bytes_leaving_node,
                                   zeropp_volume_per_link)

__all__ = [
    "all_gather_into", "reduce_scatter_into", "ring_reduce_scatter", "ring_all_gather",
    "ring_all_reduce", "ring_broadcast", "check_same_tensor", "CollectiveRecord", "Ledger",
    "ring_traffic", "clock_offset", "totals", "per_op", "per_step", "format_table",
    "volume_per_rank", "predict_seconds",
    "fit_alpha_beta", "FlightRecorder", "FlightEntry", "FlightDump", "read_flight",
    "HangDiagnosis", "diagnose", "label_link", "link_of", "per_link",
    "throttle_link", "unthrottle_link", "Throttle", "UNLABELLED", "INTRA", "INTER", "hsdp_volume_per_link",
    "Link", "fsdp_step_seconds", "hsdp_step_seconds", "HsdpSeconds", "hsdp_overlap",
    "SimulatedNetwork", "simulate_network", "simulated_network", "unsimulate_network", "wires",
    "sharded_collectives_per_step", "fsdp_accumulation_volume",
    "data_parallel_accumulation_volume", "zeropp_volume_per_link", "zeropp_bytes_leaving_node",
]
