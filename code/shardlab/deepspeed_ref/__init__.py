"""DeepSpeed's ZeRO beside ours: stages 1, 2 and 3 as ZeRO's authors ship them.

`deepspeed-zero1`, `deepspeed-zero2` and `deepspeed-zero3` hand the model to
`deepspeed.initialize` and give back the contract every strategy gives, so the course's
loop drives DeepSpeed unchanged. A file per part:

    setup.py       finding and importing DeepSpeed (optional, and picky about its device)
    strategies.py  the config that makes it the same training as the loop's, the contract
    predict.py     the bytes a rank holds, from DeepSpeed's rules (needs no DeepSpeed)
    estimate.py    DeepSpeed's own estimator beside the course's planner
    beside.py      the chapter's worker: each stage by the course, PyTorch and DeepSpeed
"""

from shardlab.deepspeed_ref.beside import beside_deepspeed, side_by_side_table
from shardlab.deepspeed_ref.estimate import (deepspeed_estimate, estimates_beside_planner,
                                             zero_config_defaults)
from shardlab.deepspeed_ref.predict import predicted_for, predicted_state_bytes
from shardlab.deepspeed_ref.setup import (MINIMUM_VERSION, MISSING, deepspeed_missing,
                                          import_deepspeed)
from shardlab.deepspeed_ref.strategies import (BUCKET_NUMEL, OPTIONS, DeepSpeedState,
                                               EngineStep, check_deepspeed_options,
                                               deepspeed_config,
                                               wrap_deepspeed, wrap_deepspeed_zero1,
                                               wrap_deepspeed_zero2, wrap_deepspeed_zero3)

__all__ = ["MINIMUM_VERSION", "MISSING", "BUCKET_NUMEL", "OPTIONS",
           "deepspeed_missing", "import_deepspeed", "check_deepspeed_options",
           "deepspeed_config", "EngineStep", "DeepSpeedState", "wrap_deepspeed",
           "wrap_deepspeed_zero1", "wrap_deepspeed_zero2", "wrap_deepspeed_zero3",
           "predicted_state_bytes", "predicted_for", "beside_deepspeed",
           "side_by_side_table", "deepspeed_estimate", "zero_config_defaults",
           "estimates_beside_planner"]
