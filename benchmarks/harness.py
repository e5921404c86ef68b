"""What every benchmark shares: models, batches, launching measured runs, the timed loop,
memory and communication accounting, and the command line (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(REPO / "examples"))

MIB = 2**20
VOCAB, SEQ, D_MODEL, N_HEADS = 4096, 128, 256, 4
MODEL_SEED, DATA_SEED = 1234, 4321
LR, CLIP = 3e-4, 1.0
DEEPSPEED_MISSING = "deepspeed is not installed in this environment"
# The GPT scaled to 98.5M parameters (checkpoint and offload benchmarks).
LM_100M = dict(n_embd=768, n_layer=13, n_head=12)


def lm_config(**overrides):
    """The benchmarks' GPT (examples/gpt.py): 4 blocks of width 256 unless overridden."""
    from gpt import GPTConfig

    base = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=N_HEADS, n_embd=D_MODEL)
    return GPTConfig(**(base | overrides), init="torch")


def build_lm(**overrides):
    """`lm_config(**overrides)`'s GPT built under MODEL_SEED; `model(x, y)` is the loss."""
    import torch

    from gpt import GPT

    torch.manual_seed(MODEL_SEED)
    return GPT(lm_config(**overrides))


def random_batches(rank: int, n: int, micro_batch: int, seq: int = SEQ) -> list:
    """Uniform random token batches; batch i of rank r is the same in every mode."""
    import torch

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(DATA_SEED + 1_000_003 * rank + i)
        s = torch.randint(0, VOCAB, (micro_batch, seq + 1), generator=g)
        out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return out


def progression_batches(n: int, size: int, used_vocab: int = 256, seq: int = SEQ) -> list:
    """Step i's global batch of `seq` tokens: arithmetic progressions, so the loss falls."""
    import torch

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(DATA_SEED + i)
        start = torch.randint(0, used_vocab, (size, 1), generator=g)
        stride = torch.randint(1, 17, (size, 1), generator=g)
        s = (start + stride * torch.arange(seq + 1)) % used_vocab
        out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
    return out


def micro_batches(x, y, m: int):
    """A pipeline's input: the global batch (x, y) as an iterator of `m` micro-batches."""
    return iter(zip(x.chunk(m), y.chunk(m)))


def rank_slice(batches: list, rank: int, micro_batch: int) -> list:
    """This data-parallel rank's rows of each global batch."""
    lo = rank * micro_batch
    return [(x[lo : lo + micro_batch], y[lo : lo + micro_batch]) for x, y in batches]


def _pipe_parts():
    """The tied GPT's parts: embeddings, tied head and loss of the pipeline family."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Embedding(nn.Module):
        """Token and position embeddings, N(0, 0.02) so that the tied head starts small."""

        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(VOCAB, D_MODEL)
            self.positions = nn.Embedding(SEQ, D_MODEL)
            nn.init.normal_(self.tokens.weight, std=0.02)
            nn.init.normal_(self.positions.weight, std=0.02)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.tokens(ids) + self.positions.weight[: ids.shape[1]]

    def head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, embedding.tokens.weight)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    return Embedding, head, loss_fn


def pipeline_module(pipe, world: int, block: type, *block_args, **options):
    """The tied GPT (8 blocks) as a `pipe.PipelineModule` of `world` stages."""
    from torch import nn

    Embedding, head, loss_fn = _pipe_parts()
    tied = dict(tied_weight_attr="tokens.weight")
    layers = [
        pipe.TiedLayerSpec("embed", Embedding, **tied),
        *[pipe.LayerSpec(block, *block_args) for _ in range(8)],
        pipe.LayerSpec(nn.LayerNorm, D_MODEL),
        pipe.TiedLayerSpec("embed", Embedding, forward_fn=head, **tied),
    ]
    return pipe.PipelineModule(
        layers, num_stages=world, loss_fn=loss_fn, seed_layers=True, base_seed=MODEL_SEED, **options
    )


def tied_gpt(block: Callable, n_blocks: int = 8):
    """The pipeline layers as one module, each layer seeded as a pipeline seeds it."""
    import torch
    from torch import nn

    Embedding, head, loss_fn = _pipe_parts()

    class TiedGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(MODEL_SEED)
            self.embed = Embedding()
            blocks = []
            for i in range(n_blocks):
                torch.manual_seed(MODEL_SEED + 1 + i)
                blocks.append(block(i))
            self.blocks = nn.ModuleList(blocks)
            torch.manual_seed(MODEL_SEED + 1 + n_blocks)
            self.ln_f = nn.LayerNorm(D_MODEL)

        def forward(self, ids, labels):
            x, extras = self.embed(ids), []
            for b in self.blocks:
                x = b(x)
                if isinstance(x, tuple):
                    x, extra = x
                    extras.append(extra)
            loss = loss_fn(head(self.embed, self.ln_f(x)), labels)
            return loss + sum(extras) if extras else loss

    return TiedGPT()


def gpt_block():
    """examples/gpt.py's block at the benchmarks' width (layer-seeded by the caller)."""
    from gpt import Block

    return Block(lm_config())


def config(micro_batch: int, stage: int = 0, **extra) -> dict:
    """The config given verbatim to both shardspeed and DeepSpeed."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        **extra,
    }


