"""`python -m shardlab <command>`: each command lives with the module it belongs to."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "memory": ("shardlab.memory", "per-rank memory of every ZeRO stage, and what fits"),
    "train": ("shardlab.cli", "train a small GPT with any strategy (launcher or torchrun)"),
    "rendezvous": ("shardlab.rendezvous", "wait until node 0's torchrun answers at "
                                         "HOST:PORT (run on the other nodes first)"),
    "export": ("shardlab.modelio.export", "a checkpoint as a Hugging Face folder "
                                          "(config.json, model.safetensors)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m shardlab {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, about) in COMMANDS.items():
            print(f"  {name:10s} {about}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
