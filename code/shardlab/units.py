"""Units of bytes, each defined once.

GB = 10**9 bytes: the ZeRO paper's unit and the datasheets'. GiB = 2**30 and MiB = 2**20
bytes: what an allocator, `nvidia-smi` and CUDA report. A bucket's size in "MB"
(`bucket_mb`, as PyTorch DDP's `bucket_cap_mb`) counts MiB: 25 MB is 25 * 2**20 bytes.
"""

GB = 10**9
GiB = 2**30
MiB = 2**20