class Skip(Exception):
    """A mode that cannot run here (e.g. DeepSpeed not installed); the message says why."""


def library(name: str):
    """shardspeed or deepspeed (Skip where DeepSpeed is not installed)."""
    if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise Skip(DEEPSPEED_MISSING)
    return __import__("shardspeed" if name == "ours" else name)


def setup(threads: int, *, init: bool = True) -> tuple[int, int]:
    """A rank's start: its thread count, rank and world size, and the gloo group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if init and not dist.is_initialized():
        dist.init_process_group("gloo")
    return rank, world


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def trainer(
    lib: str, model, cfg: dict | None = None, *, fused=False, fsdp=None, adam="AdamW", clip=True
):
    """(forward, backward, update, engine-or-optimizer) of `model` under framework `lib`; `adam`
    names the torch optimizer of the torch frameworks, `clip` clips its gradients at CLIP."""
    import torch

    if lib in ("ours", "deepspeed"):
        params = model.parameters()
        engine, *_ = library(lib).initialize(model=model, model_parameters=params, config=cfg)
        return engine, engine.backward, engine.step, engine
    module = model
    if lib == "ddp":
        module = torch.nn.parallel.DistributedDataParallel(model)
    elif lib == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, **(fsdp or {}))
        fully_shard(model, **(fsdp or {}))
    fused_option = {"fused": True} if fused else {}
    opt = getattr(torch.optim, adam)(model.parameters(), lr=LR, **fused_option)

    def update():
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return module, lambda loss: loss.backward(), update, opt


def step_fn(forward, backward, update, losses: list | None = None) -> Callable:
    def step(x, y):
        loss = forward(x, y)
        backward(loss)
        update()
        if losses is not None:
            losses.append(loss.detach())
        return loss

    return step


def machine_busy_s() -> float:
    """Machine-wide busy CPU seconds from /proc/stat (nan where unavailable)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    return (sum(f[:8]) - f[3] - f[4]) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


class Window:
    """CPU accounting of measured windows (wall, machine busy, own CPU) for 'other load'."""

    def __init__(self, sync: Callable = barrier) -> None:
        self.sync, self.totals, self.last = sync, [0.0, 0.0, 0.0], 0.0

    def start(self) -> Window:
        self.sync()
        self.begin = (time.perf_counter(), machine_busy_s(), time.process_time())
        return self

    def stop(self) -> float:
        self.sync()
        now = (time.perf_counter(), machine_busy_s(), time.process_time())
        self.totals = [t + b - a for t, a, b in zip(self.totals, self.begin, now)]
        self.last = now[0] - self.begin[0]
        return self.last

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def result(self) -> dict:
        return dict(zip(("elapsed_s", "machine_busy_s", "own_cpu_s"), self.totals))


