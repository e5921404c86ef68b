"""The hardware a plan is made for: GPU kinds, named systems' links, and a cluster of them.

Figures are vendors' published peaks (dense, no sparsity) and per-GPU link bandwidths in one
direction; `Cluster` takes overrides for any of them. They feed the dry run's link classes
(`shardspeed.planning`) and the step-time model (`step_time.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 10**9


@dataclass(frozen=True)
class GpuKind:
    """One accelerator: its memory and its peak dense 16-bit matrix rate."""

    name: str
    memory_bytes: int
    peak_bf16_flops: float


# NVIDIA's data sheets: dense bf16/fp16 tensor-core peaks (the sparse figures are twice these).
GPUS: dict[str, GpuKind] = {
    kind.name: kind
    for kind in (
        GpuKind("V100-32GB", 32 * 2**30, 125e12),
        GpuKind("A100-40GB", 40 * 2**30, 312e12),
        GpuKind("A100-80GB", 80 * 2**30, 312e12),
        GpuKind("H100-SXM", 80 * 2**30, 989e12),
        GpuKind("H200", 141 * GB, 989e12),
        GpuKind("B200", 180 * GB, 2250e12),
    )
}


@dataclass(frozen=True)
class System:
    """A node design: its GPU kind, GPUs per node, and per-GPU bandwidths in bytes/s one way
    (inside the node: NVLink/NVSwitch; across nodes: the node's network divided among its GPUs;
    host: PCIe; nvme: the node's drives divided among its GPUs) with a latency per hop."""

    name: str
    gpu: str
    gpus_per_node: int
    intra_node_bw: float
    inter_node_bw: float
    host_bw: float
    nvme_bw: float
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 10e-6


# Per-GPU one-way figures: NVLink 3/4/5 give 300/450/900 GB/s; a DGX node's InfiniBand is one
# 200 (A100) or 400 (H100, B200) Gb/s port per GPU; PCIe 4/5 x16 about 25/50 GB/s in practice;
# NVMe as a node's drives (about 25 GB/s for 8 Gen4 drives) shared by its 8 GPUs. DGX-2 (V100, the
# ZeRO papers' cluster): NVSwitch 150 GB/s, 8 x 100 Gb/s InfiniBand for 16 GPUs. AWS p4d/p5: EFA at
# 400 / 3200 Gb/s a node.
SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        System("dgx-2", "V100-32GB", 16, 150 * GB, 6.25 * GB, 12 * GB, 1.5 * GB),
        System("dgx-a100", "A100-80GB", 8, 300 * GB, 25 * GB, 25 * GB, 3 * GB),
        System("p4d", "A100-40GB", 8, 300 * GB, 6.25 * GB, 25 * GB, 1 * GB),
        System("dgx-h100", "H100-SXM", 8, 450 * GB, 50 * GB, 50 * GB, 3 * GB),
        System("p5", "H100-SXM", 8, 450 * GB, 50 * GB, 50 * GB, 3 * GB),
        System("dgx-h200", "H200", 8, 450 * GB, 50 * GB, 50 * GB, 3 * GB),
        System("dgx-b200", "B200", 8, 900 * GB, 50 * GB, 50 * GB, 3 * GB),
    )
}

# The system a GPU kind is assumed to sit in when none is named.
_DEFAULT_SYSTEM = {
    "V100-32GB": "dgx-2",
    "A100-40GB": "p4d",
    "A100-80GB": "dgx-a100",
    "H100-SXM": "dgx-h100",
    "H200": "dgx-h200",
    "B200": "dgx-b200",
}

# Words of an accelerator's name (as torch.cuda.get_device_name gives it, "NVIDIA H100 80GB
# HBM3") that tell its kind; all of a row's words must appear. PCIe and NVL H100s run at other
# clocks than the SXM part, so they are not taken for it.
_DEVICE_NAMES = (
    (("H200",), "H200"),
    (("B200",), "B200"),
    (("H100", "HBM3"), "H100-SXM"),
    (("H100", "SXM"), "H100-SXM"),
    (("A100", "80GB"), "A100-80GB"),
    (("A100", "40GB"), "A100-40GB"),
    (("V100", "32GB"), "V100-32GB"),
)


def gpu_kind_of(device_name: str) -> str | None:
    """The `GPUS` kind an accelerator's name denotes, or None when the table has no such kind."""
    words = device_name.upper()
    for needed, kind in _DEVICE_NAMES:
        if all(word in words for word in needed):
            return kind
    return None


INTRA_NODE = "intra-node"
INTER_NODE = "inter-node"


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of one system. `system` names a row of `SYSTEMS` (default:
    the usual one for `gpu`); `overrides` replaces any of `System`'s figures by name."""

    nodes: int
    gpus_per_node: int
    gpu: str = "H100-SXM"
    system: str | None = None
    overrides: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"a cluster needs at least one node and one GPU per node, got --nodes "
                f"{self.nodes} --gpus-per-node {self.gpus_per_node}"
            )
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU kind {self.gpu!r}: choose one of {', '.join(GPUS)}")
        if self.system is not None and self.system not in SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}: choose one of {', '.join(SYSTEMS)}")
        fields = {f.name for f in dataclasses.fields(System)} - {"name", "gpu", "gpus_per_node"}
        for key, _ in self.overrides:
            if key not in fields:
                raise ValueError(
                    f"unknown link figure {key!r}: choose from {', '.join(sorted(fields))}"
                )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_kind(self) -> GpuKind:
        return GPUS[self.gpu]

    @property
    def links(self) -> System:
        """The system's figures with the overrides applied."""
        base = SYSTEMS[self.system or _DEFAULT_SYSTEM[self.gpu]]
        return dataclasses.replace(base, gpus_per_node=self.gpus_per_node, **dict(self.overrides))

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link_class(self, ranks: tuple[int, ...]) -> str:
        """Whether a collective over these global ranks stays inside one node."""
        nodes = {self.node_of(rank) for rank in ranks}
        return INTRA_NODE if len(nodes) <= 1 else INTER_NODE
