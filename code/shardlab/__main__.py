"""`python -m shardlab <command>`: each command lives with the module it belongs to.

A misspelt command is answered in one line naming the nearest, and output cut short by
the reader (`| head`) ends the command quietly, as it ends `ls` or `grep`.
"""

from __future__ import annotations

import importlib
import os
import sys

from shardlab.vocabulary import did_you_mean

COMMANDS = {
    "memory": ("shardlab.memory", "per-rank memory of every ZeRO stage, and what fits"),
    "train": ("shardlab.cli", "train a model with any strategy (launcher or torchrun)"),
    "rendezvous": ("shardlab.rendezvous", "wait until node 0's torchrun answers at "
                                         "HOST:PORT (run on the other nodes first)"),
    "export": ("shardlab.modelio.export", "a checkpoint as a Hugging Face folder "
                                          "(config.json, model.safetensors)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m shardlab {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, about) in COMMANDS.items():
            print(f"  {name:10s} {about}")
        print("\npython -m shardlab COMMAND --help: the command's options")
        return 0
    if argv[0] not in COMMANDS:
        print(f"python -m shardlab: error: unknown command {argv[0]!r}"
              f"{did_you_mean(argv[0], COMMANDS)}; the commands: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        code = module.main(argv[1:]) or 0
        sys.stdout.flush()  # a reader gone (`| head`) is found here, not at exit
        return code
    except BrokenPipeError:
        # Python would print a traceback for it, and again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a command killed by the broken pipe returns


if __name__ == "__main__":
    sys.exit(main())