def timed(
    step: Callable, batches: list, warmup: int, steps: int, tokens_per_step: int, sync=barrier
) -> dict:
    """Warm-up, then `steps` timed steps between `sync`s: throughput, losses, CPU use."""
    losses = [step(x, y).item() for x, y in batches[:warmup]]
    window = Window(sync).start()
    for x, y in batches[warmup : warmup + steps]:
        loss = step(x, y)
    last = loss.item()
    elapsed = window.stop()
    return window.result() | {
        "tokens_per_s": tokens_per_step * steps / elapsed,
        "step_ms": 1000 * elapsed / steps,
        "first_loss": losses[0] if losses else last,
        "last_loss": last,
        "peak_rss_mib": peak_rss_mib(),
    }


def loss_curve(losses: list, average: bool = True) -> dict:
    """The losses of every step with the first and last (`average`: over the ranks)."""
    import torch
    import torch.distributed as dist

    values = torch.stack(losses).float()
    if average:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    out = values.tolist()
    return {"losses": out, "first_loss": out[0], "last_loss": out[-1]}


def local(t):
    """The plain tensor behind `t` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def local_numel(params: Iterable) -> int:
    return sum(local(p).numel() for p in params if p is not None)


def reachable_tensors(root, prefixes: tuple[str, ...], depth: int = 10) -> list:
    """Tensors reachable from `root` through containers and objects of `prefixes` modules."""
    import torch
    from torch import nn

    out, seen, stack = [], set(), [(root, depth)]
    while stack:
        obj, d = stack.pop()
        if obj is None or id(obj) in seen or d < 0:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            out.append(local(obj))
        elif isinstance(obj, dict):
            stack.extend((v, d - 1) for v in obj.values())
            stack.extend((k, d - 1) for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, list | tuple | set | frozenset | deque):
            stack.extend((v, d - 1) for v in obj)
        elif not isinstance(obj, nn.Module) and type(obj).__module__.startswith(prefixes):
            stack.extend((v, d - 1) for v in (getattr(obj, "__dict__", None) or {}).values())
    return out


STATE_KINDS = ("parameters", "gradients", "master_weights", "optimizer_states")


class Census:
    """Bytes of distinct storages by kind; a storage counts once, in its first kind."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, kind: str, tensors: Iterable) -> Census:
        total = self.bytes.get(kind, 0)
        for t in tensors:
            if t is None or local(t).device.type == "meta":
                continue
            storage = local(t).untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in self.seen:
                self.seen.add(storage.data_ptr())
                total += storage.nbytes()
        self.bytes[kind] = total
        return self

    def result(self, *extra: str) -> dict:
        return {k: self.bytes.get(k, 0) for k in (*STATE_KINDS, *extra)}


def optimizer_state(opt) -> list:
    return [v for s in opt.state.values() for v in s.values() if hasattr(v, "untyped_storage")]


def census_torch(params: list, opt, *extra: str) -> dict:
    """Parameters, their gradients and a torch optimizer's state."""
    c = Census().add("parameters", params).add("gradients", [p.grad for p in params])
    return c.add("optimizer_states", optimizer_state(opt)).result(*extra)


def census_ours(engine) -> dict:
    """`engine.memory_breakdown()`'s model states, and other tensors of its optimizer."""
    mb = engine.memory_breakdown()
    c = Census()
    for kind, tensors in engine.optimizer.held_tensors().items():
        c.add(kind, tensors)
    c.add("buffers", engine.module.buffers())
    c.add("other", reachable_tensors(engine.optimizer, ("shardspeed",)))
    out = {k: mb[k] for k in STATE_KINDS} | {"other": c.bytes["other"]}
    return out | ({"gathered_peak": mb["gathered_peak"]} if "gathered_peak" in mb else {})


