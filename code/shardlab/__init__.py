"""shardlab: DDP, ZeRO-1/2/3 and FSDP2 built from scratch, measured against PyTorch.

Each module holds one idea of the course; see the README's layout table.
"""

__version__ = "0.1.0"
