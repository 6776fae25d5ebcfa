"""`python -m shardlab train`: the training loop from the command line.

    python -m shardlab train --strategy zero3 --world 4 --steps 20 --save-every 5
    torchrun --nproc-per-node=4 -m shardlab train --strategy fsdp2

It builds a `shardlab.config.TrainConfig` from the arguments, runs it on `--world` ranks
(or under torchrun), and prints the ranks' summary table (`shardlab.report_output`) with a legend
of its columns, where the run's files went, optionally writing the whole report as JSON.

The arguments are read, and a misspelt one refused in one line naming the nearest choice,
before torch is imported (`shardlab.arguments`, `shardlab.vocabulary`): torch takes seconds
to import, and a typo should not. Ctrl-C and SIGTERM end in one line naming the step
reached and the last checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from shardlab.arguments import Parser, key_value
from shardlab.cards import CARDS, names
from shardlab.memory.configs import model_names
from shardlab.vocabulary import (BACKENDS, DEVICES, LOSS_MEANS, OPTIMIZERS, PRECISIONS,
                                 did_you_mean, is_config_path)

# The flags whose default is TrainConfig's: read from it for --help, else filled in by
# `_config` (TrainConfig's module imports torch, which a plain parse does not).
DEFAULTED = ("strategy", "model", "precision", "optimizer", "lr", "steps", "batch_size",
             "seq_len", "grad_accum", "seed", "loss_mean")


def build_parser(defaults=None) -> Parser:
    """The command line. `defaults`: a TrainConfig whose values `--help` shows; without
    one the flags of `DEFAULTED` left out parse as None."""
    p = Parser(
        prog="python -m shardlab train",
        description="Train a model with any strategy, through the launcher "
                    "(--world N) or under torchrun (torchrun --nproc-per-node=N -m "
                    "shardlab train ...).",
        epilog="The summary table's columns are explained under it; chapter 8 measures "
               "each.")
    d = {name: getattr(defaults, name, None) for name in DEFAULTED}
    p.add_argument("--strategy", default=d["strategy"], choices=sorted(CARDS))
    p.add_argument("--world", type=int, default=None,
                   help="ranks to launch (default 1; under torchrun: its WORLD_SIZE)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes the run spans, checked against torchrun's --nnodes "
                        "(GROUP_WORLD_SIZE); the launcher runs on this one node")
    p.add_argument("--model", default=d["model"], metavar="NAME",
                   help=f"one of {', '.join(model_names())} (the published sizes are "
                        f"built as the Hugging Face model of their family), or the path "
                        f"of a Hugging Face config.json; python -m shardlab memory "
                        f"predicts the same names")
    p.add_argument("--precision", default=d["precision"], choices=PRECISIONS)
    p.add_argument("--optimizer", default=d["optimizer"], choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=d["lr"], help="learning rate")
    p.add_argument("--steps", type=int, default=d["steps"], help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help="global batch of one step, split among the ranks")
    p.add_argument("--seq-len", type=int, default=d["seq_len"], help="tokens per row")
    p.add_argument("--grad-accum", type=int, default=d["grad_accum"],
                   help="micro-batches per step")
    p.add_argument("--seed", type=int, default=d["seed"])
    p.add_argument("--option", action="append", type=key_value, default=[],
                   metavar="KEY=VALUE", help="a strategy option, e.g. bucket_mb=4 (repeatable)")
    p.add_argument("--wrap", metavar="POLICY",
                   help=f"the units of {'/'.join(names(takes_units=True))}: auto, blocks, "
                        f"model, class:Name[,Name], min-params:N (see shardlab.wrap; "
                        f"default auto)")
    p.add_argument("--model-config", action="append", type=key_value, default=[],
                   metavar="KEY=VALUE", help="a setting of the model's architecture, e.g. "
                                             "n_layer=12 (repeatable)")
    p.add_argument("--backend", default="auto", choices=BACKENDS)
    p.add_argument("--device", default="auto", choices=DEVICES,
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
                   help="where checkpoints go, one folder per step")
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="FOLDER",
                   help="continue from the newest complete checkpoint in --checkpoint-dir, "
                        "or from FOLDER (one step-N folder); train up to --steps")
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
    p.add_argument("--loss-mean", default=d["loss_mean"], choices=LOSS_MEANS,
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
    (r"\b(precision|optimizer|resume)='([^']*)'", r"--\1 \2"),
    (r"\bcheckpoint_dir='([^']*)'", r"--checkpoint-dir \1"),
    # a strategy's options: options={'shard_group': 2} -> --option shard_group=2
    (r"\boptions=\{'(\w+)': ([^}]*)\}", r"--option \1=\2"),
    (r"\b(?<!-)option (\w+)=", r"--option \1="),
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
    """Exit 0 after training; 2 with one line `error: ...` on stderr for anything that
    cannot run, found before a process starts where it can be (a misspelt argument before
    torch is even imported); 130 or 143, with one line naming the step reached and the
    last checkpoint, when Ctrl-C or SIGTERM stops the run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = None
    if "-h" in argv or "--help" in argv:  # the defaults shown are TrainConfig's own
        from shardlab.config import TrainConfig
        defaults = TrainConfig()
    parser = build_parser(defaults)
    args = parser.parse_args(argv)
    if args.model is not None and args.model not in model_names() \
            and not is_config_path(args.model):
        parser.refuse(f"--model {args.model!r} is not a model name"
                     f"{did_you_mean(args.model, model_names())}: "
                     f"{', '.join(model_names())}, or the path of a config.json")
    from shardlab.launch.errors import LaunchError, RankFailed
    from shardlab.launch.torchrun import first_to_say, under_torchrun
    try:
        return _main(args)
    except (ValueError, LaunchError) as exc:
        if under_torchrun() and not first_to_say():
            return 2  # every rank has the same line to say: the first of each node says it
        message = (exc.rank_traceback.strip().splitlines()[-1]
                   if isinstance(exc, RankFailed) else str(exc))
        print(f"error: {in_flags(message)}", file=sys.stderr)
        if isinstance(exc, RankFailed) and getattr(exc, "hang", None) is not None:
            print(f"what the flight recorders say: {exc.hang}", file=sys.stderr)
        return 2


