"""`python -m shardlab train`: the training loop from the command line.

    python -m shardlab train --strategy zero3 --world 4 --steps 20 --save-every 5
    torchrun --nproc-per-node=4 -m shardlab train --strategy fsdp2

It builds a `shardlab.config.TrainConfig` from the arguments, runs it on `--world` ranks
(or under torchrun), and prints the ranks' summary table (`shardlab.report`), optionally
writing the whole report as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from shardlab.cards import CARDS, card, names
from shardlab.config import TrainConfig, check_writable_folder
from shardlab.launch.devices import BACKENDS, DEVICES
from shardlab.launch.errors import LaunchError, RankFailed
from shardlab.launch.torchrun import check_world, first_to_say, under_torchrun
from shardlab.models import LOSS_MEANS, MODEL_NAMES, build_model
from shardlab.optimizers import OPTIMIZERS
from shardlab.report import report_to_json, summary_table, whereabouts_lines
from shardlab.train import run
from shardlab.wrap import unit_modules


def _parse_option(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--option takes key=value, got {text!r}")
    key, value = text.split("=", 1)
    for convert in (int, float):
        try:
            return key, convert(value)
        except ValueError:
            pass
    lowered = value.lower()
    return key, {"true": True, "false": False}.get(lowered, value)


def build_parser() -> argparse.ArgumentParser:
    from shardlab.precision import PRECISIONS
    p = argparse.ArgumentParser(
        prog="python -m shardlab train",
        description="Train a small GPT with any strategy, through the launcher "
                    "(--world N) or under torchrun (torchrun --nproc-per-node=N -m "
                    "shardlab train ...).")
    defaults = TrainConfig()
    p.add_argument("--strategy", default=defaults.strategy, choices=sorted(CARDS))
    p.add_argument("--world", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun: its WORLD_SIZE)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes the run spans, checked against torchrun's --nnodes "
                        "(GROUP_WORLD_SIZE); the launcher runs on this one node")
    p.add_argument("--model", default=defaults.model, choices=list(MODEL_NAMES))
    p.add_argument("--precision", default=defaults.precision, choices=sorted(PRECISIONS))
    p.add_argument("--optimizer", default=defaults.optimizer, choices=sorted(OPTIMIZERS))
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help="global batch of one step, split among the ranks")
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--option", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="a strategy option, e.g. bucket_mb=4 (repeatable)")
    p.add_argument("--wrap", metavar="POLICY",
                   help=f"the units of {'/'.join(names(takes_units=True))}: auto, blocks, "
                        f"model, class:Name[,Name], min-params:N (see shardlab.wrap)")
    p.add_argument("--model-config", action="append", type=_parse_option, default=[],
                   metavar="KEY=VALUE", help="a setting of the model's architecture, e.g. "
                                             "n_layer=12 (repeatable)")
    p.add_argument("--backend", default="auto", choices=list(BACKENDS))
    p.add_argument("--device", default="auto", choices=list(DEVICES),
                   help="auto: NCCL with a GPU per rank, gloo with ranks sharing the GPUs, "
                        "or gloo on the CPU; cpu or cuda to force one")
    p.add_argument("--slow-rank", type=int, default=None, metavar="RANK",
                   help="rehearse a straggler: this rank sleeps --slow-seconds before "
                        "every forward")
    p.add_argument("--slow-seconds", type=float, default=0.0, metavar="S")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    p.add_argument("--no-ledger", action="store_true", help="skip recording collectives")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write the full report as JSON")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="save a sharded checkpoint every N steps (0: never)")
    p.add_argument("--checkpoint-dir", default="checkpoints", metavar="DIR",
                   help="where checkpoints go, one folder per step (default: checkpoints)")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="FOLDER",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, "
                        "or from FOLDER; train up to --steps")
    p.add_argument("--resume-world", type=int, default=None, metavar="N",
                   help="resume on N ranks, whatever world size saved the checkpoint "
                        "(the same as --world N with --resume)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="resume from a checkpoint shardlab did not write (PyTorch's own "
                        "dcp.save): it has no manifest to verify")
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="write a torch.profiler trace of one steady step into DIR, one "
                        "Chrome/Perfetto file per rank (open in ui.perfetto.dev)")
    p.add_argument("--init-from", metavar="HF_DIR",
                   help="start from the weights of a Hugging Face folder (config.json, "
                        "model.safetensors) of --model, read into the shards through the "
                        "meta device")
    p.add_argument("--export", metavar="PATH",
                   help="after training, write the full unsharded state dict (torch.save)")
    p.add_argument("--clip-norm", type=float, default=None, metavar="NORM",
                   help="clip the gradients to this global norm before each step")
    p.add_argument("--loss-mean", default=defaults.loss_mean, choices=list(LOSS_MEANS),
                   help="'tokens': the summed loss over the global count of tokens; "
                        "'per-batch': the naive mean of the micro-batches' and ranks' means")
    p.add_argument("--variable-lengths", action="store_true",
                   help="rows of different lengths, padded with ignored tokens (label -100)")
    return p


# The library's messages name TrainConfig's fields and load's arguments; said from the
# command line, they name the flags that set them.
_FLAG_WORDS = [
    (r"\btrusted=True\b", "--trust-checkpoint"),
    (r"\bresume=True\b", "--resume"),
    (r"\bresume=False\b", "no --resume"),
    (r"\b(precision|optimizer)='([^']*)'", r"--\1 \2"),
    (r"(?<![\w./-])(batch_size|seq_len|grad_accum|save_every|checkpoint_dir|model_config|"
     r"trust_checkpoint|resume_world|slow_rank|slow_seconds|init_from|clip_norm|loss_mean|"
     r"variable_lengths)(?![\w/.-])", lambda m: "--" + m[1].replace("_", "-")),
    (r"\bexport_path\b", "--export"),
    (r"\bprofile_dir\b", "--profile"),
    (r"(?<![\w./-])(lr|steps|seed|world)(?= must| >| <)", r"--\1"),
]


def in_flags(message: str) -> str:
    """`message` with the names of TrainConfig's fields as the flags that set them."""
    for pattern, flag in _FLAG_WORDS:
        message = re.sub(pattern, flag, message)
    return message


