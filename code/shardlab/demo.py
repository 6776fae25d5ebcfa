"""The chapters' workers under their old name: they are `shardlab.workers` now.

Kept while labs 1 to 5 (and `shardlab.launch`'s examples) import them from here; new code
imports `shardlab.workers`.
"""

from shardlab.workers import (COLLECTIVES, MACHINE_SIZES,  # noqa: F401
                              all_reduce_equals_reduce_scatter_all_gather, check_ring_module,
                              collectives_rank_by_rank, measure_link, measure_machine,
                              on_simulated_network,
                              ring_and_native_volumes, run_all, socket_bytes,
                              time_collectives, train_across_nodes, train_strategies, whoami)
