"""ZeRO++ from scratch (Wang et al., 2023, arXiv:2306.10209), on the course's FSDP2.

ZeRO++ keeps ZeRO-3's schedule and changes what crosses the slow links between nodes:
the forward's all-gather of the weights in int8 (qwZ), the backward's all-gather inside
the node from a second copy of the weights sharded there (hpZ), the gradients in int4
reduced by all-to-alls, inside the node first (qgZ). Each is a knob FSDP2 already has:
hpZ is an integer `reshard_after_forward`, qwZ and qgZ are custom collectives.

    quantize.py     block quantization: int8 and int4 values, one fp32 scale per block
    collectives.py  qwZ's all-gather and qgZ's two-hop reduce-scatter, as FSDP2 calls them
    strategy.py     the strategy `zeropp` (options qwz, hpz, qgz, node_size) and its groups
    probe.py        `quantization_errors`: each quantization's error on the GPT's real
                    weights and gradients, the worker of the chapter

The bytes each sends per link, formulas of the paper's analysis: `shardlab.comm`'s
`zeropp_volume_per_link` and `zeropp_bytes_leaving_node`.
"""

from shardlab.zeropp.collectives import QuantizedAllGather, QuantizedReduceScatter
from shardlab.zeropp.probe import quantization_errors
from shardlab.zeropp.quantize import (dequantize, payload_bytes, quantize,
                                      round_trip_error)
from shardlab.zeropp.strategy import ZEROPP_OPTIONS, wrap_zeropp, zeropp_groups

__all__ = ["QuantizedAllGather", "QuantizedReduceScatter", "quantize", "dequantize",
           "payload_bytes", "round_trip_error", "ZEROPP_OPTIONS", "wrap_zeropp",
           "zeropp_groups", "quantization_errors"]