def census_deepspeed(engine) -> dict:
    """DeepSpeed ZeRO 0-3's model states by kind, its ipg buckets and other tensors."""
    opt, params = engine.optimizer, list(engine.module.parameters())
    masters = list(getattr(opt, "single_partition_of_fp32_groups", None) or [])
    masters += list(getattr(opt, "fp32_partitioned_groups_flat", None) or [])
    c = Census().add("parameters", params)
    c.add("parameters", [getattr(p, "ds_tensor", None) for p in params])
    c.add("parameters", getattr(opt, "bit16_groups_flat", None) or [])
    c.add("parameters", getattr(opt, "fp16_partitioned_groups_flat", None) or [])
    grads = [p.grad for p in params] + [m.grad for m in masters]
    grads.append(getattr(opt, "grad_partitions_flat_buffer", None))
    for name in ("averaged_gradients", "grads_in_partition"):
        grads += reachable_tensors(getattr(opt, name, None), ("deepspeed",))
    c.add("gradients", grads).add("master_weights", masters)
    inner = getattr(opt, "optimizer", None)
    c.add("optimizer_states", optimizer_state(inner) if inner is not None else [])
    buckets = getattr(opt, "ipg_buckets", None) or {}
    held = [getattr(b, "buffer", None) for b in buckets.values()]  # stages 1-2: lists of tensors
    c.add("bucket", [t for x in held for t in (x if isinstance(x, list) else [x])])
    roots = [opt, getattr(opt, "parameter_offload", None)]
    return c.add("other", reachable_tensors(roots, ("deepspeed",))).result("other", "bucket")


def census_fsdp2(model, opt) -> dict:
    """FSDP2's model states by kind (local shards) and the rest of its state."""
    from torch.distributed.fsdp import FSDPModule

    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [s._fsdp_param_group for s in states if s._fsdp_param_group is not None]
    fsdp_params = [fp for g in groups for fp in g.fsdp_params]
    c = Census().add("parameters", model.parameters())
    c.add("parameters", reachable_tensors(fsdp_params, ("torch.distributed",)))
    c.add("gradients", [p.grad for p in model.parameters()])
    c.add("optimizer_states", optimizer_state(opt))
    return c.add("other", reachable_tensors(states, ("torch.distributed",))).result("other")


REGION = ["other"]  # where the forward is, for the saved-bytes meter: "blocks" or "other"


@contextlib.contextmanager
def region(name: str):
    outer, REGION[0] = REGION[0], name
    try:
        yield
    finally:
        REGION[0] = outer


