"""Graders of the labs' exercises: your code, run on N ranks, checked against the course's
implementation and PyTorch's.

In a lab, a grader cell calls one of these after the cell where you wrote your version:

    from graders import ring
    ring.grade(ring_reduce_scatter, ring_all_gather)   # prints one line: passes, or what is wrong

When your output differs, the line says where first, and, if your output equals that of
a typical mistake on the same inputs, which one ("looks like the sum over 2 ranks, not the
mean").

Each grader is also a pytest module, as CS336 runs its adapters (`pytest labs/graders -k
ring`): it grades the lab's worked solution, which must pass, and each typical mistake of
its catalogue, which must fail with its own hint.

    common.py           launching a grader, one-line verdicts, finding the first wrong byte,
                        naming the mistake
    wrong.py            the catalogue of typical mistakes, with their hints
    ring.py             lab 2: ring reduce-scatter and all-gather
    ddp.py              lab 4: DDP with bucketed, overlapped all-reduce
    zero1.py            lab 5: a ZeRO-1 optimizer
    fsdp_unit.py        lab 6: one FSDP unit's unshard, reshard, reduce-scatter
    checkpoint.py       lab 7: a sharded checkpoint saved on 2 ranks, loaded on 3
    units.py            lab 9: which parameters each fully_shard unit shards
    rows.py             lab 10: this rank's rows of a safetensors file
    muon_owner.py       lab 11: Muon's owner design, the step of one matrix
    predictions.py      the check under a lab's "Predict": yours beside the run's
    solutions.py        the labs' worked solutions, read from the notebooks (for pytest)
"""
