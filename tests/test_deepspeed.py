"""DeepSpeed's ZeRO stages beside ours: parity with one process, and bytes per rank.

DeepSpeed runs on the CPU with gloo (`DS_ACCELERATOR=cpu`), gradient clipping off (its
default clips to norm 1.0, which plain AdamW does not). One launch per world size holds
every case; the references run in this process on one thread, as each rank does.

* parity: the losses of 4 steps within the fp32 bound of the other parity tests, on the
  course's tiny GPT (every parameter under DeepSpeed's persistence threshold, so stage 3
  keeps them all whole) and its small GPT (the large matrices partitioned); gradient
  accumulation through `no_sync`; bf16-mixed within one bf16 rounding;
* bytes: every rank holds what `deepspeed_ref.predicted_state_bytes` computes from the
  shapes with DeepSpeed's rules (fp32 masters even in fp32 training, 2N-aligned flat
  buffers, per-parameter partitions and the persistence threshold), to the byte.
"""

from __future__ import annotations

import pytest
import torch

from shardlab.launch import launch
from shardlab.models import build_model
from shardlab.train import TrainConfig, train_many, train_worker

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install deepspeed")

from shardlab.deepspeed_ref import predicted_state_bytes  # noqa: E402

STAGES = [1, 2, 3]
LOSS_TOL = 1e-5
BF16_TOL = 2 ** -7


def config(stage: int, world: int, model: str = "gpt-tiny", **kw) -> TrainConfig:
    return TrainConfig(strategy=f"deepspeed-zero{stage}" if stage else "single",
                       world=world if stage else 1, model=model, steps=4, seq_len=16,
                       **kw)


CASES = {
    2: [config(s, 2) for s in STAGES] + [config(2, 2, grad_accum=2),
                                         config(3, 2, precision="bf16-mixed")],
    4: [config(s, 4, model=m) for m in ("gpt-tiny", "gpt-small") for s in STAGES],
}


@pytest.fixture(scope="module")
def runs():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        references = {}
        for cases in CASES.values():
            for c in cases:
                key = (c.model, c.precision, c.grad_accum)
                if key not in references:
                    references[key] = train_worker(config(0, 1, c.model,
                                                          precision=c.precision,
                                                          grad_accum=c.grad_accum,
                                                          measure_memory=False))
    finally:
        torch.set_num_threads(threads)
    return references, {w: launch(train_many, w, cases, timeout=900)
                        for w, cases in CASES.items()}


@pytest.mark.parametrize("world", list(CASES))
def test_every_stage_trains_like_one_process(runs, world):
    references, results = runs
    for case, report in zip(CASES[world], results[world][0]):
        ref = references[(case.model, case.precision, case.grad_accum)]
        tol = LOSS_TOL if case.precision == "fp32" else BF16_TOL
        for loss, expected in zip(report.losses, ref.losses, strict=True):
            assert abs(loss - expected) <= tol * max(1.0, abs(expected)), \
                (case.strategy, case.model, case.precision, report.losses, ref.losses)


@pytest.mark.parametrize("world", list(CASES))
def test_every_rank_holds_deepspeeds_predicted_bytes(runs, world):
    _, results = runs
    for i, case in enumerate(CASES[world]):
        predicted = predicted_state_bytes(build_model(case.model), int(case.strategy[-1]),
                                          world, case.precision)
        for rank in range(world):
            assert results[world][rank][i].state_bytes == predicted, \
                (case.strategy, case.model, case.precision, rank)


def test_stage3_partitions_only_what_is_over_the_persistence_threshold():
    """The tiny GPT is all small tensors: stage 3 keeps every one whole, so it holds more
    parameter bytes than stage 1. The small GPT's matrices are partitioned."""
    tiny, small = build_model("gpt-tiny"), build_model("gpt-small")
    assert predicted_state_bytes(tiny, 3, 4)["params"] > \
        predicted_state_bytes(tiny, 1, 4)["params"]
    assert predicted_state_bytes(small, 3, 4)["params"] < \
        predicted_state_bytes(small, 1, 4)["params"]


@pytest.mark.parametrize("precision,options,message", [
    ("bf16", {}, "trains 'fp32' or 'bf16-mixed'"),
    ("fp32", {"stage": 2}, "unknown option(s) ['stage']"),
])
def test_what_cannot_run_is_refused(precision, options, message):
    with pytest.raises(ValueError) as raised:
        from shardlab.train import run
        run(TrainConfig(strategy="deepspeed-zero2", world=2, precision=precision,
                        options=options, steps=1, seq_len=16))
    assert message in str(raised.value)