class SavedBytes:
    """Peak bytes of tensors autograd saves for backward (parameters left out), by region."""

    def __init__(self, params) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list] = {}  # storage pointer: [references, bytes, region]
        self.now, self.peak = {"blocks": 0, "other": 0}, 0
        self.peak_by_region = dict(self.now)

    def add(self, t) -> int | None:
        key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key in self.exclude or nbytes == 0:
            return None
        if key in self.live:
            self.live[key][0] += 1
            return key
        self.live[key] = [1, nbytes, REGION[0]]
        self.now[REGION[0]] += nbytes
        if sum(self.now.values()) > self.peak:
            self.peak, self.peak_by_region = sum(self.now.values()), dict(self.now)
        return key

    def release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                del self.live[key]
                self.now[entry[2]] -= entry[1]

    def hooks(self):
        import torch

        meter = self

        class Held:  # released when autograd drops it
            def __init__(self, key, tensor) -> None:
                self.key, self.tensor = key, tensor

            def __del__(self) -> None:
                meter.release(self.key)

        def pack(t):
            key = self.add(t)
            return t if key is None else Held(key, t)

        def unpack(held):
            return held.tensor if isinstance(held, Held) else held

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class CommCounter:
    """Calls, bytes and seconds of torch.distributed's collectives made from Python."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather")
    NAMES += ("reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "send", "recv")
    NAMES += ("all_to_all_single", "reduce")
    ALIASES: ClassVar[dict[str, str]] = {
        "all_gather_single": "all_gather_into_tensor",
        "reduce_scatter_single": "reduce_scatter_tensor",
    }

    def __init__(self, dist) -> None:
        from collections import Counter

        self.active, self.depth = False, 0
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()  # counted whether active or not
        self.group_size = dist.get_world_size
        for name in self.NAMES:
            if getattr(dist, name, None) is not None:
                setattr(dist, name, self._wrap(self.ALIASES.get(name, name), getattr(dist, name)))
        batch, isend = dist.batch_isend_irecv, dist.isend

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
            if hasattr(value, "untyped_storage"):
                return value.numel() * value.element_size()
            if isinstance(value, list | tuple) and value and hasattr(value[0], "numel"):
                return sum(t.numel() * t.element_size() for t in value)
        return 0

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            group = kwargs.get("group")
            key = f"{name}@1" if group is not None and self.group_size(group) == 1 else name
            if self.active and self.depth == 0:
                self.calls[key] += 1
                self.bytes[key] += self._nbytes(args, kwargs)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.seconds[key] += time.perf_counter() - t0

        return counted

    def snapshot(self) -> dict:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


@dataclass
class Scenario:
    """One benchmark as data: modes and world sizes, steps, ratio rows, its section."""

    name: str
    section: str
    modes: dict[str, int]  # mode -> world size
    warmup: int = 5
    steps: int = 20
    rounds: int = 3
    micro_batch: int = 8
    comparisons: list[tuple[str, str, float | None, str]] = field(default_factory=list)
    quick: dict = field(default_factory=lambda: {"warmup": 1, "steps": 2, "rounds": 1})
    options: dict[str, dict] = field(default_factory=dict)  # extra CLI flags: name -> kwargs
    default_modes: Sequence[str] | None = None  # what runs without --modes (default: all)
    presets: dict[str, Sequence[str]] = field(default_factory=dict)  # flag -> the modes it runs
    env: Callable[[str, argparse.Namespace], dict] | None = None  # a mode's extra environment
    timeout: float | None = None  # seconds a run may take (then it counts as failed)


def parse(scenario: Scenario, argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=f"benchmark: {scenario.section.lstrip('# ')}")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    default, every = list(scenario.default_modes or scenario.modes), ", ".join(scenario.modes)
    p.add_argument("--modes", nargs="+", default=default, help=f"modes to run, of {every}")
    for flag, modes in scenario.presets.items():
        p.add_argument(flag, action="store_true", help=f"run {', '.join(modes)}")
    for name in ("rounds", "warmup", "steps", "micro_batch"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(scenario, name))
    p.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    p.add_argument("--quick", action="store_true", help="tiny run: checks it works (no --write)")
    p.add_argument("--wait-idle", type=float, default=10.0, help="seconds to wait for idle")
    p.add_argument("--max-other-load", type=float, default=0.25, help="cores; rerun above")
    p.add_argument("--retries", type=int, default=1, help="reruns of a disturbed run")
    p.add_argument("--budget", type=float, default=600.0, help="seconds; then keep noisy runs")
    p.add_argument("--timeout", type=float, default=scenario.timeout, help="seconds per run")
    p.add_argument("--deadline", type=float, help="seconds; then start no further run")
    p.add_argument("--json", help="where the results go (default /tmp/shardspeed-bench/NAME.json)")
    p.add_argument("--render", metavar="JSON", help="only render the tables of a saved result")
    p.add_argument("--merge", metavar="JSON", help="take the modes not run now from a saved result")
    p.add_argument("--write", action="store_true", help="write the tables into BENCHMARKS.md")
    for name, kwargs in scenario.options.items():
        p.add_argument(name, **kwargs)
    args = p.parse_args(argv)
    for flag, modes in scenario.presets.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            args.modes = list(modes)
    unknown = set(args.modes) - set(scenario.modes)
    if unknown:
        p.error(f"unknown --modes {sorted(unknown)}; choose from {list(scenario.modes)}")
    if args.quick:
        if args.write:
            p.error("--quick figures are not measurements: drop --write")
        for key, value in scenario.quick.items():
            setattr(args, key, value)
        args.wait_idle, args.retries = 0, 0
    args.json = args.json or f"/tmp/shardspeed-bench/{scenario.name}.json"
    return args


def worker_argv(args: argparse.Namespace, scenario: Scenario) -> list[str]:
    """The command line a rank gets: the orchestrator's, without its orchestration flags."""
    out = [f"--{k}={getattr(args, k)}" for k in ("warmup", "steps", "threads")]
    out.append(f"--micro-batch={args.micro_batch}")
    for name, kwargs in scenario.options.items():
        value = getattr(args, name.lstrip("-").replace("-", "_"))
        if kwargs.get("action") == "store_true":
            out += [name] if value else []
        elif value is not None:
            out += [name, *map(str, value)] if isinstance(value, list) else [f"{name}={value}"]
    return out


