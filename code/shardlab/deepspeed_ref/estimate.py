"""DeepSpeed's own memory estimator, and the course's planner beside it.

DeepSpeed ships `estimate_zero{2,3}_model_states_mem_needs`; the chapter sets its numbers
beside `shardlab.memory`'s and beside `predicted_state_bytes`. These run in the calling
process, import DeepSpeed for the CPU, and train nothing: a module apart from the
strategies, which train.
"""

from __future__ import annotations

from typing import Any

import torch

from shardlab.deepspeed_ref.predict import predicted_state_bytes
from shardlab.deepspeed_ref.setup import import_deepspeed
from shardlab.launch.quiet import quiet_stderr
from shardlab.models import build_model


def deepspeed_estimate(stage: int, psi: int, largest_layer: int, gpus: int) -> int:
    """DeepSpeed's own estimate of the model states per GPU (bytes) for ZeRO-2 or ZeRO-3
    with mixed precision and Adam on `gpus` GPUs of one node, no offload:
    `estimate_zero{2,3}_model_states_mem_needs`, what the `..._all_cold` functions print
    for a model of `psi` parameters whose largest module has `largest_layer`."""
    import_deepspeed(torch.device("cpu"))
    with quiet_stderr():  # these modules check for libaio when first imported
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import \
            estimate_zero2_model_states_mem_needs
    if stage == 2:
        return int(estimate_zero2_model_states_mem_needs(psi, gpus, cpu_offload=False)[1])
    if stage == 3:
        return int(estimate_zero3_model_states_mem_needs(
            psi, largest_layer, gpus, cpu_offload=False, cpu_offload_params=False)[1])
    raise ValueError(f"DeepSpeed estimates stages 2 and 3, not {stage!r}")


def zero_config_defaults() -> dict[str, Any]:
    """DeepSpeed's defaults for its `zero_optimization` keys, by their config names."""
    import_deepspeed(torch.device("cpu"))
    with quiet_stderr():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return DeepSpeedZeroConfig().model_dump(by_alias=True)


def estimates_beside_planner(model: str = "gpt-small", world: int = 4,
                             model_config: dict | None = None) -> list[dict]:
    """DeepSpeed's memory estimator beside the course's planner, for ZeRO-2 and ZeRO-3
    with bf16-mixed AdamW on `world` GPUs of one node, no offload; bytes per GPU.

    * "deepspeed_estimate": DeepSpeed's own `estimate_zero{2,3}_model_states_mem_needs`
      (what its `..._all_live(model, num_gpus_per_node=world)` prints): 2Ψ + 18Ψ/N for
      ZeRO-2, 4·L + 18Ψ/N for ZeRO-3, L the largest module's own parameters;
    * "planner": `shardlab.memory.model_states` (the paper's 2Ψ + 14Ψ/N and 16Ψ/N), plus,
      for ZeRO-3, the planner's gathered unit (`gathered_unit_bytes`, the largest
      transformer block in bf16, prefetch on: two of them);
    * "deepspeed_rules": what a rank of `deepspeed-zero{2,3}` holds after a step by
      `predicted_state_bytes` (the measured bytes, to the byte, on the course's runs).

    Runs in the calling process (nothing distributed); it imports DeepSpeed for the CPU.
    """
    from shardlab import memory

    net = build_model(model, 0, model_config)
    with quiet_stderr():
        from deepspeed.runtime.zero.stage3 import model_to_params
    psi, largest_layer = model_to_params(net)
    blocks = [m for m in net.modules() if type(m).__name__ in ("Block", "GPT2Block",
                                                               "LlamaDecoderLayer")]
    unit = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=psi)
    rows = []
    for stage in (2, 3):
        estimate = deepspeed_estimate(stage, psi, largest_layer, world)
        gathered = (memory.gathered_unit_bytes(unit, "bf16-mixed", prefetch=True)
                    if stage == 3 else 0)
        paper = memory.model_states(psi, world, stage, "bf16-mixed", "adamw")
        rules = predicted_state_bytes(net, stage, world, "bf16-mixed")
        rows.append({"stage": stage, "world": world, "psi": psi,
                     "largest_layer": largest_layer, "unit": unit,
                     "deepspeed_estimate": int(estimate),
                     "planner": int(paper.total) + gathered,
                     "planner_states": int(paper.total), "planner_gathered": gathered,
                     "deepspeed_rules": sum(rules.values()), "deepspeed_rules_by": rules})
    return rows