def main(argv: list[str] | None = None) -> int:
    """Exit 0 after training, or 2 with one line `error: ...` on stderr for anything that
    cannot run, found before a process starts where it can be."""
    try:
        return _main(build_parser().parse_args(argv))
    except (ValueError, LaunchError) as exc:
        if under_torchrun() and not first_to_say():
            return 2  # every rank has the same line to say: the first of each node says it
        message = (exc.rank_traceback.strip().splitlines()[-1]
                   if isinstance(exc, RankFailed) else str(exc))
        print(f"error: {in_flags(message)}", file=sys.stderr)
        if isinstance(exc, RankFailed) and getattr(exc, "hang", None) is not None:
            print(f"what the flight recorders say: {exc.hang}", file=sys.stderr)
        return 2


def _config(args) -> TrainConfig:
    torchrun = under_torchrun()
    if args.nodes is not None and args.nodes < 1:
        raise ValueError(f"--nodes must be a whole number of nodes >= 1, got {args.nodes}")
    if torchrun:
        check_world(args.resume_world if args.resume_world is not None else args.world,
                    args.nodes)
    elif args.nodes not in (None, 1):
        raise ValueError(f"--nodes {args.nodes} needs one torchrun agent per node (README, "
                         f"\"More than one node\"); --world N runs every rank on this one")
    if args.resume_world is not None and args.world is not None \
            and args.resume_world != args.world:
        raise ValueError("--resume-world and --world disagree; give one of them")
    for flag, value in (("--world", args.world), ("--resume-world", args.resume_world)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be a whole number of ranks >= 1, got {value}")
    if args.resume_world is not None and not args.resume:
        args.resume = True
    world = next((w for w in (args.resume_world, args.world) if w is not None),
                 int(os.environ["WORLD_SIZE"]) if torchrun else 1)
    strategy = card(args.strategy)
    if strategy.one_process and world != 1:
        raise ValueError(f"strategy {strategy.name!r} runs on one process: use --world 1 "
                         f"(or torchrun --nproc-per-node=1)")
    options = dict(args.option)
    if args.wrap is not None:
        if not strategy.takes_units:
            raise ValueError(f"--wrap chooses the units of "
                             f"{', '.join(names(takes_units=True))}; strategy "
                             f"{strategy.name!r} has none")
        options["wrap"] = args.wrap
    if args.json:
        folder = Path(args.json).parent
        if not folder.is_dir():
            raise ValueError(f"the folder of --json, {str(folder)!r}, does not exist; "
                             f"create it or give another path")
        check_writable_folder(folder, "the folder of --json")
    return TrainConfig(strategy=args.strategy, world=world, model=args.model,
                       precision=args.precision, optimizer=args.optimizer, lr=args.lr,
                       steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                       grad_accum=args.grad_accum, seed=args.seed, options=options,
                       measure_memory=not args.no_memory, record_ledger=not args.no_ledger,
                       save_every=args.save_every, checkpoint_dir=args.checkpoint_dir,
                       resume=args.resume, export_path=args.export,
                       init_from=args.init_from,
                       model_config=dict(args.model_config) or None,
                       trust_checkpoint=args.trust_checkpoint, profile_dir=args.profile,
                       slow_rank=args.slow_rank, slow_seconds=args.slow_seconds,
                       clip_norm=args.clip_norm, loss_mean=args.loss_mean,
                       variable_lengths=args.variable_lengths)


def _main(args) -> int:
    config = _config(args)
    if args.wrap is not None:  # a policy that names no class of this model fails here
        unit_modules(build_model(config.model, config.seed, config.model_config), args.wrap)
    reports = run(config, backend=args.backend, device=args.device,
                  progress=not args.no_progress)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    if reports[0].first_step:
        print(f"\nresumed at step {reports[0].first_step}")
    print(f"\n{config.strategy} on {config.world} rank(s) ({reports[0].placement}): "
          f"{config.model} ({reports[0].psi:,} parameters), {config.precision}, "
          f"{config.optimizer}, {config.steps} steps of {config.batch_size} x "
          f"{config.seq_len} tokens")
    print(summary_table(reports))
    print("\n" + whereabouts_lines(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(report_to_json(config, reports), indent=1))
        print(f"report written to {args.json}")
    return 0