def _config(args):
    from shardlab.cards import card
    from shardlab.config import TrainConfig, check_writable_folder
    from shardlab.launch.torchrun import check_world, under_torchrun
    defaults = TrainConfig()
    for name in DEFAULTED:
        if getattr(args, name) is None:
            setattr(args, name, getattr(defaults, name))
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
    from shardlab.launch.torchrun import under_torchrun
    from shardlab.models import build_model
    from shardlab.train import run
    from shardlab.wrap import unit_modules
    config = _config(args)
    if args.wrap is not None:  # a policy that names no class of this model fails here
        unit_modules(build_model(config.model, config.seed, config.model_config), args.wrap)
    try:
        reports = run(config, backend=args.backend, device=args.device,
                      progress=not args.no_progress)
    except KeyboardInterrupt as stopped:
        return _stopped(config, stopped, 130)
    except SystemExit as stopped:
        if stopped.code != 143:  # SIGTERM, unwound by the launcher as SystemExit(143)
            raise
        return _stopped(config, stopped, 143)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        return 0
    _print_report(config, args, reports)
    return 0


def _print_report(config, args, reports) -> None:
    from shardlab import checkpoint
    from shardlab.report_output import (TABLE_LEGEND, report_to_json, summary_table,
                                        whereabouts_lines)
    first = reports[0]
    if first.resumed_from:
        saved = checkpoint.info(first.resumed_from).get("world") \
            if checkpoint.is_complete(first.resumed_from) else None
        by = f", saved by {saved} rank(s)" if saved else ""
        print(f"\nresumed at step {first.first_step} from {first.resumed_from}{by}")
    print(f"\n{config.strategy} on {config.world} rank(s) ({first.placement}): "
          f"{config.model} ({first.psi:,} parameters), {config.precision}, "
          f"{config.optimizer}, {config.steps} steps of {config.batch_size} x "
          f"{config.seq_len} tokens")
    if first.units:
        print(f"units: {first.units}")
    print(summary_table(reports))
    print("\n" + TABLE_LEGEND)
    print("\n" + whereabouts_lines(reports))
    for line in _files_written(config):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(report_to_json(config, reports), indent=1))
        print(f"report written to {args.json}")


def _files_written(config) -> list[str]:
    """Where the run's files went, one line each."""
    from shardlab import checkpoint
    lines = []
    if config.save_every:
        saved = checkpoint.complete_steps(config.checkpoint_dir)
        if saved:
            lines.append(f"checkpoints: {len(saved)} in {config.checkpoint_dir}, the newest "
                         f"{saved[-1]} (continue with --resume)")
    if config.profile_dir:
        traces = sorted(Path(config.profile_dir).glob("rank*.json"))
        lines.append(f"profiler traces: {', '.join(map(str, traces))} (open in "
                     f"ui.perfetto.dev)")
    if config.export_path:
        lines.append(f"full state dict written to {config.export_path}")
    return lines


def _stopped(config, stopped: BaseException, code: int) -> int:
    """One line for a run Ctrl-C (130) or SIGTERM (143) stopped: the step it reached, the
    last checkpoint, how to go on."""
    from shardlab import checkpoint
    how = "interrupted" if code == 130 else "terminated"
    saved = checkpoint.complete_steps(config.checkpoint_dir) if config.save_every else []
    last = checkpoint.info(saved[-1])["step"] if saved else None
    # rank 0 notes a step after its save: the newest checkpoint may be a step ahead
    done = max((n for n in (getattr(stopped, "steps_done", None), last) if n is not None),
               default=None)
    reached = (f"after step {done} of {config.steps}" if done is not None
               else "before its first step finished")
    if saved:
        then = (f"last checkpoint {saved[-1]} (step {last}); resume with --resume "
                f"--checkpoint-dir {config.checkpoint_dir}")
    else:
        then = "no checkpoint saved (--save-every N saves one every N steps)"
    print(f"\n{how} {reached}; {then}", file=sys.stderr)
    return code
