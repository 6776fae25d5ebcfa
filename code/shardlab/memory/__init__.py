"""Where training memory goes: the analytic model of the ZeRO paper, in bytes.

The symbols are the paper's and the text's (Ψ as `psi`, N as `world`, K). A file per
part, each usable alone, all imported from `shardlab.memory` as the chapters do:

    states.py       bytes per parameter and the stage formulas (with offload); GB, GiB
    configs.py      model configurations (GPT-2, GPT-3, Llama, Mixtral): Ψ by architecture
    activations.py  the bytes a layer keeps for its backward, under a recomputation policy
    dim0.py         FSDP2's dim-0 split at any world size: each rank's rows and bytes
    planner.py      everything added up for every stage, what fits; the command line
    allocator.py    the CUDA caching allocator's block and segment rules
    accumulation.py what a rank holds between micro-batches, DDP to FSDP2, by way

Units are explicit: GB = 10**9 bytes (the ZeRO paper's unit), GiB = 2**30 bytes (what a
device reports).
"""

from shardlab.memory.accumulation import held_between_micro_batches
from shardlab.memory.activations import (ATTENTION, CHECKPOINTING, Activations,
                                         activation_bytes, activations, layer_activations)
from shardlab.memory.allocator import (CUDA_BLOCK, CUDA_LARGE_ROUND, CUDA_MID,
                                       CUDA_MID_SEGMENT, CUDA_SMALL, CUDA_SMALL_SEGMENT,
                                       cuda_block_bytes, cuda_segment_bytes)
from shardlab.memory.configs import (MODELS, ModelConfig, as_config, from_hf_config,
                                     get_model, model_names, num_params, read_config_json,
                                     to_hf_config)
from shardlab.memory.dim0 import (dim0_states, dim0_states_per_rank, parameter_shapes,
                                   rows_of, shard_elements)
from shardlab.memory.planner import (PlanRow, bucket_bytes, ddp_bucket_copy_bytes,
                                     format_bytes,
                                     fsdp2_states_by_rank, gathered_bytes,
                                     gathered_unit_bytes, main, parse_bytes, plan, table)
from shardlab.memory.states import (OFFLOAD, OPTIMIZERS, PRECISIONS, STAGES, Breakdown,
                                    bytes_per_param, check_choice, check_optimizer,
                                    check_positive, check_precision, check_stage,
                                    check_world, largest_model, model_states,
                                    offloaded_states, shard_numel)
from shardlab.units import GB, GiB

__all__ = [
    "GB", "GiB", "PRECISIONS", "OPTIMIZERS", "STAGES", "OFFLOAD", "Breakdown",
    "check_precision", "check_optimizer", "check_positive", "check_world", "check_stage",
    "check_choice", "bytes_per_param", "shard_numel", "model_states", "largest_model",
    "offloaded_states", "ModelConfig", "MODELS", "get_model", "num_params", "as_config",
    "from_hf_config", "read_config_json", "to_hf_config", "model_names",
    "CHECKPOINTING", "ATTENTION", "layer_activations", "Activations", "activations",
    "activation_bytes", "gathered_unit_bytes", "gathered_bytes", "bucket_bytes",
    "ddp_bucket_copy_bytes", "PlanRow",
    "plan", "parse_bytes", "format_bytes", "table", "main", "CUDA_BLOCK", "CUDA_SMALL",
    "CUDA_SMALL_SEGMENT", "CUDA_MID", "CUDA_MID_SEGMENT", "CUDA_LARGE_ROUND",
    "cuda_block_bytes", "cuda_segment_bytes", "rows_of", "shard_elements", "dim0_states",
    "dim0_states_per_rank", "parameter_shapes", "fsdp2_states_by_rank",
    "held_between_micro_batches",
]