def wait_idle(max_wait: float, threshold: float = 0.3) -> None:
    deadline = time.perf_counter() + max_wait
    while time.perf_counter() < deadline:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(1.0)
        if (machine_busy_s() - b0) / (time.perf_counter() - t0) < threshold:
            return


def launch(
    script: str,
    mode: str,
    world: int,
    argv: list[str],
    tmp: Path,
    env: dict | None = None,
    timeout: float | None = None,
) -> dict:
    """One measured run of `script --worker MODE`: rank 0's result with every rank's."""
    out = tmp / f"{mode}_ws{world}_{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={world}", str(BENCH_DIR / script), "--worker", mode]
    cmd += ["--result", str(out), *argv]
    threads = next((a.split("=")[1] for a in argv if a.startswith("--threads=")), "1")
    full_env = os.environ | {"OMP_NUM_THREADS": threads, "DS_ACCELERATOR": "cpu"} | (env or {})
    full_env = {k: v for k, v in full_env.items() if v != ""}
    log = Path(f"{out}.log")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        # A session of its own, so that a run past `timeout` goes down with all its ranks.
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=full_env, cwd=REPO, start_new_session=True
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    files = [Path(f"{out}.rank{r}.json") for r in range(world)]
    ranks = [json.loads(f.read_text()) for f in files if f.exists()]
    if ranks and "skipped" in ranks[0]:
        return {"mode": mode, "world_size": world, "skipped": ranks[0]["skipped"]}
    if code != 0 or len(ranks) < world:
        error = code if isinstance(code, str) else f"exit {code}"
        return {"mode": mode, "world_size": world, "error": error, "log": log.read_text()[-3000:]}
    r0 = dict(ranks[0], ranks=ranks, wall_s=wall, mode=mode, world_size=world)
    r0["peak_rss_mib"] = max(r.get("peak_rss_mib", 0) for r in ranks)
    if "elapsed_s" in r0:
        own = sum(r.get("own_cpu_s", 0) for r in ranks)
        r0["other_load"] = max(0.0, (r0["machine_busy_s"] - own) / r0["elapsed_s"])
    return r0


