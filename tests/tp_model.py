"""A tiny GPT split by automatic tensor parallelism (attention q/k/v and the first MLP linear by
columns, the output projections by rows), its single-process fp32 reference, and the training
functions the 3D tests run on every rank of a `RankPool`."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import shardspeed
from shardspeed.checkpoint.format import Split
from shardspeed.comm import Topology
from shardspeed.comm.topology import PipeModelDataParallelTopology
from shardspeed.pipe import LayerSpec, PipelineModule
from shardspeed.tensor_parallel import auto_tensor_parallel

VOCAB, DIM, SEQ, HEADS, BLOCKS = 32, 16, 8, 4, 2
HEAD_DIM = DIM // HEADS
LR, STEPS, MICRO = 0.01, 5, 2
# DeepSpeed's partition_config: parameter-name patterns and how to split their linears.
LAYER_SPECS = [
    {"patterns": [r"attn\.(q|k|v)\.weight$", r"fc1\.weight$"], "partition_type": "column"},
    {"patterns": [r"attn\.proj\.weight$", r"fc2\.weight$"], "partition_type": "row"},
]
POLICY = {"column": [r"^.*attn\.(q|k|v)$", r"^.*fc1$"], "row": [r"^.*attn\.proj$", r"^.*fc2$"]}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # No q/k biases: the key bias gets a zero gradient in exact arithmetic, and Adam turns
        # rounding noise there into full steps that no two summation orders agree on.
        self.q, self.k = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.v, self.proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # -1: the heads this rank holds
            return y.view(b, t, -1, HEAD_DIM).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        return self.proj(att.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.tokens = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tokens.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1))


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def reference(global_size: int) -> dict[str, torch.Tensor]:
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        ids, labels = global_batch(step, global_size)
        loss_fn(model(ids), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def config(dp: int, gas: int = 1, **extra: Any) -> dict:
    return {
        "train_batch_size": MICRO * dp * gas,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        **extra,
    }


def micro_batches(step: int, dp: int, dp_rank: int, gas: int):
    """This replica's micro-batches of the step's global batch of MICRO * dp * gas sequences."""
    ids, labels = global_batch(step, MICRO * dp * gas)
    for m in range(gas):
        rows = slice((m * dp + dp_rank) * MICRO, (m * dp + dp_rank + 1) * MICRO)
        yield ids[rows], labels[rows]


def local_params(model: nn.Module, tp: int) -> dict[str, tuple[torch.Tensor, Split | None]]:
    """Each parameter this rank holds, with how it is split (None: whole)."""
    out = {}
    for name, p in model.named_parameters():
        split = None
        if getattr(p, "tensor_model_parallel", False) and tp > 1:
            split = Split(p.partition_dim, tp, getattr(p, "partition_stride", 1))
        out[name] = (p.detach().clone(), split)
    return out


def train_tp(
    tp: int,
    zero: int = 0,
    global_size: int | None = None,
    save: str | None = None,
    load: str | None = None,
    tp_model_init: bool = False,
    keep_engine: bool = False,
) -> Any:
    """GPT through `initialize` with `tensor_parallel.autotp_size` tp, data parallel over the
    rest, global batches of `global_size` sequences (default: one micro-batch per replica).
    `save` checkpoints after step 3; `load` resumes from one. With `keep_engine`, returns the
    engine rather than this rank's parameters."""
    dp = torch.distributed.get_world_size() // tp
    gas = (global_size or MICRO * dp) // (MICRO * dp)
    model = GPT()
    autotp = {"autotp_size": tp, "partition_config": {"layer_specs": LAYER_SPECS}} if tp > 1 else {}
    if tp_model_init:  # DeepSpeed's entry point records the size; initialize splits
        model = shardspeed.tp_model_init(model, tp, torch.float32)
        autotp.pop("autotp_size")
    engine, *_ = shardspeed.initialize(
        model=model,
        config=config(dp, gas, zero_optimization={"stage": zero}, tensor_parallel=autotp),
    )
    if load is not None:
        engine.load_checkpoint(load)
    for step in range(engine.global_steps, STEPS):
        for ids, labels in micro_batches(step, dp, engine.topology.dp_rank, gas):
            engine.backward(loss_fn(engine(ids), labels))
            engine.step()
        if save is not None and step == 2:
            engine.save_checkpoint(save)
    if keep_engine:
        return engine
    return {
        "stage": 0,
        "tp_rank": engine.topology.tp_rank,
        "dp_rank": engine.topology.dp_rank,
        "params": local_params(model, tp),
    }


