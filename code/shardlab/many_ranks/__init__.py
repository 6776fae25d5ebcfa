"""Many ranks on one machine: the course's strategies at N = 8 to 1,024, simulated.

Two cores hold four ranks as processes. The course's claims are about N = 64 to 1,024
(16Ψ/N, (N-1)/N volumes, dim-0 splits, HSDP on 2-D meshes), and so are the failures real
jobs meet at scale (a dimension N does not divide, a resume on another number of ranks).
Two of PyTorch's own simulations carry the course's code there, unchanged:

    threads.py   N ranks as N threads of this process, real values, real collectives
                 (PyTorch's threaded process group, with send/recv added for the rings):
                 parity with one process, checkpoints saved at 64 and resumed at 48
    fake.py      one rank of N alone, its peers imagined (PyTorch's fake process group):
                 the layout and the collectives of rank r of 1,024, no values
    formulas.py  the bytes a rank holds and sends at any N, padding included, beside the
                 course's formulas (Ψ/N) that leave it out; what padding costs
    measured.py  the same bytes measured on the strategies' own code, one rank of a fake
                 world, one step of the loop
    meshes.py    a mesh of three dimensions: HSDP of the tensor-parallel MLP, the bytes
                 along each dimension
    figure.py    predicted and measured bytes per rank against N
    runs.py      a training run of the course's loop on ranks that are threads

What neither models: time (threads share the cores and the GIL; a fake collective takes
none) and memory per rank apart from the model states (every thread shares one
allocator, so no rank's peak is measured).

Why threads, and not PyTorch's third simulation, `LocalTensorMode` (N ranks' values in
one tensor, `torch/distributed/_local_tensor/__init__.py`): it runs the program once for
all ranks, so `dist.get_rank()` there is a symbolic integer that holds every rank at once
(`LocalIntNode`), and point-to-point traffic needs its own runner (`LocalRunnerMode`,
`local_p2p_op`). The course's code indexes chunks by its rank and its rings call
`isend`/`irecv`: each would need a special case. A thread is a rank as a process is, so
the code runs as it is.
"""

from shardlab.many_ranks.fake import one_rank_of
from shardlab.many_ranks.figure import bytes_against_world
from shardlab.many_ranks.formulas import (ALL, STRATEGIES, RankBytes, chunk, ideal,
                                          padding_cost, predicted, ring_sent, rows_chunk)
from shardlab.many_ranks.measured import measure_one_rank, sweep
from shardlab.many_ranks.meshes import (DIMENSIONS, expected_bytes, mesh_rank_lists,
                                        reassembled, tensor_parallel_hsdp, unsplit_mlp_run)
from shardlab.many_ranks.runs import run_on_threads, train_many_on_threads
from shardlab.many_ranks.threads import ThreadRank, launch_threads

__all__ = ["launch_threads", "ThreadRank", "one_rank_of", "RankBytes", "predicted", "ideal",
           "padding_cost", "chunk", "rows_chunk", "ring_sent", "ALL", "STRATEGIES",
           "measure_one_rank", "sweep", "bytes_against_world", "DIMENSIONS",
           "tensor_parallel_hsdp", "expected_bytes", "unsplit_mlp_run", "reassembled",
           "mesh_rank_lists", "run_on_threads", "train_many_on_threads"]
