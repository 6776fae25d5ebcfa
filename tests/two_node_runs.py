"""Started by torchrun on each of two nodes (tests/test_multinode.py): the command line's
`main` for several runs in one process, arguments separated by `--next`.

The runs share one process group, made here once, as `shardlab.train.train_many` shares
one launch: each torchrun start imports torch on every rank (seconds on a small machine),
and the runs themselves take milliseconds.
"""

import sys

import torch.distributed as dist

from shardlab.cli import main

if __name__ == "__main__":
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == "--next":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    dist.init_process_group("gloo")
    for argv in runs:
        code = main(argv)
        if code:
            sys.exit(code)
    dist.destroy_process_group()