def join(results: list[dict]) -> dict[str, torch.Tensor]:
    """Whole parameters from the ranks of data-parallel replica 0, stage by stage (tensor ranks
    joined in order; replicated parameters must agree across tensor ranks exactly)."""
    whole = {}
    for stage in sorted({r["stage"] for r in results}):
        ranks = sorted(
            (r for r in results if r["dp_rank"] == 0 and r["stage"] == stage),
            key=lambda r: r["tp_rank"],
        )
        for name, (value, split) in ranks[0]["params"].items():
            if split is None:
                for other in ranks[1:]:
                    assert torch.equal(other["params"][name][0], value), name
                whole[name] = value
            else:
                whole[name] = split.join([r["params"][name][0] for r in ranks])
    return whole


# -- tensor x pipeline ---------------------------------------------------------------------------


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids)


class SplitBlock(nn.Module):
    """A `Block` whose linears are split over the mesh's tensor group when it is built."""

    def __init__(self, mesh: PipeModelDataParallelTopology) -> None:
        super().__init__()
        self.block = Block()
        auto_tensor_parallel(self.block, Topology.from_mesh(mesh).tp_group, policy=POLICY)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def pipeline_reference(global_size: int) -> dict[str, torch.Tensor]:
    layers = _reference_layers()
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    for step in range(STEPS):
        ids, labels = global_batch(step, global_size)
        loss_fn(model(ids), labels).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return {_pipe_name(n): p.detach().clone() for n, p in model.named_parameters()}


def _reference_layers() -> list[nn.Module]:
    layers = []
    for index, make in enumerate([Embed, *[Block] * BLOCKS, Head]):
        torch.manual_seed(100 + index)
        layers.append(make())
    return layers


def _pipe_name(name: str) -> str:
    index, rest = name.split(".", 1)  # a SplitBlock keeps its Block under `.block`
    return f"{index}.block.{rest}" if 0 < int(index) <= BLOCKS else name


def train_tp_pipe(tp: int, stages: int, gas: int = 2, **extra: Any) -> dict:
    """The GPT as a PipelineModule over a pipe x data x tensor mesh, blocks split over tensor."""
    world = torch.distributed.get_world_size()
    dp = world // (tp * stages)
    mesh = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=dp)
    model = PipelineModule(
        [LayerSpec(Embed), *[LayerSpec(SplitBlock, mesh)] * BLOCKS, LayerSpec(Head)],
        topology=mesh,
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=100,
        partition_method="uniform",
    )
    engine, *_ = shardspeed.initialize(model=model, config=config(dp, gas, **extra))
    for step in range(STEPS):
        engine.train_batch(micro_batches(step, dp, engine.topology.dp_rank, gas))
    return {
        "tp_rank": engine.topology.tp_rank,
        "dp_rank": engine.topology.dp_rank,
        "stage": engine.stage_id,
        "params": local_params(model, tp),
    }


class MegatronMpu:
    """A user's own Megatron-style mpu over groups the script made itself."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology

    def get_model_parallel_rank(self) -> int:
        return self.topology.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.topology.tp_world_size

    def get_model_parallel_group(self) -> Any:
        return self.topology.tp_group

    def get_data_parallel_rank(self) -> int:
        return self.topology.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.topology.dp_world_size

    def get_data_parallel_group(self) -> Any:
        return self.topology.dp_group


def train_with_mpu(tp: int) -> dict:
    """The script splits the model itself and passes its mpu, as Megatron-DeepSpeed does."""
    world = torch.distributed.get_world_size()
    dp = world // tp
    groups = Topology.from_mesh(PipeModelDataParallelTopology(1, tp, dp))
    model = auto_tensor_parallel(GPT(), groups.tp_group, policy=POLICY)
    engine, *_ = shardspeed.initialize(model=model, mpu=MegatronMpu(groups), config=config(dp))
    for step in range(STEPS):
        for ids, labels in micro_batches(step, dp, groups.dp_rank, 1):
            engine.backward(loss_fn(engine(ids), labels))
            engine.step()
    return {
        "stage": 0,
        "tp_rank": groups.tp_rank,
        "dp_rank": groups.dp_rank,
        "params": local_params(model, tp),
    }
