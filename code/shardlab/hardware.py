"""The hardware figures the course's GPU arithmetic assumes: each one once, with its unit
and where it comes from.

None of these is measured by the course (its runs are on CPUs). A chapter that computes a
time or a fit on a GPU reads its figures from here, so two chapters cannot assume two
different PCIe links or two different sizes of "an 80 GB GPU". Where a figure is the
course's own assumption rather than a published one, its source says so.

Units are explicit, as in `memory`: GB = 10**9 bytes, GiB = 2**30 bytes. Bandwidths are
per direction (a link that moves 450 GB/s each way is sold as "900 GB/s").
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 10**9
GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Figure:
    """One hardware figure: its value in base units (bytes, bytes/s, FLOP/s, seconds)."""

    name: str
    value: float
    unit: str      # "B", "B/s", "FLOP/s" or "s"
    source: str

    def text(self) -> str:
        """The figure as the prose writes it: GB/s, TFLOP/s, µs, or GiB beside GB."""
        if self.unit == "B/s":
            return f"{self.value / GB:,.0f} GB/s"
        if self.unit == "FLOP/s":
            return f"{self.value / 1e12:,.0f} TFLOP/s"
        if self.unit == "s":
            return f"{self.value * 1e6:,.0f} µs"
        if self.unit == "B":
            return f"{self.value / GiB:,.1f} GiB ({self.value / GB:,.1f} GB)"
        raise ValueError(f"unknown unit {self.unit!r}")


FIGURES: dict[str, Figure] = {f.name: f for f in (
    Figure("h100_bf16_flops", 989e12, "FLOP/s",
           "NVIDIA H100 SXM datasheet: 1,979 TFLOPS bf16 with 2:4 sparsity, half that dense"),
    Figure("h100_memory", 81_559 * MiB, "B",
           "an H100 SXM '80GB' (80 GiB of HBM3) as CUDA and nvidia-smi report it: "
           "81,559 MiB, about 79.6 GiB, of which the CUDA context takes a share"),
    Figure("nvlink", 450e9, "B/s",
           "NVIDIA H100 SXM datasheet: NVLink 4, 900 GB/s per GPU in both directions"),
    Figure("nic", 50e9, "B/s",
           "one ConnectX-7 NIC, 400 Gb/s (NDR InfiniBand) = 50 GB/s each way"),
    Figure("pcie", 64e9, "B/s",
           "NVIDIA H100 SXM datasheet: PCIe Gen5 x16, 128 GB/s in both directions"),
    Figure("nvme_per_gpu", 3e9, "B/s",
           "assumed by the course: each GPU's share of its node's NVMe drives"),
    Figure("nccl_alpha", 5e-6, "s",
           "assumed by the course: the latency of one ring round of NCCL between nodes"),
    Figure("fs_write_per_node", 2e9, "B/s",
           "assumed by the course: what one node writes to a shared file system"),
)}

# The course's GPU and node: a DGX/HGX H100 with 8 GPUs on NVSwitch and 8 NICs (one per
# GPU), so 8 x 400 Gb/s = 400 GB/s leave a node (NVIDIA DGX H100 user guide).
GPUS_PER_NODE = 8
NICS_PER_NODE = 8

H100_BF16_FLOPS = FIGURES["h100_bf16_flops"].value
H100_MEMORY = int(FIGURES["h100_memory"].value)
NVLINK = FIGURES["nvlink"].value
NIC = FIGURES["nic"].value
PCIE = FIGURES["pcie"].value
NVME_PER_GPU = FIGURES["nvme_per_gpu"].value
NCCL_ALPHA = FIGURES["nccl_alpha"].value
FS_WRITE_PER_NODE = FIGURES["fs_write_per_node"].value


def text(name: str) -> str:
    """A figure as the prose writes it, by name (for a chapter's glue)."""
    return FIGURES[name].text()


def table() -> list[tuple[str, str, str]]:
    """(name, value, source) for every figure: the page that lists them all."""
    return [(f.name, f.text(), f.source) for f in FIGURES.values()]
