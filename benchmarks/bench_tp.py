"""Tensor parallelism on 2 ranks vs data and pipeline parallelism, and activation checkpointing.

One invocation measures, on the GPT of bench_pipe.py (8 transformer blocks, d_model 256, seq 128,
vocab 4096, tied embedding and head; its attention and MLP linears named q/k/v/o_proj and
fc1/fc2 so that automatic tensor parallelism can split them) and the same global batch (16
sequences a step), at world size 2 (gloo on CPU), fp32, AdamW, gradient clipping 1.0:

  shardspeed TP2 (`tensor_parallel.autotp_size` 2, data parallel 1; with a partition_config),
  DeepSpeed AutoTP (the same config) where it runs,
  shardspeed DP2 (ZeRO stage 0), torch DDP, torch FSDP2, DeepSpeed DP (ZeRO stage 0),
  shardspeed PP2 (PipelineModule, 2 stages, 1F1B, m=4),
  and activation checkpointing (each block under a checkpoint function): shardspeed DP2 and TP2
  with `shardspeed.checkpointing.checkpoint`, TP2 also with
  `activation_checkpointing.partition_activations`, DDP with torch's checkpoint, DeepSpeed DP with
  `deepspeed.checkpointing.checkpoint`;

and reports tokens/s with ratios, ms/step, per rank the parameters held, the model-state bytes
(shardspeed: `engine.memory_breakdown()`), the activation bytes kept for backward (peak, counted
through `torch.autograd.graph.saved_tensors_hooks`) and the peak RSS, the first-step loss of
every mode against shardspeed DP's, and what checkpointing saves and costs. The script is both
the orchestrator and the worker: every measured run is
``python -m torch.distributed.run ... bench_tp.py --worker MODE``.

    .venv/bin/python benchmarks/bench_tp.py --smoke      # every mode once, 1+2 steps
    .venv/bin/python benchmarks/bench_tp.py              # measure, print the tables
    .venv/bin/python benchmarks/bench_tp.py --write      # ... and update BENCHMARKS.md

See benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

import bench_pipe
import common
from bench_pipe import BASE_SEED, MIB, N_BLOCKS, Embedding, global_batches, head, loss_fn, med
from common import BENCH_MD, CLIP, D_MODEL, LR, N_HEADS, SEQ, VOCAB, ratio_text, shardspeed_source

HERE = Path(__file__).resolve()
SECTION_TITLE = (
    "## Tensor parallelism (2 ranks) vs data and pipeline parallelism, and activation checkpointing"
)
WORLD = 2
HEAD_DIM = D_MODEL // N_HEADS
PIPE_M = 4  # micro-batches of the pipeline mode (1F1B)

# DeepSpeed's tensor_parallel.partition_config (parameter-name patterns), given verbatim to both
# libraries: q/k/v and fc1 split by columns (outputs), o_proj and fc2 by rows (inputs).
LAYER_SPECS = [
    {"patterns": [r".*\.(q|k|v)_proj\.weight$", r".*\.fc1\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.o_proj\.weight$", r".*\.fc2\.weight$"], "partition_type": "row"},
]


@dataclass(frozen=True)
class Mode:
    lib: str  # "ours", "deepspeed", "ddp", "fsdp2"
    kind: str  # "tp", "dp", "pp"
    ckpt: str | None = None  # checkpoint function: "ours", "torch", "deepspeed"
    partition: bool = False  # activation_checkpointing.partition_activations
    what: str = ""


MODES: dict[str, Mode] = {
    "ours_tp": Mode("ours", "tp", what="shardspeed TP2: `tensor_parallel.autotp_size` 2, dp 1"),
    "ours_tp_ckpt": Mode(
        "ours", "tp", "ours", what="shardspeed TP2, each block under shardspeed's checkpoint"
    ),
    "ours_tp_ckpt_part": Mode(
        "ours",
        "tp",
        "ours",
        True,
        what="shardspeed TP2, checkpointed blocks, `activation_checkpointing.partition_activations`",
    ),
    "deepspeed_tp": Mode("deepspeed", "tp", what="DeepSpeed AutoTP 2 (`autotp_size` 2), dp 1"),
    "ours_dp": Mode("ours", "dp", what="shardspeed DP2, ZeRO stage 0"),
    "ours_dp_ckpt": Mode(
        "ours", "dp", "ours", what="shardspeed DP2, each block under shardspeed's checkpoint"
    ),
    "ddp": Mode("ddp", "dp", what="torch DistributedDataParallel"),
    "ddp_ckpt": Mode(
        "ddp", "dp", "torch", what="torch DDP, each block under torch's checkpoint (non-reentrant)"
    ),
    "fsdp2": Mode("fsdp2", "dp", what="torch FSDP2 (fully_shard per block and on the root)"),
    "deepspeed_dp": Mode("deepspeed", "dp", what="DeepSpeed DP2, ZeRO stage 0"),
    "deepspeed_dp_ckpt": Mode(
        "deepspeed",
        "dp",
        "deepspeed",
        what="DeepSpeed DP2, each block under `deepspeed.checkpointing.checkpoint`",
    ),
    "ours_pp": Mode(
        "ours", "pp", what=f"shardspeed PP2: PipelineModule, 2 stages, 1F1B, m={PIPE_M}"
    ),
}
# (without, with) checkpointing: what checkpointing saves and costs.
CKPT_PAIRS = [
    ("ours_dp", "ours_dp_ckpt"),
    ("ddp", "ddp_ckpt"),
    ("deepspeed_dp", "deepspeed_dp_ckpt"),
    ("ours_tp", "ours_tp_ckpt"),
    ("ours_tp_ckpt", "ours_tp_ckpt_part"),
    ("ours_tp", "ours_tp_ckpt_part"),
]


# --------------------------------------------------------------------------------------------
# The model: bench_pipe's GPT with q/k/v/o_proj and fc1/fc2 linears
# --------------------------------------------------------------------------------------------

_REGION = ["other"]  # where the model is, for the saved-bytes meter: "blocks" or "other"


@contextlib.contextmanager
def region(name: str):
    outer, _REGION[0] = _REGION[0], name
    try:
        yield
    finally:
        _REGION[0] = outer


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """An nn.Linear holding copies of `weight` and `bias` (built on meta: no random draws)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    layer.weight = nn.Parameter(weight.detach().clone())
    layer.bias = nn.Parameter(bias.detach().clone())
    return layer


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v and output projections. Heads are counted from
    the width (-1), so the module runs unchanged on the heads a tensor-parallel rank holds."""

    def __init__(self, qkv: nn.Linear, proj: nn.Linear) -> None:
        super().__init__()
        d = D_MODEL
        w, b = qkv.weight, qkv.bias
        self.q_proj = _linear(w[:d], b[:d])
        self.k_proj = _linear(w[d : 2 * d], b[d : 2 * d])
        self.v_proj = _linear(w[2 * d :], b[2 * d :])
        self.o_proj = _linear(proj.weight, proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, HEAD_DIM).transpose(1, 2)

        a = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True
        )
        return self.o_proj(a.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear) -> None:
        super().__init__()
        self.fc1 = _linear(fc1.weight, fc1.bias)
        self.fc2 = _linear(fc2.weight, fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """bench_pipe's block (same random draws, so the same weights under the same seed) with its
    fused qkv split into q_proj, k_proj, v_proj. `checkpoint_fn` (class-wide, set per mode): run
    the block under it, e.g. `shardspeed.checkpointing.checkpoint`."""

    checkpoint_fn = None

    def __init__(self) -> None:
        super().__init__()
        src = bench_pipe.Block()
        self.ln1, self.ln2 = src.ln1, src.ln2
        self.attn = Attention(src.qkv, src.proj)
        self.mlp = MLP(src.fc1, src.fc2)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with region("blocks"):
            fn = Block.checkpoint_fn
            return self.body(x) if fn is None else fn(self.body, x)


class GPT(nn.Module):
    """bench_pipe.GPT with these blocks: layer i built under torch.manual_seed(BASE_SEED + i)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED + 0)
        self.embed = Embedding()
        blocks = []
        for i in range(N_BLOCKS):
            torch.manual_seed(BASE_SEED + 1 + i)
            blocks.append(Block())
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(BASE_SEED + 1 + N_BLOCKS)
        self.ln_f = nn.LayerNorm(D_MODEL)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return loss_fn(head(self.embed, self.ln_f(x)), labels)


