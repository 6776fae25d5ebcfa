"""The CUDA caching allocator's rules: what `memory_allocated` and `memory_reserved` add up.

The formulas count a tensor's elements times their size; PyTorch's CUDA caching
allocator (c10/cuda/CUDACachingAllocator.cpp) hands out blocks and asks CUDA for whole
segments, which it keeps (reserved) after the tensors in them are freed. These are its
default rules, so a measured peak on a GPU can be set beside the formula. Apart from the
formulas because it is a device's accounting, not the paper's.
"""

from __future__ import annotations

from shardlab.memory.states import check_positive


CUDA_BLOCK = 512                 # every block is a multiple of 512 bytes
CUDA_SMALL = 1 << 20             # up to 1 MiB: the small pool...
CUDA_SMALL_SEGMENT = 2 << 20     # ...carved from segments of 2 MiB
CUDA_MID = 10 << 20              # up to 10 MiB: carved from segments of 20 MiB
CUDA_MID_SEGMENT = 20 << 20
CUDA_LARGE_ROUND = 2 << 20       # larger: a segment of its own, rounded up to 2 MiB


def cuda_block_bytes(nbytes: int) -> int:
    """The block the allocator gives a tensor of `nbytes`: what `memory_allocated` counts
    for it (at least this: a large block is not split when less than 1 MiB would be left,
    and then counts whole)."""
    nbytes = check_positive("nbytes", nbytes, integer=True)
    return max(CUDA_BLOCK, -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK)


def cuda_segment_bytes(nbytes: int) -> int:
    """The segment the allocator reserves (cudaMalloc) for a tensor of `nbytes` when no
    cached free block fits it; later tensors of its pool are carved from what is left."""
    block = cuda_block_bytes(nbytes)
    if block <= CUDA_SMALL:
        return CUDA_SMALL_SEGMENT
    if block < CUDA_MID:
        return CUDA_MID_SEGMENT
    return -(-block // CUDA_LARGE_ROUND) * CUDA_LARGE_ROUND