def run_rounds(scenario: Scenario, args, script: str) -> dict:
    """Every selected mode `args.rounds` times, interleaved; disturbed runs rerun."""
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_{scenario.name}_"))
    plan = [m for m in scenario.modes if m in args.modes]
    runs: dict[str, list] = {m: [] for m in plan}
    failed: dict[str, dict] = {}
    discarded, t_start = 0, time.perf_counter()
    for rnd in range(args.rounds):
        for mode in plan[rnd % len(plan) :] + plan[: rnd % len(plan)]:
            if mode in failed:
                continue
            if args.deadline and time.perf_counter() - t_start > args.deadline:
                failed[mode] = {"skipped": f"--deadline: {args.deadline:.0f} s used"}
                continue
            for attempt in range(args.retries + 1):
                if args.wait_idle > 0:
                    wait_idle(args.wait_idle)
                env = scenario.env(mode, args) if scenario.env else None
                argv = worker_argv(args, scenario)
                world = scenario.modes[mode]
                r = launch(script, mode, world, argv, tmp, env, args.timeout)
                if "other_load" not in r or r["other_load"] <= args.max_other_load:
                    break
                if attempt == args.retries or time.perf_counter() - t_start > args.budget:
                    r["noisy"] = True
                    break
                discarded += 1
            if "error" in r or "skipped" in r:
                failed[mode] = r
                why = r.get("skipped") or f"FAILED ({r['error']})\n{r['log']}"
                print(f"[round {rnd}] {mode}: {why}", flush=True)
                continue
            runs[mode].append(r)
            tps = f"{r['tokens_per_s']:.0f} tok/s, " if "tokens_per_s" in r else ""
            print(f"[round {rnd}] {mode}: {tps}run {r['wall_s']:.0f}s", flush=True)
    meta = run_meta(time.perf_counter() - t_start, discarded, runs) | {"quick": args.quick}
    print(f"worker logs in {tmp}")
    return {"scenario": scenario.name, "meta": meta, "runs": runs, "failed": failed}


def run_meta(total_s: float, discarded: int, runs: dict) -> dict:
    noisy = sum(bool(r.get("noisy")) for v in runs.values() for r in v)
    git = ["git", "rev-parse", "--short", "HEAD"]
    head = subprocess.run(git, cwd=REPO, text=True, capture_output=True).stdout.strip()
    versions = {}
    for name in ("torch", "deepspeed", "transformers"):
        with contextlib.suppress(Exception):
            versions[name] = importlib.metadata.version(name)
    meta = {"date": datetime.date.today().isoformat()}
    meta["machine"] = f"{os.cpu_count()} CPU cores, {platform.system()} {platform.release()}"
    meta["versions"] = versions | {"python": platform.python_version()}
    meta |= {"commit": head, "command": " ".join(["python", *sys.argv])}
    return meta | {"total_s": round(total_s, 1), "discarded": discarded, "noisy": noisy}


def save(results: dict, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=1, default=str))
    print(f"results in {path}")


def run_worker(worker: Callable, args) -> None:
    """A rank: the worker's result (or why it skipped) as RESULT.rankR.json."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        result = worker(args.worker, args)
    except Skip as why:
        result = {"skipped": str(why)}
    Path(f"{args.result}.rank{rank}.json").write_text(json.dumps(result, default=float))
    import torch.distributed as dist

    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()  # both ranks done before either tears gloo down
        dist.destroy_process_group()


def main(
    scenario: Scenario,
    worker: Callable,
    tables: Callable,
    script: str,
    orchestrate: Callable | None = None,
) -> None:
    """The script's entry point: a rank (`--worker`), or run / render a scenario."""
    import render

    args = parse(scenario)
    if args.worker:
        run_worker(worker, args)
        return
    if args.render:
        results = json.loads(Path(args.render).read_text())
    else:
        results = (orchestrate or (lambda s, a: run_rounds(s, a, script)))(scenario, args)
        if args.merge:
            merge(results, json.loads(Path(args.merge).read_text()))
        save(results, args.json)
    if args.write and results["meta"].get("quick"):
        sys.exit(f"{args.render} holds a --quick run: its figures are not measurements")
    rendered = tables(results)
    for name, text in rendered.items():
        print(f"\n[{name}]\n{text}")
    if args.write:
        render.write(scenario.name, rendered)


def merge(results: dict, earlier: dict) -> None:
    """Every mode not measured now, from an earlier result (to redo one disturbed mode alone)."""
    for mode, runs in earlier["runs"].items():
        if runs and not results["runs"].get(mode):
            results["runs"][mode] = runs
            results["failed"].pop(mode, None)
    results["meta"]["merged"] = {"from": earlier["meta"], "modes": sorted(earlier["runs"])}


def median(xs: Iterable) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")