def layer_specs(pipe) -> list:
    """The GPT as pipeline layers (bench_pipe's, with these blocks)."""
    embed = dict(tied_weight_attr="tokens.weight")
    return [
        pipe.TiedLayerSpec("embed", Embedding, **embed),
        *[pipe.LayerSpec(Block) for _ in range(N_BLOCKS)],
        pipe.LayerSpec(nn.LayerNorm, D_MODEL),
        pipe.TiedLayerSpec("embed", Embedding, forward_fn=head, **embed),
    ]


def tp_config(global_batch: int, partition: bool = False) -> dict:
    """The config of the tensor-parallel modes (both libraries): one replica, the global batch
    as its micro batch."""
    cfg = common.ds_config(global_batch, stage=0)
    cfg["tensor_parallel"] = {
        "autotp_size": WORLD,
        "partition_config": {"use_default_specs": False, "layer_specs": LAYER_SPECS},
    }
    if partition:
        cfg["activation_checkpointing"] = {"partition_activations": True}
    return cfg


def pipe_config(global_batch: int) -> dict:
    cfg = common.ds_config(global_batch // PIPE_M, stage=0)
    cfg["gradient_accumulation_steps"] = PIPE_M
    cfg["pipeline"] = {"schedule": "1f1b"}
    return cfg


# --------------------------------------------------------------------------------------------
# Saved activations: what autograd keeps for backward
# --------------------------------------------------------------------------------------------


class _Held:
    """What the pack hook hands autograd: the tensor, and a release of its storage when autograd
    drops it (after the backward that used it, or with the graph)."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedBytes, key: int, tensor: torch.Tensor) -> None:
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter.release(self.key)


class SavedBytes:
    """Bytes of the tensors autograd keeps for backward, each storage counted once, parameters
    left out (they are model states): the most alive at once, split by the model region that
    saved them ("blocks": inside a transformer block, or the inputs a checkpoint keeps of it;
    "other": embedding, final norm, head, loss). `note(t)` counts a tensor kept some other way
    (DeepSpeed's checkpoint keeps its inputs on its autograd context, which saved-tensor hooks do
    not see) until the end of the measurement."""

    def __init__(self, params) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list] = {}  # storage pointer: [references, bytes, region]
        self.now = {"blocks": 0, "other": 0}
        self.peak = 0
        self.peak_by_region = dict(self.now)
        self.noted = 0

    def _add(self, t: torch.Tensor) -> int | None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.exclude or nbytes == 0:
            return None
        entry = self.live.get(key)
        if entry is not None:
            entry[0] += 1
            return key
        where = _REGION[0]
        self.live[key] = [1, nbytes, where]
        self.now[where] += nbytes
        total = sum(self.now.values())
        if total > self.peak:
            self.peak, self.peak_by_region = total, dict(self.now)
        return key

    def release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            self.now[entry[2]] -= entry[1]

    def pack(self, t: torch.Tensor):
        key = self._add(t)
        return t if key is None else _Held(self, key, t)

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def note(self, t: torch.Tensor) -> None:
        if self._add(t) is not None:
            self.noted += t.untyped_storage().nbytes()

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def live_bytes(self) -> int:
        return sum(v[1] for v in self.live.values())


METER: list[SavedBytes | None] = [None]


def meter_hooks():
    return METER[0].hooks() if METER[0] is not None else contextlib.nullcontext()


def deepspeed_checkpoint(function, x):
    """deepspeed.checkpointing.checkpoint, with its kept input reported to the meter (DeepSpeed
    keeps it on the autograd context, partitioned or not, where saved-tensor hooks do not see it:
    `note` counts what it keeps, the whole input unless partition_activations is on)."""
    import deepspeed

    if METER[0] is not None:
        METER[0].note(x)
    return deepspeed.checkpointing.checkpoint(function, x)


class CommCounter:
    """Calls and bytes of the torch.distributed collectives and point-to-point transfers made
    from Python while `active` (the functions are wrapped before shardspeed or DeepSpeed is
    imported, so both libraries' calls go through the wrappers; a collective that calls another
    counts once). `batch_isend_irecv` is counted per transfer (isend / irecv: `P2POp` checks that
    its op is torch's own function, so those two are not wrapped). DDP's reducer calls its
    all-reduces from C++ and is not seen."""

    NAMES = (
        "all_reduce",
        "all_gather_into_tensor",
        "all_gather_single",
        "all_gather",
        "reduce_scatter_tensor",
        "reduce_scatter_single",
        "broadcast",
        "send",
        "recv",
    )
    # The names a collective is reported under (torch 2.13's new names for the old ones).
    ALIASES: ClassVar[dict[str, str]] = {
        "all_gather_single": "all_gather_into_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor",
    }

    def __init__(self, dist) -> None:
        self.active = False
        self.depth = 0
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(self.ALIASES.get(name, name), fn))
        batch, isend = dist.batch_isend_irecv, dist.isend

        @functools.wraps(batch)
        def counted_batch(ops):
            if self.active and self.depth == 0:
                for op in ops:
                    name = "isend" if op.op is isend else "irecv"
                    self.calls[name] += 1
                    self.bytes[name] += op.tensor.numel() * op.tensor.element_size()
            self.depth += 1
            try:
                return batch(ops)
            finally:
                self.depth -= 1

        dist.batch_isend_irecv = counted_batch

    @staticmethod
    def _nbytes(args, kwargs) -> int:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                return value.numel() * value.element_size()
            if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
                return sum(t.numel() * t.element_size() for t in value)
        return 0

    def _wrap(self, name: str, fn):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.active and self.depth == 0:
                self.calls[name] += 1
                self.bytes[name] += self._nbytes(args, kwargs)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def current_rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def local_numel(params) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p._local_tensor if isinstance(p, DTensor) else p).numel() for p in params)


def worker(args) -> None:
    mode = args.worker
    spec = MODES[mode]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    comm = CommCounter(dist)  # before shardspeed or DeepSpeed binds any collective
    rank, world = common.worker_setup(args.threads)
    global_batch = args.micro_batch * world
    n_steps = args.warmup + args.steps
    batches = global_batches(n_steps + 1, global_batch)  # + 1: the measured step
    extra: dict = {"kind": spec.kind, "lib": spec.lib, "global_batch": global_batch}
    losses: list[torch.Tensor] = []

    if spec.ckpt == "ours":
        import shardspeed.checkpointing

        Block.checkpoint_fn = staticmethod(shardspeed.checkpointing.checkpoint)
    elif spec.ckpt == "torch":
        from torch.utils.checkpoint import checkpoint as torch_checkpoint

        def torch_ckpt(fn, x):
            return torch_checkpoint(fn, x, use_reentrant=False)

        Block.checkpoint_fn = staticmethod(torch_ckpt)
    elif spec.ckpt == "deepspeed":
        Block.checkpoint_fn = staticmethod(deepspeed_checkpoint)

    if spec.kind in ("dp", "tp"):
        model = GPT()
        extra["params_total"] = sum(p.numel() for p in model.parameters())
        if spec.kind == "dp":
            lo = rank * args.micro_batch
            batches = [
                (x[lo : lo + args.micro_batch], y[lo : lo + args.micro_batch]) for x, y in batches
            ]
            cfg = common.ds_config(args.micro_batch, stage=0)
        else:
            cfg = tp_config(global_batch, spec.partition)
        extra["config"] = cfg if spec.lib in ("ours", "deepspeed") else None
        if spec.lib in ("ddp", "fsdp2"):
            if spec.lib == "ddp":
                from torch.nn.parallel import DistributedDataParallel as DDP

                module = DDP(model)
            else:
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                module = model
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            params = list(model.parameters())

            def step(x, y):
                with meter_hooks():
                    loss = module(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                return loss

        else:
            if spec.lib == "ours":
                import shardspeed as lib
            else:
                import deepspeed as lib
            engine, *_ = lib.initialize(
                model=model, model_parameters=model.parameters(), config=cfg
            )
            if spec.ckpt == "deepspeed":
                lib.checkpointing.configure(None)  # after initialize: it needs DeepSpeed's comm
            params = list(engine.module.parameters())
            extra["optimizer"] = type(engine.optimizer).__name__
            inner = getattr(engine.optimizer, "optimizer", None)
            if inner is not None:
                extra["optimizer"] += f" over {type(inner).__name__}"
            if spec.kind == "tp":
                extra["split_layers"] = sorted(
                    {
                        f"{type(m).__name__}"
                        for n, m in engine.module.named_modules()
                        if n.startswith("blocks.0.") and n.count(".") == 3
                    }
                )

            def step(x, y):
                with meter_hooks():
                    loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
                return loss

    else:  # pipeline
        import shardspeed
        from shardspeed import pipe

        mb = global_batch // PIPE_M
        model = pipe.PipelineModule(
            layer_specs(pipe),
            num_stages=world,
            loss_fn=loss_fn,
            seed_layers=True,
            base_seed=BASE_SEED,
        )
        cfg = pipe_config(global_batch)
        extra["config"] = cfg
        engine, *_ = shardspeed.initialize(model=model, config=cfg)
        params = list(engine.module.parameters())
        extra["partition"] = model.partitions()
        extra["params_total"] = None

        def step(x, y):
            micro = [(x[i * mb : (i + 1) * mb], y[i * mb : (i + 1) * mb]) for i in range(PIPE_M)]
            with meter_hooks():
                loss = engine.train_batch(iter(micro))
            losses.append(loss.detach())
            return loss

    n_local = local_numel(params)
    rss_init = current_rss_mib()
    result = common.timed_run(
        step,
        batches[:n_steps],
        args,
        mode=mode,
        rank=rank,
        world=world,
        n_params=n_local,
        barrier=dist.barrier,
    )
    peak_train = common.peak_rss_mib()

    # One more step with the saved-tensor meter and the collective counter on (outside the
    # timed window).
    comm.active = True
    if spec.lib != "fsdp2":  # FSDP2's gathered weights are not module parameters: left out
        METER[0] = meter = SavedBytes(params)
        step(*batches[n_steps])
        METER[0] = None
        result["saved_peak"] = meter.peak
        result["saved_by_region"] = meter.peak_by_region
        result["saved_noted"] = meter.noted
        # After backward autograd should have released everything it kept (noted tensors stay).
        result["saved_left"] = meter.live_bytes() - meter.noted
    else:
        step(*batches[n_steps])
    comm.active = False
    result["comm_calls"], result["comm_bytes"] = dict(comm.calls), dict(comm.bytes)

    # Losses of the warm-up and timed steps: the pipeline returns the mean over the global batch,
    # tensor parallelism each rank the whole loss, data parallelism each rank its own (averaged
    # over the ranks here, after the timed window).
    loss_t = torch.stack(losses[:n_steps]).float()
    if spec.kind == "dp":
        dist.all_reduce(loss_t)
        loss_t /= world
    result["losses"] = loss_t.tolist()
    result["first_loss"], result["last_loss"] = result["losses"][0], result["losses"][-1]
    result["tokens_per_s"] = args.steps * global_batch * SEQ / result["elapsed_s"]
    result["params_local"] = n_local
    if spec.lib == "ours":
        mem = engine.memory_breakdown()
        result["model_state_bytes"] = mem["total"] - mem["buffers"]
        result["memory_breakdown"] = {k: mem[k] for k in ("parameters", "gradients")} | {
            "optimizer_states": mem.get("optimizer_states", 0),
            "master_weights": mem.get("master_weights", 0),
        }
    result.update(extra)
    result["rss_after_init_mib"] = rss_init
    result["peak_rss_train_mib"] = peak_train
    result["peak_rss_mib"] = common.peak_rss_mib()
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def rank_values(results, mode: str, fn) -> list:
    """fn(rank result) for each rank, median over rounds ([] where the mode has no run)."""
    runs = results.get((mode, WORLD)) or []
    if not runs:
        return []
    return [statistics.median(fn(run["ranks"][r]) for run in runs) for r in range(WORLD)]


def comparisons(modes) -> list:
    """Targets where both sides do the same thing (shardspeed against DeepSpeed, DDP, each the
    same technique); information across techniques."""
    rows = [
        ("ours_tp", "deepspeed_tp", 1.0, "shardspeed TP2 vs DeepSpeed AutoTP 2"),
        ("ours_dp", "ddp", 1.0, "shardspeed DP2 (stage 0) vs torch DDP"),
        ("ours_dp", "deepspeed_dp", 1.0, "shardspeed DP2 vs DeepSpeed DP2 (stage 0)"),
        ("ours_dp_ckpt", "ddp_ckpt", 1.0, "checkpointed: shardspeed DP2 vs torch DDP"),
        ("ours_dp_ckpt", "deepspeed_dp_ckpt", 1.0, "checkpointed: shardspeed DP2 vs DeepSpeed DP2"),
        ("ours_tp", "ours_dp", None, "shardspeed TP2 vs shardspeed DP2"),
        ("ours_tp", "ddp", None, "shardspeed TP2 vs torch DDP"),
        ("ours_tp", "fsdp2", None, "shardspeed TP2 vs torch FSDP2"),
        ("ours_tp", "deepspeed_dp", None, "shardspeed TP2 vs DeepSpeed DP2"),
        ("ours_tp", "ours_pp", None, "shardspeed TP2 vs shardspeed PP2"),
        ("ours_pp", "ours_dp", None, "shardspeed PP2 vs shardspeed DP2"),
        ("ours_pp", "ddp", None, "shardspeed PP2 vs torch DDP"),
        ("ours_dp", "fsdp2", None, "shardspeed DP2 vs torch FSDP2"),
    ]
    return common.comparisons_among(rows, modes, WORLD)


def throughput_table(results, modes) -> str:
    base = {b: med(results, b) for b in ("ddp", "fsdp2", "deepspeed_dp", "deepspeed_tp")}
    base["ours_dp"] = med(results, "ours_dp")
    lines = [
        "| mode | what runs | micro batch x ranks' batches | tokens/s (median) | ms/step | / DDP "
        "| / FSDP2 | / DeepSpeed DP | / DeepSpeed AutoTP | / shardspeed DP |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in modes:
        tps = med(results, mode)
        spec = MODES[mode]
        if tps is None:
            lines.append(f"| {mode} | {spec.what} | - | failed | - | - | - | - | - | - |")
            continue
        gb = results[(mode, WORLD)][0]["global_batch"]
        shape = {
            "dp": f"{gb // WORLD} per rank, 2 replicas",
            "tp": f"{gb}, the same on both ranks",
            "pp": f"{PIPE_M} x {gb // PIPE_M}, through 2 stages",
        }[spec.kind]
        lines.append(
            f"| {mode} | {spec.what} | {shape} | {tps:.0f} | {med(results, mode, 'step_ms'):.0f} | "
            + " | ".join(
                ratio_text(tps, base[b])
                for b in ("ddp", "fsdp2", "deepspeed_dp", "deepspeed_tp", "ours_dp")
            )
            + " |"
        )
    return "\n".join(lines)


def pair(values, fmt="{:.1f}", scale=1.0) -> str:
    return " / ".join(fmt.format(v / scale) for v in values) if values else "-"


def memory_table(results, modes) -> str:
    lines = [
        "| mode | parameters per rank (rank 0 / 1) | 16 B x parameters (MiB) | shardspeed model "
        "states, measured (MiB) | saved activations, peak (MiB, rank 0 / 1) | of which in the "
        "blocks | peak RSS per rank (MiB) | RSS growth in training (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        if not results.get((mode, WORLD)):
            continue
        params = rank_values(results, mode, lambda r: r["params_local"])
        states = rank_values(results, mode, lambda r: r.get("model_state_bytes") or 0)
        saved = rank_values(results, mode, lambda r: r.get("saved_peak", -1))
        blocks = rank_values(
            results, mode, lambda r: r.get("saved_by_region", {}).get("blocks", -1)
        )
        runs = results[(mode, WORLD)]
        rss = [max(run["ranks"][r]["peak_rss_mib"] for run in runs) for r in range(WORLD)]
        growth = rank_values(
            results, mode, lambda r: r["peak_rss_train_mib"] - r["rss_after_init_mib"]
        )
        saved_text = pair(saved, scale=MIB) if min(saved) >= 0 else "not measured"
        blocks_text = pair(blocks, scale=MIB) if min(blocks) >= 0 else "-"
        lines.append(
            f"| {mode} | {pair(params, '{:.2f}M', 1e6)} | {pair(params, scale=MIB / 16)} | "
            + (pair(states, scale=MIB) if any(states) else "-")
            + f" | {saved_text} | {blocks_text} | {pair(rss, '{:.0f}')} | "
            f"{pair(growth, '{:.0f}')} |"
        )
    return "\n".join(lines)


def comm_text(r: dict) -> str:
    calls, nbytes = r.get("comm_calls") or {}, r.get("comm_bytes") or {}
    return ", ".join(
        f"{name} {calls[name]} x ({nbytes.get(name, 0) / MIB:.1f} MiB)" for name in sorted(calls)
    )


def comm_table(results, modes) -> str:
    lines = [
        "| mode | collectives and transfers in one step, rank 0 (calls, bytes) | rank 1 |",
        "|---|---|---|",
    ]
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        ranks = runs[0]["ranks"]
        texts = [comm_text(r) or "none seen" for r in ranks]
        if MODES[mode].lib == "ddp":
            texts = [t + " (DDP's gradient all-reduce runs in C++, not seen)" for t in texts]
        lines.append(f"| {mode} | {texts[0]} | {texts[1]} |")
    return "\n".join(lines)


def ckpt_rows(results, modes) -> list[dict]:
    rows = []
    for a, b in CKPT_PAIRS:
        if a not in modes or b not in modes:
            continue
        if not results.get((a, WORLD)) or not results.get((b, WORLD)):
            continue

        def rank0(mode, fn):
            return rank_values(results, mode, fn)[0]

        row = {"without": a, "with": b}
        for key, fn in (
            ("blocks", lambda r: r.get("saved_by_region", {}).get("blocks")),
            ("saved", lambda r: r.get("saved_peak")),
            ("growth", lambda r: r["peak_rss_train_mib"] - r["rss_after_init_mib"]),
            ("rss", lambda r: r["peak_rss_mib"]),
        ):
            try:
                row[key] = (rank0(a, fn), rank0(b, fn))
            except TypeError:  # not measured
                row[key] = None
        row["ms"] = (med(results, a, "step_ms"), med(results, b, "step_ms"))
        rows.append(row)
    return rows


def ckpt_table(rows) -> str:
    lines = [
        "| without -> with | saved activations in the blocks (MiB, rank 0) | ratio | all saved "
        "activations (MiB) | peak RSS (MiB, median over rounds) | RSS growth in training (MiB) | "
        "ms/step | time ratio |",
        "|---|---|---:|---|---|---|---|---:|",
    ]

    def arrow(v, fmt="{:.1f}", scale=1.0):
        if v is None:
            return "not measured"
        return f"{fmt.format(v[0] / scale)} -> {fmt.format(v[1] / scale)}"

    for r in rows:
        blocks = r["blocks"]
        lines.append(
            f"| {r['without']} -> {r['with']} | {arrow(blocks, scale=MIB)} | "
            + (f"{blocks[1] / blocks[0]:.3f}" if blocks and blocks[0] else "-")
            + f" | {arrow(r['saved'], scale=MIB)} | {arrow(r['rss'], '{:.0f}')} | "
            f"{arrow(r['growth'], '{:.0f}')} | {arrow(r['ms'], '{:.0f}')} | "
            f"{r['ms'][1] / r['ms'][0]:.3f} |"
        )
    return "\n".join(lines)


def loss_checks(results, modes) -> tuple[list[str], bool]:
    """Every mode's first-step loss against shardspeed DP's (the same weights, the same batch:
    within 1e-4 relative), the largest difference over the run, and whether the loss falls."""
    lines, ok = [], True
    ref_runs = results.get(("ours_dp", WORLD)) or []
    ref = ref_runs[0]["losses"] if ref_runs else None
    for mode in modes:
        runs = results.get((mode, WORLD)) or []
        if not runs:
            continue
        losses = runs[0]["losses"]
        falls = losses[-1] < losses[0]
        ok &= falls
        text = f"{mode}: loss {losses[0]:.5f} -> {losses[-1]:.5f} over {len(losses)} steps"
        text += "" if falls else " (NOT falling)"
        if ref and mode != "ours_dp":
            first = abs(losses[0] - ref[0]) / abs(ref[0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
            within = first <= 1e-4
            ok &= within
            text += (
                f"; first-step loss vs shardspeed DP: {first:.1e} relative "
                f"({'within' if within else 'OUTSIDE'} 1e-4), largest over all steps {worst:.1e}"
            )
        lines.append(text)
    return lines, ok


def findings(results, modes, rows, n_params) -> list[str]:
    """What the figures say, computed from them."""
    out = []
    tp, dp, pp = (med(results, m) for m in ("ours_tp", "ours_dp", "ours_pp"))
    if tp and dp:
        parts = [f"shardspeed TP2 runs at {tp / dp:.2f}x shardspeed DP2's tokens/s"]
        if pp:
            parts.append(f"{tp / pp:.2f}x shardspeed PP2's")
        ddp = med(results, "ddp")
        if ddp:
            parts.append(f"{tp / ddp:.2f}x DDP's")

        def comm0(mode):
            runs = results.get((mode, WORLD)) or []
            r = runs[0]["ranks"][0] if runs else {}
            return (r.get("comm_calls") or {}).get("all_reduce", 0), (
                r.get("comm_bytes") or {}
            ).get("all_reduce", 0)

        (n_tp, b_tp), (n_dp, b_dp) = comm0("ours_tp"), comm0("ours_dp")
        out.append(
            "- Speed: "
            + ", ".join(parts)
            + ". Expected on this machine, where each rank has one core: every block costs a "
            "tensor-parallel rank 2 all-reduces of its [16, 128, 256] fp32 activations (2 MiB "
            "each) in forward (after o_proj and fc2) and 4 in backward (the input gradients of "
            "q_proj, k_proj, v_proj and fc1: this model's attention is not a class automatic "
            "tensor parallelism knows to feed q, k and v one input, so each layer enters the "
            "tensor region itself; DeepSpeed's LinearLayer does the same), blocking gloo "
            f"all-reduces that the compute waits for: measured {n_tp} all-reduces, "
            f"{b_tp / MIB:.0f} MiB, a step on a TP2 rank, against {n_dp} all-reduce of "
            f"{b_dp / MIB:.1f} MiB (the gradients) on a shardspeed DP2 rank. Each TP2 rank also "
            "computes everything outside the split linears on all 16 sequences by itself "
            "(embedding, layer norms, residuals, the tied head and its 4096-way softmax, the "
            "optimizer step on the replicated parameters), so only the split matmuls and "
            "attention are halved. Tensor parallelism is for layers that do not fit one device; "
            "its gain here is memory per rank, not speed."
        )
    p_tp = rank_values(results, "ours_tp", lambda r: r["params_local"])
    p_dp = rank_values(results, "ours_dp", lambda r: r["params_local"])
    if p_tp and p_dp:
        s_tp = rank_values(results, "ours_tp", lambda r: r.get("model_state_bytes") or 0)
        s_dp = rank_values(results, "ours_dp", lambda r: r.get("model_state_bytes") or 0)
        text = (
            f"- Memory: a TP2 rank holds {p_tp[0] / 1e6:.2f}M of the {n_params / 1e6:.2f}M "
            f"parameters ({p_tp[0] / n_params:.0%}): half of every block's linears, while the "
            "embedding (tied to the head, 1.08M), positions, layer norms and the row layers' "
            "biases stay whole on both ranks"
        )
        if s_tp and s_dp and s_tp[0] and s_dp[0]:
            text += (
                f"; its model states (engine.memory_breakdown()) are {s_tp[0] / MIB:.1f} MiB "
                f"against {s_dp[0] / MIB:.1f} MiB for a DP2 replica ({s_tp[0] / s_dp[0]:.2f}x)"
            )
        p_pp = rank_values(results, "ours_pp", lambda r: r["params_local"])
        if p_pp:
            text += (
                f"; a PP2 stage holds {p_pp[0] / 1e6:.2f}M / {p_pp[1] / 1e6:.2f}M (the tied "
                "embedding on both stages)"
            )
        sv_tp = rank_values(results, "ours_tp", lambda r: r.get("saved_peak"))
        sv_dp = rank_values(results, "ours_dp", lambda r: r.get("saved_peak"))
        if sv_tp and sv_dp:
            text += (
                f". Activations kept for backward: {sv_tp[0] / MIB:.1f} MiB on a TP2 rank "
                f"against {sv_dp[0] / MIB:.1f} MiB on a DP2 rank: a TP2 rank runs all 16 "
                "sequences (DP2: 8), with half the heads and half the MLP width, so the "
                "split layers' outputs are per rank what DP2's are, while everything kept whole "
                "(block inputs, layer norms, residuals, the logits of the head) is twice DP2's"
            )
        out.append(text + ".")
    for r in rows:
        if (r["without"], r["with"]) == ("ours_tp_ckpt", "ours_tp_ckpt_part") and r["blocks"]:
            b = r["blocks"]
            runs = results.get(("ours_tp_ckpt_part", WORLD)) or []
            calls = runs[0]["ranks"][0].get("comm_calls", {}) if runs else {}
            nbytes = runs[0]["ranks"][0].get("comm_bytes", {}) if runs else {}
            gathers = calls.get("all_gather_into_tensor", 0)
            out.append(
                f"- partition_activations: the checkpointed blocks of a TP2 rank keep "
                f"{b[0] / MIB:.1f} MiB whole and {b[1] / MIB:.1f} MiB partitioned "
                f"({b[0] / b[1]:.2f}x less): each rank keeps half of each block input (8 inputs "
                f"of 16 x {SEQ} x {D_MODEL} fp32 = 2 MiB each) and all-gathers the other half at "
                f"recompute ({gathers} all-gathers, "
                f"{nbytes.get('all_gather_into_tensor', 0) / MIB:.0f} MiB, a step). Step time "
                f"{r['ms'][0]:.0f} -> {r['ms'][1]:.0f} ms ({r['ms'][1] / r['ms'][0]:.2f}x). "
                "The rest of what the rank keeps (the logits of the head, 32 MiB, and the "
                "embedding's and final norm's tensors) is not checkpointed and stays whole, so "
                "the total falls by less than 2x."
            )
        if (r["without"], r["with"]) == ("ours_tp", "ours_tp_ckpt"):
            n = []
            for mode in (r["without"], r["with"]):
                runs = results.get((mode, WORLD)) or []
                n.append(runs[0]["ranks"][0].get("comm_calls", {}).get("all_reduce", 0))
            out.append(
                f"- Checkpointing under TP2: step time {r['ms'][0]:.0f} -> {r['ms'][1]:.0f} ms "
                f"({r['ms'][1] / r['ms'][0]:.2f}x), all-reduces {n[0]} -> {n[1]} a step: the "
                "recompute runs each block's forward again, including o_proj's all-reduce "
                "(torch's non-reentrant checkpoint, under shardspeed's, stops the recompute once "
                "the last tensor backward needs, fc2's input, is rebuilt, so fc2's all-reduce is "
                "not repeated)."
            )
    dp_rows = [r for r in rows if r["without"] in ("ours_dp", "ddp", "deepspeed_dp")]
    if dp_rows:
        out.append(
            "- Activation checkpointing on data parallelism (micro batch 8 per rank): "
            + "; ".join(
                f"{r['without']} -> {r['with']}: time x{r['ms'][1] / r['ms'][0]:.2f}"
                + (
                    f", activations kept {r['saved'][0] / MIB:.0f} -> {r['saved'][1] / MIB:.0f} MiB"
                    if r["saved"] and r["saved"][0]
                    else ""
                )
                + (
                    f", RSS growth in training {r['growth'][0]:.0f} -> {r['growth'][1]:.0f} MiB"
                    if r["growth"]
                    else ""
                )
                for r in dp_rows
            )
            + ". A checkpointed block keeps only its input (1 MiB) instead of about 16 MiB of "
            "intermediate tensors, and backward runs each block's forward again (about a third "
            "of a block's forward+backward work). RSS falls by less than the kept activations: "
            "it also holds the transient tensors of forward and backward (one block's "
            "activations again during its recompute), the gradients and what the allocator "
            "keeps."
            + (
                " Where the RSS growth did not fall ("
                + ", ".join(f"{r['without']} -> {r['with']}" for r in flat)
                + "), the high-water mark is set by something other than the kept activations "
                "(not investigated further)."
                if (
                    flat := [r for r in dp_rows if r["growth"] and r["growth"][1] >= r["growth"][0]]
                )
                else ""
            )
        )
    return out


def orchestrate(args) -> int:
    n_params = sum(p.numel() for p in GPT().parameters())
    cmd = common.command_line("bench_tp.py")
    modes = list(args.modes)
    print(
        f"model: GPT, {n_params / 1e6:.2f}M params ({N_BLOCKS} blocks, d_model {D_MODEL}, "
        f"{N_HEADS} heads, seq {SEQ}, vocab {VOCAB}, tied embedding/head), global batch "
        f"{args.micro_batch * WORLD}, world size {WORLD}, {args.warmup} warm-up + {args.steps} "
        f"timed steps, {args.rounds} round(s), {len(modes)} modes, {args.threads} thread(s) per "
        "process",
        flush=True,
    )
    source = shardspeed_source()
    print(source, flush=True)
    plan = [(mode, WORLD) for mode in modes]
    results, errors, total, tmp, discarded = common.measure(
        HERE, plan, args, prefix="bench_tp_", width=18
    )
    rows, ratio_table, mode_table = common.summarize(results, errors, comparisons(modes))
    ck_rows = ckpt_rows(results, modes)
    loss_lines, losses_ok = loss_checks(results, modes)
    leaks = [
        f"{mode} rank {r['rank']}: {r['saved_left']} bytes"
        for (mode, _w), runs in results.items()
        for run in runs
        for r in run["ranks"]
        if r.get("saved_left")
    ]
    report = {
        "rows": rows,
        "ratio_table": ratio_table,
        "tp_table": throughput_table(results, modes),
        "mode_table": mode_table,
        "mem_table": memory_table(results, modes),
        "ckpt_table": ckpt_table(ck_rows),
        "comm_table": comm_table(results, modes),
        "loss_lines": loss_lines,
        "findings": findings(results, modes, ck_rows, n_params),
        "leaks": leaks,
        "source": source,
        "load_line": common.load_line(results, discarded, args),
        "results": results,
        "errors": errors,
    }
    for title, key in (
        ("Targets and ratios", "ratio_table"),
        ("Throughput (ratios of medians)", "tp_table"),
        ("Per mode", "mode_table"),
        ("Memory per rank", "mem_table"),
        ("Activation checkpointing", "ckpt_table"),
        ("Collectives in one step", "comm_table"),
    ):
        print(f"\n{title}:\n\n{report[key]}")
    print("\nLosses:\n" + "\n".join(f"- {line}" for line in loss_lines))
    print("\n".join(report["findings"]))
    if leaks:
        print("saved tensors still held after backward:", "; ".join(leaks))
    common.print_run_end(
        total,
        tmp,
        errors,
        load_line=report["load_line"],
        losses_ok=losses_ok,
        source=source,
    )
    if args.write:
        write_section(args, n_params, cmd, total, report)
        print(f"\nupdated {BENCH_MD}")
    ours_failed = [m for (m, _w) in errors if MODES[m].lib == "ours"]
    return 1 if ours_failed or not losses_ok else 0


def write_section(args, n_params: int, cmd: str, total: float, report: dict) -> None:
    rows, results, errors = report["rows"], report["results"], report["errors"]
    gb = args.micro_batch * WORLD
    partition = next(
        (run[0].get("partition") for (m, _w), run in results.items() if m == "ours_pp" and run),
        None,
    )
    notes = [
        f"- Model: bench_pipe.py's GPT, {n_params / 1e6:.2f}M parameters (token + position "
        f"embedding, vocab {VOCAB}, d_model {D_MODEL}; {N_BLOCKS} pre-norm blocks, {N_HEADS} "
        f"heads, seq {SEQ}, 4x GELU MLP; final LayerNorm; head tied to the token embedding; "
        "fp32), with each block's fused qkv linear split into `attn.q_proj`, `attn.k_proj`, "
        "`attn.v_proj` (the same weights) and the others named `attn.o_proj`, `mlp.fc1`, "
        "`mlp.fc2`, so that automatic tensor parallelism can split them; attention computes "
        "its head count from the width, so it runs on a rank's heads unchanged. Layer i is built "
        f"under `torch.manual_seed({BASE_SEED} + i)` in every mode (the pipeline with "
        "`seed_layers=True`), so all start from bench_pipe's weights.",
        f"- Same global batch in every mode: {gb} sequences of {SEQ} tokens a step (bench_pipe's "
        "batches). Data parallelism: 2 replicas, micro batch "
        f"{args.micro_batch} each. Tensor parallelism: 1 replica of 2 ranks, both ranks running "
        f"all {gb} sequences. Pipeline: 2 stages x 1 replica, {PIPE_M} micro-batches of "
        f"{gb // PIPE_M}, schedule 1F1B"
        + (f", layer boundaries {partition}" if partition else "")
        + ".",
        "- Configs. shardspeed and DeepSpeed tensor parallelism, the same dict: "
        f"`{json.dumps(tp_config(gb))}` (shardspeed's partitioned mode adds "
        '`"activation_checkpointing": {"partition_activations": true}`). Data parallelism, '
        f"both libraries: `{json.dumps(common.ds_config(args.micro_batch, 0))}`. shardspeed "
        f"pipeline: `{json.dumps(pipe_config(gb))}`. DDP and FSDP2 (`fully_shard` on each "
        "block, then on the root, default `reshard_after_forward`): "
        "`torch.optim.AdamW(lr=3e-4)`, `clip_grad_norm_(..., 1.0)`. Optimizers as in the "
        "sections above: shardspeed `torch.optim.AdamW(fused=True)`, DeepSpeed its C++ CPU "
        "FusedAdam, DDP/FSDP2 torch's default (per-tensor loop).",
        "- Activation checkpointing: the model's `Block.forward` runs its body under a "
        "checkpoint function, `checkpoint(block.body, x)`: `shardspeed.checkpointing.checkpoint` "
        "(shardspeed modes), `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` "
        "(`ddp_ckpt`), `deepspeed.checkpointing.checkpoint` after "
        "`deepspeed.checkpointing.configure(None)` (`deepspeed_dp_ckpt`, DeepSpeed's reentrant "
        "CheckpointFunction). Every block is checkpointed; the embedding, final norm and head "
        "are not.",
        "- Saved activations: after the timed steps each rank runs one more step under "
        "`torch.autograd.graph.saved_tensors_hooks` that count every tensor autograd keeps for "
        "backward, each storage once, until autograd drops it; parameters (model states) are "
        "left out. 'peak' is the most bytes alive at once (for data and tensor parallelism the "
        "end of the forward; for the pipeline the micro-batches in flight), 'in the blocks' the "
        "part saved inside the transformer blocks, including what a checkpoint keeps of a "
        "block's input (the rest: embedding, final norm, the head's logits and loss). Tensors "
        "saved inside a checkpointed region are not kept (torch's checkpoint drops them) and are "
        "not counted. DeepSpeed's checkpoint keeps its inputs on its autograd context, which the "
        "hooks do not see: the benchmark counts each input it gives it instead. FSDP2 is not "
        "measured (its gathered weights are not module parameters and would be counted).",
        "- Memory: parameters per rank as held (tensor parallelism: the rank's slices plus the "
        "whole embedding, norms and row biases; FSDP2 its shards; the pipeline its stage plus the "
        "tied embedding); '16 B x parameters' is fp32 AdamW's need for them; shardspeed's "
        "`engine.memory_breakdown()` (minus buffers) measures it. Peak RSS is `ru_maxrss` per "
        "rank (max over rounds), interpreter and imports included (about 0.5 GiB); 'RSS growth in "
        "training' is `ru_maxrss` after the timed steps minus the resident size before the first "
        "step (median over rounds), i.e. what training itself added on top of the built model: "
        "the gradients and AdamW's two moments (created at the first step; 3 x 28 MiB on a DP2 "
        "rank, 3 x 16 MiB on a TP2 rank), the activations and the transient tensors of forward "
        "and backward, and what the allocator keeps.",
        common.each_run_note(args, gb),
        "- Losses (mean over the global batch; data parallelism averaged over the ranks; "
        "shardspeed DP is the reference):",
        *(f"  - {line}" for line in report["loss_lines"]),
    ]
    notes.extend(report["findings"])
    if report["leaks"]:
        notes.append(
            "- Saved tensors still held after backward (the meter's accounting): "
            + "; ".join(report["leaks"])
        )
    notes += common.closing_notes(report["load_line"], results, rows, args, errors)
    blocks = [
        report["ratio_table"],
        ("Throughput, every mode (ratios of median tokens/s):", report["tp_table"]),
        ("Per mode:", report["mode_table"]),
        ("Memory per rank:", report["mem_table"]),
        (
            "Activation checkpointing (rank 0; step times are medians over rounds):",
            report["ckpt_table"],
        ),
        (
            "Collectives and transfers in one step (counted at the torch.distributed calls, after "
            "the timed steps):",
            report["comm_table"],
        ),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes, source=report["source"])
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__)
    p.set_defaults(warmup=2, steps=8)
    common.add_modes_arg(p, MODES)
    common.add_noise_args(p, budget=600.0)
    common.add_smoke_arg(p, "every mode runs: 1 round, 1 warm-up + 2 timed steps")
    common.add_write_args(p)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if (args.micro_batch * WORLD) % PIPE_M:
        p.error(f"the global batch (2 x --micro-batch) must divide by the pipeline's m={PIPE_M}")
    common.apply_smoke(p, args, rounds=1, warmup=1, steps=2, wait_idle=0.0, retries=0)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
