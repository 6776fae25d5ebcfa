"""The hardware figures the course's GPU arithmetic assumes: each one once, with its unit
and where it comes from.

None of these is measured by the course (its runs are on CPUs). A chapter that computes a
time or a fit on a GPU reads its figures from here, so two chapters cannot assume two
different PCIe links or two different sizes of "an 80 GB GPU". Where a figure is the
course's own assumption rather than a published one, its source says so.

Units are explicit (`shardlab.units`): GB = 10**9 bytes, GiB = 2**30 bytes. Bandwidths are
per direction (a link that moves 450 GB/s each way is sold as "900 GB/s").
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlab.units import GB, GiB, MiB


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


# ----------------------------------------------------------------------------- MFU's peak
# MFU, as PaLM defines it (Chowdhery et al. 2022, appendix B), is the model's FLOPs per
# second over the accelerator's *datasheet* peak: a number comparable across papers and
# runs. These are the dense peaks of the GPUs whose names `peak_flops` recognises, by the
# dtype the matmuls run in. NVIDIA's datasheets print tensor-core rates with 2:4
# sparsity; a dense matmul gets half of them. A GPU not listed, and a CPU (no datasheet
# figure the course could use), have no peak: a run there reports its rate as a share of
# the matmul rate it measured, under its own name (`report.production_metrics`).
_HALF_SPARSE = "dense: half the datasheet's figure with sparsity"
PEAK_FLOPS: dict[tuple[str, str], Figure] = {
    ("H100 SXM", "bf16"): FIGURES["h100_bf16_flops"],
    ("H100 SXM", "tf32"): Figure("h100_tf32_flops", 494.5e12, "FLOP/s",
                                 f"NVIDIA H100 SXM datasheet: TF32 989 TFLOPS, {_HALF_SPARSE}"),
    ("H100 SXM", "fp32"): Figure("h100_fp32_flops", 67e12, "FLOP/s",
                                 "NVIDIA H100 SXM datasheet: FP32 67 TFLOPS (no tensor cores)"),
    ("H100 PCIe", "bf16"): Figure("h100_pcie_bf16_flops", 756e12, "FLOP/s",
                                  f"NVIDIA H100 PCIe datasheet: BF16 1,513 TFLOPS, {_HALF_SPARSE}"),
    ("H100 PCIe", "tf32"): Figure("h100_pcie_tf32_flops", 378e12, "FLOP/s",
                                  f"NVIDIA H100 PCIe datasheet: TF32 756 TFLOPS, {_HALF_SPARSE}"),
    ("H100 PCIe", "fp32"): Figure("h100_pcie_fp32_flops", 51e12, "FLOP/s",
                                  "NVIDIA H100 PCIe datasheet: FP32 51 TFLOPS"),
    ("H200 SXM", "bf16"): Figure("h200_bf16_flops", 989e12, "FLOP/s",
                                 f"NVIDIA H200 SXM datasheet: BF16 1,979 TFLOPS, {_HALF_SPARSE}"),
    ("H200 SXM", "tf32"): Figure("h200_tf32_flops", 494.5e12, "FLOP/s",
                                 f"NVIDIA H200 SXM datasheet: TF32 989 TFLOPS, {_HALF_SPARSE}"),
    ("H200 SXM", "fp32"): Figure("h200_fp32_flops", 67e12, "FLOP/s",
                                 "NVIDIA H200 SXM datasheet: FP32 67 TFLOPS"),
    ("A100", "bf16"): Figure("a100_bf16_flops", 312e12, "FLOP/s",
                             "NVIDIA A100 datasheet (SXM and PCIe): BF16 312 TFLOPS dense"),
    ("A100", "tf32"): Figure("a100_tf32_flops", 156e12, "FLOP/s",
                             "NVIDIA A100 datasheet (SXM and PCIe): TF32 156 TFLOPS dense"),
    ("A100", "fp32"): Figure("a100_fp32_flops", 19.5e12, "FLOP/s",
                             "NVIDIA A100 datasheet (SXM and PCIe): FP32 19.5 TFLOPS"),
}
MATMUL_DTYPES = ("bf16", "fp16", "tf32", "fp32")


def gpu_model(device_name: str) -> str | None:
    """The model of `PEAK_FLOPS` that a device's name (`torch.cuda.get_device_name`)
    denotes, or None: "NVIDIA H100 80GB HBM3" is an H100 SXM, "NVIDIA H100 PCIe" the PCIe
    card, "NVIDIA H200" an H200 SXM, any "A100" an A100. An H100 NVL or H200 NVL (other
    clocks and power) is not listed: None rather than a wrong peak."""
    name = device_name.upper()
    if "NVL" in name:
        return None
    if "H200" in name:
        return "H200 SXM"
    if "H100" in name:
        return "H100 PCIe" if "PCIE" in name else "H100 SXM"
    if "A100" in name:
        return "A100"
    return None


def peak_flops(device_name: str, dtype: str) -> Figure | None:
    """The datasheet's dense peak of this GPU for matmuls in `dtype` ("bf16", "fp16",
    "tf32" or "fp32"), or None for a GPU not listed (and for a CPU): MFU's denominator."""
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"dtype must be one of {MATMUL_DTYPES}, got {dtype!r}")
    model = gpu_model(device_name)
    if model is None:
        return None
    return PEAK_FLOPS[(model, "bf16" if dtype == "fp16" else dtype)]  # fp16 = bf16 rate


def text(name: str) -> str:
    """A figure as the prose writes it, by name (for a chapter's glue)."""
    return FIGURES[name].text()


def table() -> list[tuple[str, str, str]]:
    """(name, value, source) for every figure: the page that lists them all."""
    return [(f.name, f.text(), f.source) for f in FIGURES.values()]
