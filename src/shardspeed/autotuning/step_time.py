"""How long one training step takes on a cluster, from what a dry run measured on one rank.

- compute: the rank's FLOPs in the step (torch's counter over the real forward, backward and any
  recompute) at `EFFICIENCY[gpu]` of the GPU's peak. The efficiencies are the share of peak that
  large dense bf16 training reaches on each kind (torchtitan's published 8B FSDP runs: 58% on
  A100, 36% on H100 at 500 W), so compute-bound runs are near them by construction; what this
  model adds is what moves the others away from that.
- communication: each collective by alpha-beta over its link (inside a node or across nodes, the
  system's per-GPU bandwidth and latency): a ring moves (n - 1) / n of the payload per rank for an
  all-gather, reduce-scatter, reduce or all-to-all and twice that for an all-reduce, with a latency
  of log2(n) hops per call.
- overlap, as the engine does it: with `overlap_comm`, gradient reductions over the data-parallel
  group run while backward runs (two thirds of the compute), and at stage 3 the parameter
  gathers run while forward and backward do (prefetch); what does not fit under that compute is
  exposed. Tensor-, sequence- and expert-parallel collectives and pipeline sends sit on the
  critical path and are all exposed, as are stage 1-2's gathers after the step (a pipeline
  transfer counts at its sender: the receiver's "recv" is the same bytes).
- offload: the optimizer's host-held states cost their gradients down and parameters up over
  PCIe (half their bytes: 4 + 2 of every 12), NVMe-held ones a read and a write each step.
- pipeline: the 1F1B bubble, (stages - 1) / micro-batches of the compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .systems import INTRA_NODE, Cluster

# Share of the GPU's dense bf16 peak that a large transformer's training step reaches.
EFFICIENCY = {
    "V100-32GB": 0.45,
    "A100-40GB": 0.58,
    "A100-80GB": 0.58,
    "H100-SXM": 0.38,
    "H200": 0.40,
    "B200": 0.38,
}
# Bytes each rank puts on the wire per payload byte, for a ring over n ranks.
_RING = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "reduce": 1.0,
         "all_to_all": 1.0}  # fmt: skip
_GRADIENT_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


@dataclass(frozen=True)
class StepInputs:
    """What the model needs from a dry run's rank. `collectives`: (kind, group size, link, payload
    bytes, calls) of one step; `data_parallel`: the size of the group gradients are averaged over."""

    flops: float
    collectives: Sequence[tuple[str, int, str, int, int]]
    data_parallel: int
    zero_stage: int
    overlap_comm: bool = True
    pipeline_stages: int = 1
    micro_batches: int = 1
    host_optimizer_bytes: int = 0
    nvme_optimizer_bytes: int = 0


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step by part, and their total."""

    compute: float
    communication: float
    exposed_communication: float
    offload: float
    bubble: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed_communication + self.offload + self.bubble

    def as_dict(self) -> dict[str, float]:
        return {
            "compute": self.compute,
            "communication": self.communication,
            "exposed_communication": self.exposed_communication,
            "offload": self.offload,
            "pipeline_bubble": self.bubble,
            "total": self.total,
        }


def collective_seconds(kind: str, group_size: int, link: str, nbytes: int, calls: int,
                       cluster: Cluster) -> float:  # fmt: skip
    """Alpha-beta time of `calls` calls of a collective moving `nbytes` of payload in all."""
    links = cluster.links
    intra = link == INTRA_NODE
    bandwidth = links.intra_node_bw if intra else links.inter_node_bw
    latency = links.intra_node_latency_s if intra else links.inter_node_latency_s
    n = max(group_size, 2)
    wire = _RING.get(kind, 1.0) * (n - 1) / n if kind in _RING else 1.0
    return calls * latency * math.log2(n) + wire * nbytes / bandwidth


def step_time(inputs: StepInputs, cluster: Cluster) -> StepTime:
    """The step's time on `cluster` (see the module docstring for each part)."""
    links = cluster.links
    compute = inputs.flops / (cluster.gpu_kind.peak_bf16_flops * EFFICIENCY[cluster.gpu])
    hidden_under_backward = hidden_under_all = exposed = total = 0.0
    for kind, size, link, nbytes, calls in inputs.collectives:
        if kind == "recv":
            continue  # a pipeline transfer is timed once, at its sender
        seconds = collective_seconds(kind, size, link, nbytes, calls, cluster)
        total += seconds
        data_parallel = size == inputs.data_parallel and size > 1 and inputs.overlap_comm
        if data_parallel and kind in _GRADIENT_REDUCTIONS:
            hidden_under_backward += seconds
        elif data_parallel and kind == "all_gather" and inputs.zero_stage == 3:
            hidden_under_all += seconds
        else:
            exposed += seconds
    # Reductions overlap backward (2/3 of the compute); stage 3's gathers share the whole pass.
    backward_left = max(0.0, 2 / 3 * compute - hidden_under_backward)
    exposed += max(0.0, hidden_under_backward - 2 / 3 * compute)
    exposed += max(0.0, hidden_under_all - backward_left - compute / 3)
    offload = inputs.host_optimizer_bytes / 2 / links.host_bw
    offload += 2 * inputs.nvme_optimizer_bytes / links.nvme_bw
    bubble = compute * (inputs.pipeline_stages - 1) / max(inputs.micro_batches, 1)
    return StepTime(compute, total, exposed, offload, bubble)
