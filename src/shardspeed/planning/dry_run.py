"""A dry run at real size: `shardspeed.initialize` and training steps as chosen ranks of the full
world, on torch's fake process group with meta tensors.

Nothing here models ZeRO, tensor, pipeline, expert or sequence parallelism: each rank runs the real
path (the mesh and its groups, the shard plan and stores, expert placement, the pipeline partition
and schedule), where collectives return at once without moving data and tensors are shapes. What a
rank holds is read from the same accounting `engine.memory_breakdown()` uses, what it sends from the
same counters (`shardspeed.comm.comm_volume`), its compute from torch's FLOP counter over the step
it ran. `measure_rank` is the part a real run shares, so a test can hold the two side by side.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from .. import comm
from ..autotuning.step_time import StepInputs, StepTime, step_time
from ..autotuning.systems import Cluster
from ..config import read_config_source
from ..config.errors import ConfigError
from ..pipe import PipelineModule
from ..pipe.p2p import ActivationShapesUnknown, forget_fake_wire
from ..runtime.api import initialize
from ..runtime.sequence_parallel.plan import current_plan
from ..runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, shard_batch
from ..zero.accounting import memory_places, saved_activation_bytes
from .attention import flash_on_meta
from .models import ModelSource, build_model, causal_lm_batch, hf_config

# A micro-batch for a rank: (micro-batch size, sequence length, device) -> what the engine takes.
BatchFn = Callable[[int, int, torch.device], Any]

MEMORY_KINDS = ("parameters", "gradients", "optimizer_states", "buffers", "activations", "gathered")


@dataclass(frozen=True)
class Collective:
    """The calls of one collective in one group during a step, and their payload bytes (the
    counters' measure: a reduce-scatter's input, an all-gather's output)."""

    kind: str
    group_size: int
    link: str
    bytes: int
    count: int


@dataclass
class RankPlan:
    """What one rank holds and does. `memory`: for each of `MEMORY_KINDS`, bytes by place
    ("device", "host", "nvme"); optimizer states include the fp32 master weights (the ZeRO paper's
    K); activations are what one micro-batch's forward keeps for backward, times the micro-batches
    a pipeline stage holds at once; gathered is stage 3's most whole parameters alive at one time.
    `collectives` are one training step's (the last step run), `startup` those of `initialize`."""

    rank: int
    coordinates: dict[str, int]
    memory: dict[str, dict[str, int]]
    collectives: list[Collective]
    startup: list[Collective]
    flops_per_step: float
    activations_per_micro_batch: int

    def bytes_at(self, place: str) -> int:
        return sum(where.get(place, 0) for where in self.memory.values())


@dataclass
class DryRun:
    """The answer: the cluster and layout asked about and the reported ranks."""

    cluster: Cluster
    layout: dict[str, Any]
    parameters: int
    ranks: list[RankPlan] = field(default_factory=list)

    def over_memory(self) -> list[tuple[int, int]]:
        """(rank, bytes over the GPU's memory) for each reported rank that does not fit."""
        limit = self.cluster.gpu_kind.memory_bytes
        return [
            (plan.rank, plan.bytes_at("device") - limit)
            for plan in self.ranks
            if plan.bytes_at("device") > limit
        ]

    def step_time(self, plan: RankPlan) -> StepTime:
        """The step-time model (`autotuning.step_time`) over what `plan`'s rank measured."""
        layout = self.layout
        return step_time(
            StepInputs(
                flops=plan.flops_per_step,
                collectives=[
                    (c.kind, c.group_size, c.link, c.bytes, c.count) for c in plan.collectives
                ],
                data_parallel=layout["data_parallel"] * layout["sequence_parallel"],
                zero_stage=layout["zero_stage"],
                overlap_comm=layout["overlap_comm"],
                pipeline_stages=layout["pipeline_parallel"],
                micro_batches=layout["gradient_accumulation_steps"],
                host_optimizer_bytes=plan.memory["optimizer_states"]["host"],
                nvme_optimizer_bytes=plan.memory["optimizer_states"]["nvme"],
            ),
            self.cluster,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.layout["train_batch"] * self.layout["seq_len"]

    def to_dict(self) -> dict[str, Any]:
        """What `shardspeed plan --json` prints: per reported rank its memory (each kind's bytes
        and where they live), the step's collectives and the step time by part."""
        times = {plan.rank: self.step_time(plan) for plan in self.ranks}
        slowest = max(times.values(), key=lambda t: t.total)
        return {
            "cluster": dataclasses.asdict(self.cluster) | {"world_size": self.cluster.world_size},
            "layout": self.layout,
            "parameters": self.parameters,
            "memory": {
                str(plan.rank): {
                    kind: {"bytes": sum(where.values()), **where}
                    for kind, where in plan.memory.items()
                }
                for plan in self.ranks
            },
            "collectives": {
                str(plan.rank): [dataclasses.asdict(c) for c in plan.collectives]
                for plan in self.ranks
            },
            "startup_collectives": {
                str(plan.rank): [dataclasses.asdict(c) for c in plan.startup] for plan in self.ranks
            },
            "flops_per_step": {str(plan.rank): plan.flops_per_step for plan in self.ranks},
            "step_time": {str(rank): t.as_dict() for rank, t in times.items()},
            "tokens_per_second": self.tokens_per_step / slowest.total,
            "over_memory": [{"rank": r, "bytes": b} for r, b in self.over_memory()],
        }


def dry_run(
    model: ModelSource,
    config: dict[str, Any] | str | os.PathLike,
    cluster: Cluster,
    ranks: Sequence[int] = (0,),
    seq_len: int = 2048,
    batch: BatchFn | None = None,
    steps: int = 2,
    backend: str = "nccl",
    activation_checkpointing: bool = False,
) -> DryRun:
    """Run `initialize` and `steps` training steps as each of `ranks` of `cluster`'s world, one at
    a time in this process, on torch's fake process group with the model on the meta device.

    `model`: a Hugging Face config (a preset name, a `config.json`, a dict or config object) built
    as a causal LM, or a function that returns the user's module (called under the meta device).
    `batch` makes a micro-batch (default: token ids and labels for a causal LM). The last step is
    the one reported: the first may do one-time work. Config errors and refused combinations are
    raised as `initialize` raises them. `backend`: whose choices the run makes where shardspeed
    chooses per backend ("nccl" as on GPUs; "gloo" to match a CPU run).
    `activation_checkpointing`: a Hugging Face model's own (`gradient_checkpointing_enable`), as a
    training script switches it on.
    """
    if isinstance(config, (str, os.PathLike)):
        config = read_config_source(os.fspath(config))
    _refuse_nvme_offload(config)
    if batch is None:
        if hf_config(model) is None:
            raise ValueError("a dry run of your own module needs batch=: a function that makes a "
                             "micro-batch from (micro_batch, seq_len, device)")  # fmt: skip
        batch = causal_lm_batch
    for rank in ranks:
        if not 0 <= rank < cluster.world_size:
            raise ValueError(
                f"rank {rank} is not in a world of {cluster.world_size} ranks "
                f"({cluster.nodes} nodes x {cluster.gpus_per_node} GPUs)"
            )
    forget_fake_wire()

    def run(rank: int, waiting: tuple[int, ...] = ()) -> tuple[RankPlan, dict[str, Any], int]:
        """`rank`'s plan, its layout and the model's size. A later pipeline stage needs the
        activation shapes its sender's run leaves (`pipe.p2p`): that rank runs first, unreported."""
        try:
            with fake_world(rank, cluster, backend):
                module = build_model(model)
                if activation_checkpointing:
                    module.gradient_checkpointing_enable()
                parameters = sum(p.numel() for p in module.parameters())
                with sequence_parallel_script(module, config) as mpu:
                    with _quiet(rank != ranks[0] or bool(waiting)):
                        engine, *_ = initialize(model=module, config=config, mpu=mpu)
                    plan = measure_rank(engine, cluster, batch, seq_len, steps)
                    return plan, layout_of(engine, seq_len), parameters
        except ActivationShapesUnknown as missing:
            if missing.sender in (*waiting, rank):
                raise  # each waits for the other: a schedule that sends both ways between stages
            run(missing.sender, (*waiting, rank))
            return run(rank, waiting)

    result: DryRun | None = None
    for rank in ranks:
        plan, layout, parameters = run(rank)
        if result is None:
            result = DryRun(cluster, layout, parameters)
        result.ranks.append(plan)
    assert result is not None, "no rank was asked for"
    return result


def _refuse_nvme_offload(config: dict[str, Any]) -> None:
    """Offload to NVMe is not planned: its swap files are written for real (host memory is: the
    offloaded stores stay on the meta device and are counted as host memory)."""
    zero = config.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device == "nvme":
            raise ConfigError(
                f"'zero_optimization.{key}.device' is 'nvme': a dry run cannot plan offload to "
                "NVMe (its swap files would be written on this machine). Plan it with device "
                f"'cpu': what goes to NVMe is then the reported host bytes of "
                + ("optimizer_states" if key == "offload_optimizer" else "parameters")
                + " on each rank"
            )


@contextmanager
def sequence_parallel_script(module: Any, config: dict[str, Any]) -> Iterator[Any]:
    """What a training script does before `initialize` when `config` asks for sequence
    parallelism ('sequence_parallel_size' or 'sequence_parallel.size' over 1) and `module` is a
    Hugging Face model: ALST's `UlyssesSPAttentionHF.register_with_transformers` for the model's
    attention implementation. Yields the mpu to give `initialize` (None otherwise); transformers'
    attention function is put back after. The batches are cut by `measure_rank`."""
    section = config.get("sequence_parallel") or {}
    size = config.get("sequence_parallel_size") or section.get("size") or 1
    attention = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if size == 1 or attention is None or section.get("enabled") is False:
        yield None
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = ALL_ATTENTION_FUNCTIONS[attention]
    micro = config.get("train_micro_batch_size_per_gpu", 1)
    try:
        yield UlyssesSPAttentionHF.register_with_transformers(module, attention, size, micro)
    finally:
        ALL_ATTENTION_FUNCTIONS[attention] = before


def layout_of(engine: Any, seq_len: int) -> dict[str, Any]:
    """The layout the engine runs: parallel sizes (and a pipeline's partition), ZeRO stage,
    offload, batch."""
    topo = engine.topology
    config = engine.run_config
    zero = config.zero_optimization
    return {
        "data_parallel": topo.dp_world_size,
        "tensor_parallel": topo.tp_world_size,
        "pipeline_parallel": topo.num_stages,
        # The layer index where each stage starts (and where the last ends).
        "pipeline_partition": list(engine.module.parts)
        if isinstance(engine.module, PipelineModule)
        else None,
        "sequence_parallel": topo.sp_world_size,
        "expert_parallel": max(engine.experts.ep_sizes, default=1),
        "zero_stage": zero.stage,
        "offload_optimizer": zero.offload_optimizer.device if zero.offload_optimizer else "none",
        "offload_param": zero.offload_param.device if zero.offload_param else "none",
        "overlap_comm": zero.overlap_comm is not False,
        "precision": config.precision,
        "micro_batch": engine.train_micro_batch_size_per_gpu(),
        "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
        "train_batch": engine.train_batch_size(),
        "seq_len": seq_len,
    }


def measure_rank(
    engine: Any, cluster: Cluster, batch: BatchFn, seq_len: int, steps: int = 2
) -> RankPlan:
    """This rank's plan from a live engine: start-up collectives (counted since the last reset),
    then `steps` training steps, the last one counted (collectives, FLOPs, activations)."""
    startup = _collectives(cluster)
    micro = engine.train_micro_batch_size_per_gpu()
    make = lambda: _sequence_slice(batch(micro, seq_len, engine.device), engine)  # noqa: E731
    # On meta tensors attention runs as a GPU's flash kernel (attention.py); real tensors as they are.
    kernels = flash_on_meta() if engine.device.type == "meta" else nullcontext()
    activations = [0]
    with kernels:
        for _ in range(steps - 1):
            train_step(engine, make)
        comm.reset_comm_volume()
        with FlopCounterMode(display=False) as flops:
            train_step(engine, make, activations)
    collectives = _collectives(cluster)
    comm.reset_comm_volume()
    places = memory_places(engine.optimizer, engine.module, engine.device, engine.untrained_shards)
    in_flight = _micro_batches_in_flight(engine)
    memory: dict[str, dict[str, int]] = {}
    for kind in MEMORY_KINDS:
        memory[kind] = {"device": 0, "host": 0, "nvme": 0}
    for kind, where in places.items():
        target = "optimizer_states" if kind == "master_weights" else kind
        memory[target]["device"] += where["device"]
        memory[target]["host"] += where["cpu"]
    swapped = getattr(engine.optimizer, "swapped", None)
    if swapped is not None:
        memory["optimizer_states"]["nvme"] = swapped.bytes_on_disk()
    memory["activations"]["device"] = activations[0] * in_flight
    sharded = getattr(engine.optimizer, "sharded_params", None)
    if sharded is not None:
        memory["gathered"]["device"] = sharded.peak_gathered_bytes
    topo = engine.topology
    return RankPlan(
        rank=topo.rank,
        coordinates={
            "data": topo.dp_rank,
            "tensor": topo.tp_rank,
            "pipeline": topo.stage,
            "sequence": topo.sp_rank,
        },
        memory=memory,
        collectives=collectives,
        startup=startup,
        flops_per_step=float(flops.get_total_flops()),
        activations_per_micro_batch=activations[0],
    )


def _sequence_slice(inputs: Any, engine: Any) -> Any:
    """With sequence parallelism, this rank's slice of a batch of whole sequences, cut as an ALST
    script cuts it (`shard_batch`: global positions, labels shifted before the cut, fed to the
    model as its labels); otherwise the batch as it is."""
    topo = engine.topology
    if topo.sp_world_size == 1:
        return inputs
    ids = inputs["input_ids"]
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    piece = shard_batch({"position_ids": positions, **inputs}, topo.sp_rank,
                        topo.sp_world_size, current_plan().ring_size(topo.sp_world_size))  # fmt: skip
    return {**piece, "labels": piece["shift_labels"]}


def train_step(engine: Any, make: Callable[[], Any], activations: list[int] | None = None) -> None:
    """One optimizer step as a training script takes it: `train_batch` for a pipeline, otherwise
    forward, backward and step for each micro-batch of the accumulation window. With
    `activations`, the first micro-batch's saved bytes are added to it."""
    if "train_batch" in engine._surface:
        # A pipeline runs the window's micro-batches itself; the first stage holds the most.
        window = engine.gradient_accumulation_steps()
        with _counting(engine, activations) as counted:
            engine.train_batch(data_iter=iter([make() for _ in range(window)]))
        if activations is not None:
            activations[0] = counted[0] // window
        return
    for micro in range(engine.gradient_accumulation_steps()):
        inputs = make()
        with _counting(engine, activations if micro == 0 else None) as counted:
            if isinstance(inputs, dict):
                out = engine(**inputs)
            elif isinstance(inputs, tuple):
                out = engine(*inputs)
            else:
                out = engine(inputs)
        if activations is not None and micro == 0:
            activations[0] = counted[0]
        loss = getattr(out, "loss", None)
        if loss is None:
            loss = out[0] if isinstance(out, tuple) else out
        engine.backward(loss)
        engine.step()


@contextmanager
def _counting(engine: Any, activations: list[int] | None) -> Iterator[list[int]]:
    if activations is None:
        yield [0]
        return
    with saved_activation_bytes(engine.module) as counted:
        yield counted


def _micro_batches_in_flight(engine: Any) -> int:
    """How many micro-batches' activations a rank holds at once: 1, or for a pipeline stage under
    1F1B the stages from it to the last (at most the window)."""
    topo = engine.topology
    if "train_batch" not in engine._surface:
        return 1
    return min(topo.num_stages - topo.stage, engine.gradient_accumulation_steps())


def _collectives(cluster: Cluster) -> list[Collective]:
    """The counters since the last reset, by collective, group size and link class."""
    merged: dict[tuple[str, int, str], list[int]] = {}
    for (kind, span), counts in comm.comm_volume(by_ranks=True).items():
        key = (kind, len(span), cluster.link_class(span))
        entry = merged.setdefault(key, [0, 0])
        entry[0] += counts["bytes"]
        entry[1] += counts["calls"]
    return [
        Collective(kind, size, link, nbytes, count)
        for (kind, size, link), (nbytes, count) in sorted(merged.items())
    ]


@contextmanager
def fake_world(rank: int, cluster: Cluster, backend: str = "nccl") -> Iterator[None]:
    """This process as `rank` of `cluster`'s world on torch's fake process group (collectives
    return at once, nothing moves), making `backend`'s choices, with torchrun's environment to
    match; all undone after."""
    if dist.is_initialized():
        raise RuntimeError(
            "a dry run starts its own (fake) process group: run it in a process that has none "
            "(not under torchrun or the shardspeed launcher)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(cluster.world_size),
        "LOCAL_RANK": str(rank % cluster.gpus_per_node),
        "LOCAL_WORLD_SIZE": str(cluster.gpus_per_node),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cluster.world_size)
    comm.reset_comm_volume()
    comm.stand_in_for(backend)
    try:
        yield
    finally:
        dist.destroy_process_group()
        comm.reset_comm_volume()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _quiet(quiet: bool) -> Iterator[None]:
    """The start-up log once: later ranks' `initialize` logs only warnings."""
    logger = logging.getLogger("shardspeed")
    level = logger.level
    if quiet:
        logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


__all__ = [
    "MEMORY_KINDS",
    "Collective",
    "DryRun",
    "RankPlan",
    "dry_run",
    "fake_world",
    "layout_of",
    "measure_rank",
    "sequence_parallel_script",
    "train_step",
]
