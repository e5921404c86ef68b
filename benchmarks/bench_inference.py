"""Inference: the hybrid engine, the inference engine, continuous batching, tensor parallelism.

One invocation measures, on a Hugging Face GPT-2 (`GPT2LMHeadModel` from a config: n_embd 512,
8 layers, 8 heads, vocab 4096, 512 positions, random weights from a fixed seed, fp32, no EOS token
so that every generation runs to max_new_tokens; greedy decoding throughout):

  1. ZeRO-3 on 2 ranks (`shardspeed.initialize` with `hybrid_engine.enabled`): naive generation
     (the model's own Hugging Face `generate` through the engine, every forward gathering the
     shards) against `engine.generate` (an inference copy gathered once per weight version), first
     call and steady state, with `inference_tp_size` 1 and 2; a training step between
     generations; DeepSpeed's hybrid engine and DeepSpeed ZeRO-3 naive generation where they run;
  2. one process: Hugging Face `model.generate` against shardspeed `init_inference(...).generate`,
     shardspeed's `generate(model, prompts, SamplingParams)` directly, weight-only int8 and
     DeepSpeed's `init_inference` (tensor parallelism 1, no kernel injection);
  3. continuous against static batching (`ContinuousBatcher(..., continuous=True/False)`) on a
     mixed-length workload;
  4. tensor parallelism 2 against 1 on latency (`init_inference(tensor_parallel={"tp_size": t})`,
     batch 1), shardspeed and DeepSpeed.

It reports tokens/s, time to first token, per-token decode latency, weight memory, the batcher's
counters, whether the greedy outputs agree, and the error of every mode that does not run. The
script is both the orchestrator and the worker: every measured run is
``python -m torch.distributed.run ... bench_inference.py --worker MODE``.

    .venv/bin/python benchmarks/bench_inference.py --smoke    # every run once, few tokens
    .venv/bin/python benchmarks/bench_inference.py            # measure, print the tables
    .venv/bin/python benchmarks/bench_inference.py --write    # ... and update BENCHMARKS.md

See benchmarks/README.md.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import common
from common import BENCH_MD, shardspeed_source, versions

HERE = Path(__file__).resolve()
SECTION_TITLE = "## Inference: hybrid engine, inference engine, continuous batching and TP"
SMOKE_ENV = "BENCH_INFERENCE_SMOKE"  # set by the orchestrator for --smoke; read by the workers
MIB = 2**20

# The model.
N_EMBD, N_LAYER, N_HEAD, VOCAB, N_POSITIONS = 512, 8, 8, 4096, 512
MODEL_SEED = common.MODEL_SEED
# Fixed-shape generation (parts 1, 2, 4): prompts of PROMPT tokens, NEW new tokens.
PROMPT, NEW, BATCHES = 32, 64, (1, 4)
PROMPT_SEED = 100  # rank r's prompts: torch.Generator().manual_seed(PROMPT_SEED + r)
# Mixed-length workload (part 3).
N_REQUESTS, MAX_BATCH, BLOCK_SIZE = 32, 8, 16
PROMPT_RANGE, NEW_RANGE = (8, 128), (8, 128)
WORKLOAD_SEED = 2024
# The ZeRO-3 config of part 1 (inference_tp_size set per run).
TRAIN_TOKENS = 64  # one training step: micro batch 1 of this many tokens


def smoke() -> bool:
    return os.environ.get(SMOKE_ENV) == "1"


def shape() -> dict:
    """The generation sizes of this run (small in --smoke)."""
    if smoke():
        return {
            "new": 4,
            "batches": (1, 2),
            "requests": 6,
            "prompt_range": (4, 20),
            "new_range": (2, 10),
            "check_new": 4,
        }
    return {
        "new": NEW,
        "batches": BATCHES,
        "requests": N_REQUESTS,
        "prompt_range": PROMPT_RANGE,
        "new_range": NEW_RANGE,
        "check_new": 16,
    }


def zero3_config(inference_tp: int, hybrid: bool = True) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3},
    }
    if hybrid:
        cfg["hybrid_engine"] = {"enabled": True, "inference_tp_size": inference_tp}
    return cfg


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def build_model():
    """The GPT-2 of every mode, built from the same seed (so the same weights everywhere)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        n_embd=N_EMBD,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(MODEL_SEED)
    return GPT2LMHeadModel(config).eval()


def prompts(batch: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(PROMPT_SEED + rank)
    return torch.randint(0, VOCAB, (batch, PROMPT), generator=gen)


def workload(n: int, prompt_range, new_range) -> list[tuple[list[int], int]]:
    """n requests (prompt tokens, max_new_tokens), lengths uniform in the ranges, fixed seed."""
    gen = torch.Generator().manual_seed(WORKLOAD_SEED)
    out = []
    for _ in range(n):
        p = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=gen))
        m = int(torch.randint(new_range[0], new_range[1] + 1, (), generator=gen))
        out.append((torch.randint(0, VOCAB, (p,), generator=gen).tolist(), m))
    return out


def weight_bytes(module) -> int:
    """Bytes of the module's parameters and buffers, each storage once."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def hf_kwargs(ids: torch.Tensor, new: int) -> dict:
    """The Hugging Face generate arguments of every HF-form call: greedy, `new` tokens, pad 0,
    an all-ones attention mask (the prompts have no padding)."""
    return {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": new,
        "do_sample": False,
        "pad_token_id": 0,
    }


class ForwardClock:
    """Start times of the model's forwards (a forward pre-hook on the top-level model), to split
    a generate call into time to first token and per-token decode latency. Every generation loop
    here runs one forward per new token: the prefill forward (whose logits give token 1), then one
    decode forward per further token."""

    def __init__(self, model) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        model.register_forward_pre_hook(self._pre)
        model.register_forward_hook(self._post)

    def _pre(self, _module, _args) -> None:
        self.starts.append(time.perf_counter())

    def _post(self, _module, _args, _out) -> None:
        self.ends.append(time.perf_counter())

    def timed(self, fn, barrier=None):
        """(result of fn(), timing dict): total, forwards, ttft (call start to the start of the
        second forward: prefill plus choosing token 1), decode intervals (start of decode forward
        k to the start of k+1, the last to the call's end) and the decode forwards' own time."""
        if barrier:
            barrier()
        self.starts.clear()
        self.ends.clear()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        s, e = list(self.starts), list(self.ends)
        timing = {"total_s": t1 - t0, "forwards": len(s)}
        if len(s) >= 2:
            ends = [*s[2:], t1]
            intervals = [b - a for a, b in zip(s[1:], ends)]
            timing["ttft_s"] = s[1] - t0
            timing["decode_median_s"] = statistics.median(intervals)
            timing["decode_mean_s"] = (t1 - s[1]) / len(intervals)
            if len(e) == len(s):
                timing["forward_median_s"] = statistics.median(b - a for a, b in zip(s[1:], e[1:]))
                timing["prefill_forward_s"] = e[0] - s[0]
        return out, timing


class Recorder:
    """A worker's result file (one per rank), rewritten after every part so that what ran before a
    crash is kept; plus the CPU accounting `common.run_one` reads (machine busy time and this
    process's CPU time over the measured window)."""

    def __init__(self, args, rank: int, world: int) -> None:
        self.path = Path(f"{args.out}.rank{rank}.json")
        self.data: dict = {
            "mode": args.worker,
            "rank": rank,
            "world_size": world,
            "threads": torch.get_num_threads(),
            "smoke": smoke(),
            "torch": torch.__version__,
        }
        self.busy0 = self.cpu0 = self.t0 = None

    def start(self) -> None:
        self.busy0, self.cpu0, self.t0 = (
            common.machine_busy_s(),
            time.process_time(),
            time.perf_counter(),
        )

    def save(self) -> None:
        if self.t0 is not None:
            self.data["elapsed_s"] = time.perf_counter() - self.t0
            self.data["machine_busy_s"] = common.machine_busy_s() - self.busy0
            self.data["own_cpu_s"] = time.process_time() - self.cpu0
        self.data["peak_rss_mib"] = common.peak_rss_mib()
        self.path.write_text(json.dumps(self.data))


def failure(e: BaseException) -> dict:
    """An exception as a result: its type and first line, and where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        # The innermost frame in a library under test (torch's own frames say less).
        libs = ("deepspeed/", "shardspeed/", "transformers/")
        inside = [f for f in frames if any(lib in f.filename for lib in libs)]
        f = (inside or frames)[-1]
        name = f.filename
        for marker in ("site-packages/", "src/"):
            if marker in name:
                name = name.split(marker, 1)[1]
                break
        where = f"{name}:{f.lineno}"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return {"error": f"{type(e).__name__}: {first}", "where": where}


def gathered_bytes(volume: dict) -> tuple[int, int]:
    """(calls, payload bytes) of the all-gathers in a `shardspeed.comm.comm_volume()`."""
    calls = sum(v["calls"] for k, v in volume.items() if k.startswith("all_gather"))
    nbytes = sum(v["bytes"] for k, v in volume.items() if k.startswith("all_gather"))
    return calls, nbytes


def worker_zero3(args, rec: Recorder, rank: int, world: int, barrier) -> None:
    """Part 1, shardspeed: naive generation through ZeRO-3 (inference_tp_size 1 only) and
    `engine.generate`, first call and steady state, then a training step between generations."""
    import shardspeed
    from shardspeed.comm import comm_volume, reset_comm_volume

    itp = 2 if args.worker == "zero3_tp2" else 1
    sh = shape()
    new = sh["new"]
    model = build_model()
    rec.data["params"] = sum(p.numel() for p in model.parameters())
    cfg = zero3_config(itp)
    rec.data["config"] = cfg
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    engine.eval()  # dropout off for the naive path (the hybrid copy is in eval mode anyway)
    rec.start()
    parts: dict = {}
    rec.data["batches"] = parts

    def timed(fn):
        barrier()
        reset_comm_volume()
        t0 = time.perf_counter()
        out = fn()
        barrier()
        return out, time.perf_counter() - t0, gathered_bytes(comm_volume())

    for b in sh["batches"]:
        ids = prompts(b, rank)
        row: dict = {"batch": b}
        parts[str(b)] = row
        if itp == 1:
            with torch.no_grad():
                out, t, (calls, nbytes) = timed(
                    lambda ids=ids: engine.module.generate(ids, **hf_kwargs(ids, new))
                )
            row["naive"] = {"s": t, "gather_calls": calls, "gather_bytes": nbytes}
            row["naive_tokens"] = out[:, PROMPT:].tolist()
            rec.save()
        runs = []
        for i in range(1 + args.steps):
            built0 = engine.generation_stats["copies_built"]
            gather0 = engine.generation_stats["gather_s"]
            out, t, (calls, nbytes) = timed(
                lambda ids=ids: engine.generate(ids, max_new_tokens=new, do_sample=False)
            )
            runs.append(
                {
                    "s": t,
                    "built": engine.generation_stats["copies_built"] - built0,
                    "gather_s": engine.generation_stats["gather_s"] - gather0,
                    "gather_calls": calls,
                    "gather_bytes": nbytes,
                }
            )
            if i == 0:
                row["hybrid_tokens"] = out[:, PROMPT:].tolist()
            elif out[:, PROMPT:].tolist() != row["hybrid_tokens"]:
                row["hybrid_repeat_differs"] = True
        row["hybrid_first"] = runs[0]
        row["hybrid_steady"] = runs[1:]
        if "naive_tokens" in row:
            row["identical"] = row["naive_tokens"] == row["hybrid_tokens"]
            row["rows_identical"] = sum(
                a == h for a, h in zip(row["naive_tokens"], row["hybrid_tokens"])
            )
        rec.save()

    # A training step between two generations: the copy is rebuilt once per weight version.
    cn = sh["check_new"]
    ids = prompts(1, rank)
    seq = []

    def gen_once(label: str) -> list[int]:
        built0 = engine.generation_stats["copies_built"]
        gather0 = engine.generation_stats["gather_s"]
        out, t, _ = timed(lambda: engine.generate(ids, max_new_tokens=cn, do_sample=False))
        seq.append(
            {
                "label": label,
                "s": t,
                "built": engine.generation_stats["copies_built"] - built0,
                "copies_built": engine.generation_stats["copies_built"],
                "gather_s": engine.generation_stats["gather_s"] - gather0,
            }
        )
        return out[0, PROMPT:].tolist()

    before = gen_once("generate (weights v0)")
    engine.train()
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randint(0, VOCAB, (1, TRAIN_TOKENS), generator=gen)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    after = gen_once("generate after one training step (weights v1)")
    again = gen_once("generate again (weights v1)")
    check: dict = {"sequence": seq, "loss": loss.item(), "new_tokens": cn}
    check["changed_after_step"] = before != after
    check["repeat_same"] = after == again
    if itp == 1:
        with torch.no_grad():
            naive_after = engine.module.generate(ids, **hf_kwargs(ids, cn))[0, PROMPT:].tolist()
        check["naive_after_identical"] = naive_after == after
    rec.data["version_check"] = check
    rec.data["generation_stats"] = dict(engine.generation_stats)
    rec.save()


def worker_deepspeed_zero3(args, rec: Recorder, rank: int, world: int, barrier) -> None:
    """Part 1, DeepSpeed: its hybrid engine (expected not to run on CPU), then naive generation
    through its ZeRO-3 engine."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    sh = shape()
    new = sh["new"]
    rec.start()
    try:
        model = build_model()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=zero3_config(1)
        )
        ids = prompts(1, rank)
        engine.eval()
        engine.generate(ids, **hf_kwargs(ids, new))
        rec.data["hybrid"] = {"ran": True}
    except Exception as e:
        rec.data["hybrid"] = failure(e)
    rec.save()
    barrier()
    try:
        model = build_model()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=zero3_config(1, hybrid=False)
        )
        engine.eval()
        naive = {}
        for b in sh["batches"]:
            ids = prompts(b, rank)
            barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = engine.module.generate(ids, **hf_kwargs(ids, new))
            barrier()
            naive[str(b)] = {"s": time.perf_counter() - t0, "tokens": out[:, PROMPT:].tolist()}
            rec.data["naive"] = naive
            rec.save()
    except Exception as e:
        rec.data["naive"] = failure(e)
    rec.save()


def worker_single(args, rec: Recorder) -> None:
    """Part 2: the generation paths of one process, interleaved over the repetitions."""
    from shardspeed.inference.engine import init_inference
    from shardspeed.inference.generation import generate
    from shardspeed.inference.sampling import SamplingParams

    sh = shape()
    new = sh["new"]
    shared = build_model()  # hf, engine and direct: init_inference at fp32 leaves it as it is
    methods: dict = {}

    def hf_form(gen_fn):
        def call(ids, n):
            with torch.no_grad():
                return gen_fn(ids, **hf_kwargs(ids, n))[:, ids.size(1) :].tolist()

        return call

    def setup(name: str):
        if name == "hf":
            return shared, hf_form(shared.generate), None
        if name == "engine":
            eng = init_inference(shared, dtype=torch.float32)
            return shared, hf_form(eng.generate), None
        if name == "direct":

            def call(ids, n):
                return generate(shared, ids.tolist(), SamplingParams(max_new_tokens=n))

            return shared, call, None
        if name == "int8":
            model = build_model()
            eng = init_inference(model, dtype=torch.int8)
            rep = eng.quantization_report
            info = {
                "linear_bytes_before": rep.bytes_before,
                "linear_bytes_after": rep.bytes_after,
                "quantized": len(rep.quantized),
                "skipped": list(rep.skipped),
            }
            return model, hf_form(eng.generate), info
        if name == "deepspeed":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            model = build_model()
            eng = deepspeed.init_inference(
                model,
                tensor_parallel={"tp_size": 1},
                dtype=torch.float32,
                replace_with_kernel_inject=False,
            )
            return eng.module, hf_form(eng.generate), {"engine": type(eng).__module__}
        raise ValueError(name)

    rec.data["weights_fp32_bytes"] = weight_bytes(shared)
    for name in METHOD_LABELS:
        try:
            module, call, info = setup(name)
            entry = {"call": call, "clock": ForwardClock(module), "module": module}
            methods[name] = entry
            rec.data.setdefault("methods", {})[name] = {
                "weight_bytes": weight_bytes(module),
                "info": info,
                "runs": {},
            }
        except Exception as e:
            rec.data.setdefault("methods", {})[name] = failure(e)
    rec.save()
    # Warm-up: every method at every batch size, a few tokens.
    for _ in range(args.warmup):
        for m in methods.values():
            for b in sh["batches"]:
                with contextlib.suppress(Exception):
                    m["call"](prompts(b, 0), 4)
    rec.start()
    for _rep in range(args.steps):
        for name, m in list(methods.items()):
            out_m = rec.data["methods"][name]
            for b in sh["batches"]:
                ids = prompts(b, 0)
                try:
                    tokens, timing = m["clock"].timed(lambda m=m, ids=ids: m["call"](ids, new))
                except Exception as e:
                    rec.data["methods"][name] = {
                        **failure(e),
                        "weight_bytes": weight_bytes(m["module"]),
                    }
                    methods.pop(name)
                    break
                out_m["runs"].setdefault(str(b), []).append(timing)
                out_m.setdefault("tokens", {})[str(b)] = tokens
        rec.save()
    rec.data["kernel"] = int8_kernel_times()
    rec.save()


def int8_kernel_times() -> dict:
    """One linear of the model's shape (`attn.c_attn`: 512 -> 1536) on 1 row (a decode step)
    and 32 rows (the prefill): fp32 `F.linear` against the int8 kernel shardspeed's CPU path
    calls (`aten._weight_int8pack_mm`, contiguous weight), median microseconds."""
    import torch.nn.functional as F

    from shardspeed.inference.quantization import quantize_weight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3 * N_EMBD, N_EMBD, generator=gen) * 0.02
    q, scale = quantize_weight(w)
    q = q.contiguous()
    out = {}
    for rows in (1, PROMPT):
        x = torch.randn(rows, N_EMBD, generator=gen)
        for name, fn in (
            ("fp32", lambda x=x: F.linear(x, w)),
            ("int8", lambda x=x: torch.ops.aten._weight_int8pack_mm(x, q, scale[:, 0])),
        ):
            for _ in range(5):
                fn()
            times = []
            for _ in range(20 if smoke() else 200):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[f"{name}_{rows}"] = 1e6 * statistics.median(times)
    return out


class ShapeClock:
    """Duration of every model forward by its shape: (rows, new tokens per row) -> seconds."""

    def __init__(self, model) -> None:
        self.times: dict[tuple[int, int], list[float]] = {}
        self._cur: tuple[float, tuple[int, int]] | None = None
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._post),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._cur = (time.perf_counter(), tuple(ids.shape))

    def _post(self, _module, _args, _out) -> None:
        t0, key = self._cur
        self.times.setdefault(key, []).append(time.perf_counter() - t0)

    def summary(self) -> dict:
        """Prefill and decode seconds in all, and the median decode forward by rows."""
        prefill = sum(sum(v) for (_r, w), v in self.times.items() if w > 1)
        decode = sum(sum(v) for (_r, w), v in self.times.items() if w == 1)
        by_rows = {
            str(r): statistics.median(v) for (r, w), v in sorted(self.times.items()) if w == 1
        }
        counts = {str(r): len(v) for (r, w), v in sorted(self.times.items()) if w == 1}
        return {"prefill_s": prefill, "decode_s": decode, "decode_by_rows": by_rows, "n": counts}


def worker_batching(args, rec: Recorder) -> None:
    """Part 3: continuous against static batching on the mixed-length workload."""
    import dataclasses

    from shardspeed.inference.generation import ContinuousBatcher
    from shardspeed.inference.sampling import SamplingParams

    sh = shape()
    reqs = workload(sh["requests"], sh["prompt_range"], sh["new_range"])
    needs = sorted((-(-(len(p) + m - 1) // BLOCK_SIZE) for p, m in reqs), reverse=True)
    cache_blocks = sum(needs[:MAX_BATCH])
    model = build_model()
    rec.data["workload"] = {
        "requests": len(reqs),
        "prompt_lengths": [len(p) for p, _ in reqs],
        "max_new_tokens": [m for _, m in reqs],
        "cache_blocks": cache_blocks,
        "block_size": BLOCK_SIZE,
        "max_batch_size": MAX_BATCH,
    }
    # Warm-up: a few requests through a small batcher.
    for _ in range(args.warmup):
        b = ContinuousBatcher(model, MAX_BATCH, cache_blocks, BLOCK_SIZE)
        for p, _m in reqs[:MAX_BATCH]:
            b.add_request(p, SamplingParams(max_new_tokens=4))
        b.run()
    rec.start()
    runs: dict = {"continuous": [], "static": []}
    rec.data["runs"] = runs
    results: dict = {}
    reps = max(1, min(args.steps, 2))
    for rep in range(reps):
        order = ("continuous", "static") if rep % 2 == 0 else ("static", "continuous")
        for kind in order:
            batcher = ContinuousBatcher(
                model, MAX_BATCH, cache_blocks, BLOCK_SIZE, continuous=kind == "continuous"
            )
            ids = [batcher.add_request(p, SamplingParams(max_new_tokens=m)) for p, m in reqs]
            clock = ShapeClock(model) if rep == 0 else None
            done_at: dict[int, float] = {}
            t0 = time.perf_counter()
            while batcher.has_pending():
                for rid in batcher.step():
                    done_at[rid] = time.perf_counter() - t0
            total = time.perf_counter() - t0
            out = batcher.run()
            runs[kind].append(
                {
                    "s": total,
                    "stats": dataclasses.asdict(batcher.stats),
                    "latency_s": [done_at[i] for i in ids],
                    "forwards": clock.summary() if clock else None,
                }
            )
            if clock:
                clock.remove()
            results.setdefault(kind, [out[i] for i in ids])
            rec.save()
    same = [a == b for a, b in zip(results["continuous"], results["static"])]
    rec.data["same_results"] = sum(same)
    rec.data["tokens_generated"] = sum(len(t) for t in results["continuous"])
    rec.save()


def worker_tp(args, rec: Recorder, rank: int, world: int, barrier) -> None:
    """Part 4: batch-1 latency at tensor parallelism `world`, shardspeed then DeepSpeed."""
    import torch.distributed as dist

    from shardspeed.inference.engine import init_inference

    sh = shape()
    new = sh["new"]
    ids = prompts(1, 0)  # every rank of the group the same prompt
    impls: dict = {}
    rec.data["impls"] = impls
    rec.start()

    def measure(name: str, make) -> None:
        try:
            module, gen_fn = make()
        except Exception as e:
            impls[name] = failure(e)
            rec.save()
            return
        clock = ForwardClock(module)

        def call(n):
            with torch.no_grad():
                return gen_fn(ids, **hf_kwargs(ids, n))[:, PROMPT:].tolist()

        entry: dict = {"weight_bytes": weight_bytes(module), "runs": []}
        impls[name] = entry
        try:
            for _ in range(args.warmup):
                call(4)
            reset = None
            if name == "ours":
                from shardspeed.comm import comm_volume, reset_comm_volume

                reset = reset_comm_volume
            for i in range(args.steps):
                if reset and i == 0:
                    reset()
                tokens, timing = clock.timed(lambda: call(new), barrier)
                if reset and i == 0:
                    entry["comm"] = comm_volume()
                entry["runs"].append(timing)
                entry["tokens"] = tokens
        except Exception as e:
            impls[name] = failure(e)
        rec.save()

    def ours():
        model = build_model()
        eng = init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32)
        return model, eng.generate

    def deepspeed_tp(policy: bool):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        kw = {}
        if policy:
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            kw["injection_policy"] = {GPT2Block: ("attn.c_proj", "mlp.c_proj")}
        model = build_model()
        eng = deepspeed.init_inference(
            model,
            tensor_parallel={"tp_size": world},
            dtype=torch.float32,
            replace_with_kernel_inject=False,
            **kw,
        )
        return eng.module, eng.generate

    measure("ours", ours)
    barrier()
    measure("deepspeed", lambda: deepspeed_tp(False))
    if world > 1:
        barrier()
        measure("deepspeed_policy", lambda: deepspeed_tp(True))
        # The all-reduce a row-parallel layer does at batch 1 decode: [1, 1, n_embd] fp32.
        x = torch.ones(1, 1, N_EMBD)
        for _ in range(20):
            dist.all_reduce(x)
        barrier()
        n = 50 if smoke() else 400
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        rec.data["allreduce_us"] = 1e6 * (time.perf_counter() - t0) / n
    rec.save()


WORKERS = {
    "zero3": worker_zero3,
    "zero3_tp2": worker_zero3,
    "deepspeed_zero3": worker_deepspeed_zero3,
    "single": worker_single,
    "batching": worker_batching,
    "tp": worker_tp,
}


def worker(args) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads, init=False)
    if world > 1 or args.worker in ("zero3", "zero3_tp2", "deepspeed_zero3", "tp"):
        dist.init_process_group("gloo")

    def barrier() -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    rec = Recorder(args, rank, world)
    rec.save()
    fn = WORKERS[args.worker]
    if args.worker in ("single", "batching"):
        fn(args, rec)
    else:
        fn(args, rec, rank, world, barrier)
    rec.save()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------

# (key, worker mode, world size, threads per process or None for --threads, what it measures)
PLAN = [
    ("zero3", "zero3", 2, None, "part 1: shardspeed ZeRO-3, naive vs hybrid, inference_tp_size 1"),
    ("zero3_tp2", "zero3_tp2", 2, None, "part 1: shardspeed hybrid, inference_tp_size 2"),
    ("deepspeed_zero3", "deepspeed_zero3", 2, None, "part 1: DeepSpeed hybrid / ZeRO-3 naive"),
    ("single", "single", 1, None, "part 2: one process, the generation paths"),
    ("batching", "batching", 1, None, "part 3: continuous vs static batching"),
    ("tp1", "tp", 1, None, "part 4: tensor parallelism 1 (1 process)"),
    ("tp2", "tp", 2, None, "part 4: tensor parallelism 2 (2 processes)"),
    ("tp1_2threads", "tp", 1, 2, "part 4: tensor parallelism 1 with 2 threads (information)"),
]


def run_plan(args, plan) -> tuple[dict, float, Path]:
    """Every run of `plan` once (`common.run_one`: a fresh `torch.distributed.run`, after waiting
    for an idle machine); a run whose measured window saw more than --max-other-load cores of
    other work is rerun (up to --retries times, until --budget seconds have passed) or kept and
    flagged. A failed run keeps what its workers wrote before failing."""
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="bench_inference_"))
    out: dict = {}
    t_start = time.perf_counter()
    for key, mode, world, threads, _what in plan:
        run_args = copy.copy(args)
        if threads is not None:
            run_args.threads = threads
        for attempt in range(args.retries + 1):
            tag = f"{key}_a{attempt}"
            r = common.run_one(HERE, mode, world, run_args, tmp, tag)
            if "error" in r:
                partial = Path(f"{tmp / f'{tag}_{mode}_ws{world}'}.rank0.json")
                if partial.exists():
                    r["partial"] = json.loads(partial.read_text())
                break
            if r["foreign_cores"] <= args.max_other_load:
                break
            if attempt == args.retries or time.perf_counter() - t_start > args.budget:
                r["noisy"] = True
                break
            print(
                f"{key}: other load {r['foreign_cores']:.2f} cores > {args.max_other_load}, "
                "rerunning",
                flush=True,
            )
        r["threads_per_process"] = run_args.threads
        out[key] = r
        state = (
            f"FAILED ({r['error']})"
            if "error" in r
            else f"other load {r['foreign_cores']:.2f} cores{', NOISY' if r.get('noisy') else ''}"
        )
        print(f"{key} (ws{world}): run {r.get('wall_s', 0):.0f}s, {state}", flush=True)
    return out, time.perf_counter() - t_start, tmp


def data_of(runs: dict, key: str) -> dict | None:
    """Rank 0's result of a run (what a failed run wrote before failing), or None."""
    r = runs.get(key)
    if r is None:
        return None
    return r.get("partial") if "error" in r else r


def rank_data(runs: dict, key: str) -> list[dict]:
    r = runs.get(key)
    return r.get("ranks", []) if r and "error" not in r else []


def ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def zero3_rows(runs: dict, world: int = 2) -> list[dict]:
    """Part 1 per batch size: naive and hybrid tokens/s (both ranks together)."""
    sh = shape()
    new = sh["new"]
    z, z2, ds = data_of(runs, "zero3"), data_of(runs, "zero3_tp2"), data_of(runs, "deepspeed_zero3")
    rows = []
    for b in sh["batches"]:
        tokens = world * b * new
        row: dict = {"batch": b}
        zb = (z or {}).get("batches", {}).get(str(b), {})
        if "naive" in zb:
            row["naive_tps"] = tokens / zb["naive"]["s"]
            row["naive_gather_calls"] = zb["naive"]["gather_calls"]
            row["naive_gather_mib"] = zb["naive"]["gather_bytes"] / MIB
        if "hybrid_first" in zb:
            row["first_s"] = zb["hybrid_first"]["s"]
            row["first_gather_s"] = zb["hybrid_first"]["gather_s"]
            row["first_built"] = zb["hybrid_first"]["built"]
            row["first_gather_mib"] = zb["hybrid_first"]["gather_bytes"] / MIB
            steady = [r["s"] for r in zb["hybrid_steady"]]
            row["steady_tps"] = tokens / med(steady) if steady else None
            row["steady_gather_calls"] = sum(r["gather_calls"] for r in zb["hybrid_steady"])
            row["identical"] = zb.get("identical")
            row["rows_identical"] = zb.get("rows_identical")
            # Identity on every rank: each rank generated its own prompts.
            ranks = [r.get("batches", {}).get(str(b), {}) for r in rank_data(runs, "zero3")]
            if ranks:
                row["identical_all_ranks"] = all(x.get("identical") for x in ranks)
        z2b = (z2 or {}).get("batches", {}).get(str(b), {})
        if "hybrid_first" in z2b:
            row["tp2_first_s"] = z2b["hybrid_first"]["s"]
            row["tp2_gather_s"] = z2b["hybrid_first"]["gather_s"]
            steady = [r["s"] for r in z2b["hybrid_steady"]]
            row["tp2_steady_tps"] = tokens / med(steady) if steady else None
            pairs = list(zip(rank_data(runs, "zero3"), rank_data(runs, "zero3_tp2")))
            if pairs:
                row["tp2_identical"] = all(
                    a.get("batches", {}).get(str(b), {}).get("naive_tokens")
                    == c.get("batches", {}).get(str(b), {}).get("hybrid_tokens")
                    for a, c in pairs
                )
        dsn = (ds or {}).get("naive")
        if isinstance(dsn, dict) and str(b) in dsn:
            row["ds_naive_tps"] = tokens / dsn[str(b)]["s"]
            ours_naive = zb.get("naive_tokens")
            if ours_naive is not None:
                row["ds_naive_identical"] = dsn[str(b)]["tokens"] == ours_naive
        if row.get("naive_tps") and row.get("steady_tps"):
            row["speedup"] = row["steady_tps"] / row["naive_tps"]
        if row.get("naive_tps") and row.get("tp2_steady_tps"):
            row["tp2_speedup"] = row["tp2_steady_tps"] / row["naive_tps"]
        rows.append(row)
    return rows


def yes_no(x) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def ds_cell(r: dict) -> str:
    if not r.get("ds_naive_tps"):
        return "-"
    same = r.get("ds_naive_identical")
    tail = "" if same is None else f" (tokens {'the same as' if same else 'DIFFER from'} ours)"
    return f"{r['ds_naive_tps']:.1f}{tail}"


def zero3_table(rows: list[dict]) -> str:
    lines = [
        "| batch per rank | naive (ZeRO-3 hooks) tok/s | hybrid first call (s; copy built in) "
        "| hybrid steady tok/s | speedup (target >= 5x) | identical to naive "
        "| hybrid inference_tp_size 2: first call (s) / steady tok/s / vs naive / identical "
        "| DeepSpeed ZeRO-3 naive tok/s |",
        "|---:|---:|---|---:|---:|---|---|---:|",
    ]
    for r in rows:
        first = (
            f"{r['first_s']:.2f} ({r['first_gather_s']:.2f} building the copy)"
            if r.get("first_built")
            else (f"{r['first_s']:.2f} (copy already built)" if "first_s" in r else "-")
        )
        sp = r.get("speedup")
        verdict = "-" if sp is None else f"{sp:.2f}x {'met' if sp >= 5 else 'MISSED'}"
        tp2 = "-"
        if r.get("tp2_steady_tps"):
            tp2 = (
                f"{r['tp2_first_s']:.2f} / {r['tp2_steady_tps']:.1f} / "
                f"{fmt(r.get('tp2_speedup'), '.2f')}x / {yes_no(r.get('tp2_identical'))}"
            )
        ident = yes_no(r.get("identical_all_ranks", r.get("identical")))
        lines.append(
            f"| {r['batch']} | {fmt(r.get('naive_tps'), '.1f')} | {first} "
            f"| {fmt(r.get('steady_tps'), '.1f')} | {verdict} | {ident} | {tp2} "
            f"| {ds_cell(r)} |"
        )
    return "\n".join(lines)


METHOD_LABELS = {
    "hf": "Hugging Face `model.generate` (its own KV cache)",
    "engine": "shardspeed `init_inference(model, dtype=torch.float32).generate` (HF form)",
    "direct": "shardspeed `generate(model, prompts, SamplingParams(max_new_tokens=N))`",
    "int8": "shardspeed `init_inference(model, dtype=torch.int8).generate` (weight-only int8)",
    "deepspeed": "DeepSpeed `init_inference(model, tensor_parallel={'tp_size': 1}, "
    "dtype=torch.float32, replace_with_kernel_inject=False).generate`",
}


def single_rows(runs: dict) -> list[dict]:
    sh = shape()
    d = data_of(runs, "single") or {}
    methods = d.get("methods", {})
    ref = methods.get("hf", {}).get("tokens", {})
    rows = []
    for name in METHOD_LABELS:
        m = methods.get(name)
        if m is None:
            rows.append({"name": name, "error": "not run"})
            continue
        if "error" in m:
            row = {"name": name, "error": m["error"], "where": m.get("where")}
            if "weight_bytes" in m:
                row["weight_mib"] = m["weight_bytes"] / MIB
            rows.append(row)
            continue
        for b in sh["batches"]:
            rr = m["runs"].get(str(b), [])
            if not rr:
                continue
            total = med([r["total_s"] for r in rr])
            row = {
                "name": name,
                "batch": b,
                "tps": b * sh["new"] / total,
                "ttft": med([r.get("ttft_s") for r in rr]),
                "decode": med([r.get("decode_median_s") for r in rr]),
                "forward": med([r.get("forward_median_s") for r in rr]),
                "weight_mib": m["weight_bytes"] / MIB,
                "n": len(rr),
            }
            toks, want = m.get("tokens", {}).get(str(b)), ref.get(str(b))
            if toks is not None and want is not None:
                flat = [(x, y) for a, c in zip(toks, want) for x, y in zip(a, c)]
                row["agree"] = sum(x == y for x, y in flat) / len(flat)
                row["identical"] = toks == want
            rows.append(row)
    hf = {r["batch"]: r["tps"] for r in rows if r["name"] == "hf" and "tps" in r}
    for r in rows:
        if "tps" in r and hf.get(r["batch"]):
            r["vs_hf"] = r["tps"] / hf[r["batch"]]
    return rows


def single_table(rows: list[dict]) -> str:
    lines = [
        "| generation path | batch | tokens/s | vs HF | time to first token (ms) "
        "| decode ms/token (median) | of which the model forward (ms) | weight memory (MiB) "
        "| same tokens as HF |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        label = METHOD_LABELS[r["name"]]
        if "error" in r:
            mem = fmt(r.get("weight_mib"), ".1f")
            lines.append(
                f"| {label} | - | error: `{r['error']}` (at {r.get('where')}) | - | - | - | - "
                f"| {mem} | - |"
            )
            continue
        same = (
            "yes (identical)"
            if r.get("identical")
            else ("-" if "agree" not in r else f"{100 * r['agree']:.1f}% of tokens")
        )
        lines.append(
            f"| {label} | {r['batch']} | {r['tps']:.1f} | {fmt(r.get('vs_hf'), '.2f')}x "
            f"| {ms(r['ttft'])} | {ms(r['decode'])} | {ms(r['forward'])} | {r['weight_mib']:.1f} "
            f"| {same} |"
        )
    return "\n".join(lines)


def batching_rows(runs: dict) -> tuple[list[dict], dict]:
    d = data_of(runs, "batching") or {}
    rows = []
    n = d.get("workload", {}).get("requests", 0)
    for kind in ("continuous", "static"):
        rr = d.get("runs", {}).get(kind, [])
        if not rr:
            continue
        st = rr[0]["stats"]
        total = med([r["s"] for r in rr])
        decode_tokens = st["tokens_generated"] - n
        lat = sorted(rr[0]["latency_s"])
        rows.append(
            {
                "kind": kind,
                "s": total,
                "all_s": [r["s"] for r in rr],
                "tps": st["tokens_generated"] / total,
                "steps": st["steps"],
                "decode_steps": st["decode_steps"],
                "occupancy": decode_tokens / st["decode_steps"] if st["decode_steps"] else None,
                "peak_batch": st["peak_batch_size"],
                "joined": st["joined_while_running"],
                "peak_blocks": st["peak_blocks_in_use"],
                "tokens": st["tokens_generated"],
                "lat_mean": statistics.mean(lat),
                "lat_p50": lat[len(lat) // 2],
                "lat_max": lat[-1],
                "forwards": rr[0].get("forwards"),
            }
        )
    return rows, d


def batching_table(rows: list[dict], d: dict) -> str:
    lines = [
        "| batching | total time (s) | tokens/s | steps | decode forwards | mean batch occupancy "
        "(of 8) | requests joined a running batch | peak KV blocks in use | request completion "
        "time mean / median / last (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kind']} | {r['s']:.2f} ({', '.join(f'{x:.2f}' for x in r['all_s'])}) "
            f"| {r['tps']:.1f} | {r['steps']} | {r['decode_steps']} | {fmt(r['occupancy'], '.2f')} "
            f"| {r['joined']} | {r['peak_blocks']} of {d['workload']['cache_blocks']} "
            f"| {r['lat_mean']:.2f} / {r['lat_p50']:.2f} / {r['lat_max']:.2f} |"
        )
    return "\n".join(lines)


TP_LABELS = {
    "ours": "shardspeed `init_inference(tensor_parallel={'tp_size': t})`",
    "deepspeed": "DeepSpeed `init_inference(tensor_parallel={'tp_size': t}, "
    "replace_with_kernel_inject=False)`",
    "deepspeed_policy": "DeepSpeed, same plus `injection_policy={GPT2Block: ('attn.c_proj', "
    "'mlp.c_proj')}`",
}
TP_RUNS = (("tp1", 1, 1), ("tp2", 2, 1), ("tp1_2threads", 1, 2))


def tp_rows(runs: dict) -> list[dict]:
    sh = shape()
    rows = []
    base: dict = {}
    for key, tp, threads in TP_RUNS:
        d = data_of(runs, key)
        if d is None:
            continue
        if "error" in runs.get(key, {}) and not d.get("impls"):
            rows.append({"key": key, "tp": tp, "threads": threads, "impl": "ours", "error": ""})
            continue
        for impl, e in d.get("impls", {}).items():
            row = {"key": key, "tp": tp, "threads": threads, "impl": impl}
            if "error" in e:
                row.update(error=e["error"], where=e.get("where"))
            elif e.get("runs"):
                rr = e["runs"]
                row.update(
                    ttft=med([r.get("ttft_s") for r in rr]),
                    decode=med([r.get("decode_median_s") for r in rr]),
                    forward=med([r.get("forward_median_s") for r in rr]),
                    tps=sh["new"] / med([r["total_s"] for r in rr]),
                    weight_mib=e["weight_bytes"] / MIB,
                    tokens=e.get("tokens"),
                )
                ar = e.get("comm", {}).get("all_reduce")
                if ar and ar["calls"]:
                    row["allreduce_calls_per_token"] = ar["calls"] / sh["new"]
                if key == "tp1":
                    base[impl] = row
            else:
                continue
            rows.append(row)
    for r in rows:
        b = base.get(r["impl"]) or base.get("ours")
        if b and "decode" in r and r["decode"] and b.get("decode"):
            r["decode_vs_tp1"] = b["decode"] / r["decode"]
            r["ttft_vs_tp1"] = b["ttft"] / r["ttft"]
        if b and r.get("tokens") is not None and b.get("tokens") is not None:
            r["same_as_tp1"] = r["tokens"] == b["tokens"]
    return rows


def tp_table(rows: list[dict]) -> str:
    lines = [
        "| implementation | tp | processes x threads | time to first token (ms) "
        "| decode ms/token (median) | of which the model forward (ms) "
        "| speedup over tp 1 (first token / decode) | tokens/s | weight memory per rank (MiB) "
        "| same tokens as tp 1 |",
        "|---|---:|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in rows:
        label = TP_LABELS.get(r["impl"], r["impl"])
        procs = f"{r['tp']} x {r['threads']}"
        if "error" in r:
            lines.append(
                f"| {label} | {r['tp']} | {procs} | error: `{r['error']}` (at {r.get('where')}) "
                "| - | - | - | - | - | - |"
            )
            continue
        sp = (
            "-"
            if r["key"] == "tp1"
            else f"{fmt(r.get('ttft_vs_tp1'), '.2f')}x / {fmt(r.get('decode_vs_tp1'), '.2f')}x"
        )
        same = "-" if r["key"] == "tp1" else yes_no(r.get("same_as_tp1"))
        lines.append(
            f"| {label} | {r['tp']} | {procs} | {ms(r['ttft'])} | {ms(r['decode'])} "
            f"| {ms(r.get('forward'))} | {sp} "
            f"| {r['tps']:.1f} | {r['weight_mib']:.1f} | {same} |"
        )
    return "\n".join(lines)


def runs_table(runs: dict, plan) -> str:
    lines = [
        "| run | what | processes x threads | wall time (s) | other load (cores) | peak RSS per rank "
        "(MiB) | result |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for key, _mode, world, _threads, what in plan:
        r = runs.get(key)
        if r is None:
            continue
        threads = r.get("threads_per_process")
        if "error" in r:
            lines.append(f"| {key} | {what} | {world} x {threads} | - | - | - | {r['error']} |")
            continue
        noisy = " (noisy, kept)" if r.get("noisy") else ""
        lines.append(
            f"| {key} | {what} | {world} x {threads} | {r['wall_s']:.0f} "
            f"| {r['foreign_cores']:.2f}{noisy} | {r['peak_rss_mib']:.0f} | ok |"
        )
    return "\n".join(lines)


def version_lines(runs: dict) -> list[str]:
    out = []
    for key, label in (("zero3", "inference_tp_size 1"), ("zero3_tp2", "inference_tp_size 2")):
        d = data_of(runs, key) or {}
        vc = d.get("version_check")
        if not vc:
            continue
        parts = [
            f"{s['label']}: {s['s']:.2f} s, copies built so far {s['copies_built']}"
            + (f" (this call built one: {s['gather_s']:.2f} s)" if s["built"] else "")
            for s in vc["sequence"]
        ]
        extra = [
            "the tokens changed with the weights"
            if vc.get("changed_after_step")
            else "the tokens did NOT change after the step",
            "the second call returned the same tokens"
            if vc.get("repeat_same")
            else "the second call returned DIFFERENT tokens",
        ]
        if "naive_after_identical" in vc:
            extra.append(
                "identical to naive generation with the new weights"
                if vc["naive_after_identical"]
                else "DIFFERENT from naive generation with the new weights"
            )
        out.append(
            f"{label} ({vc['new_tokens']} new tokens, batch 1): "
            + "; ".join(parts)
            + "; "
            + ", ".join(extra)
            + "."
        )
    return out


def decode_split(engine: dict, hf: dict) -> str:
    """How the engine's decode token differs from Hugging Face's, inside and outside the forward."""
    if not engine.get("forward") or not hf.get("forward"):
        return "."
    delta, fdelta = engine["decode"] - hf["decode"], engine["forward"] - hf["forward"]
    if delta >= 0:
        return (
            f"; the engine's decode token takes {ms(delta)} ms longer than Hugging Face's, "
            f"{ms(fdelta)} ms of that inside the model forward (where the caches differ) and "
            f"{ms(delta - fdelta)} ms in the loop around it."
        )
    return (
        f"; the engine's decode token takes {ms(-delta)} ms less than Hugging Face's "
        f"({ms(-fdelta)} ms less inside the model forward)."
    )


def findings(report: dict) -> list[str]:
    """Plain-words explanations, with this run's numbers."""
    out = []
    sh = shape()
    new = sh["new"]
    z = data_of(report["runs"], "zero3") or {}
    params = z.get("params")
    zrows = report["zero3_rows"]
    r1 = next((r for r in zrows if r["batch"] == 1), None)
    if r1 and r1.get("speedup") and params:
        b1 = z["batches"]["1"]
        naive_gather = b1["naive"]["gather_bytes"] / MIB
        calls = b1["naive"]["gather_calls"]
        first_gather = b1["hybrid_first"]["gather_bytes"] / MIB
        naive_s = b1["naive"]["s"]
        steady_s = 2 * new / r1["steady_tps"]
        out.append(
            f"- What makes the hybrid path fast: under ZeRO-3 each rank holds half of every "
            f"sharded weight. The model's own `generate` runs {new} forwards for {new} tokens, and "
            f"every forward gathers every unit again: at batch 1 rank 0 made {calls} all-gathers "
            f"moving {naive_gather:.0f} MiB ({naive_gather / new:.1f} MiB, about the whole fp32 "
            f"model of {params / 1e6:.1f}M parameters, per token) in {naive_s:.2f} s, "
            f"{1000 * naive_s / new:.0f} ms a token. `engine.generate` gathers the weights once "
            f"per weight version into an inference copy ({first_gather:.0f} MiB of all-gathers, "
            f"{r1['first_gather_s']:.2f} s on the first call) and then generates from the copy "
            f"with no collective at all ({r1.get('steady_gather_calls', 0)} all-gathers in the "
            f"steady calls) at {1000 * steady_s / new:.0f} ms a token: {r1['speedup']:.1f}x the "
            f"naive tokens/s at batch 1. Even the first call, copy included, took "
            f"{r1['first_s']:.2f} s against {naive_s:.2f} s."
        )
        r4 = next((r for r in zrows if r["batch"] != 1 and r.get("speedup")), None)
        if r4:
            out.append(
                f"- At batch {r4['batch']} per rank the speedup is {r4['speedup']:.1f}x: the naive "
                "path still gathers the whole model once per token, but that gather is now shared "
                f"by {r4['batch']} sequences, so it weighs less against the compute, which grows "
                "with the batch on both paths."
            )
    both = [r for r in zrows if r.get("tp2_steady_tps") and r.get("steady_tps")]
    if both:
        cmp = "; ".join(
            f"batch {r['batch']}: {r['tp2_steady_tps']:.1f} against {r['steady_tps']:.1f} tok/s "
            f"({r['tp2_steady_tps'] / r['steady_tps']:.2f}x)"
            for r in both
        )
        out.append(
            "- `inference_tp_size` 2 splits the inference copy over the 2 ranks (each keeps half "
            "of it) and generates both ranks' prompts together, each rank computing half of every "
            "split layer for all of them, with 2 all-reduces per layer and token. Against "
            f"`inference_tp_size` 1 (each rank its own prompts on a whole copy): {cmp}. Batch-1 "
            "decoding pays the per-token all-reduces and synchronisation for little work (see the "
            "tensor-parallel table); with more rows per forward the split matrix products are "
            "worth more against them. It halves the copy's memory on each rank either way."
        )
    ds = data_of(report["runs"], "deepspeed_zero3") or {}
    hy = ds.get("hybrid", {})
    if "error" in hy:
        out.append(
            f"- DeepSpeed's hybrid engine does not run on CPU: `deepspeed.initialize` with "
            f'`"hybrid_engine": {{"enabled": true}}` fails with `{hy["error"]}` (at '
            f"{hy.get('where')}): it builds the inference copy from DeepSpeed's fused inference "
            "kernels (`InferenceBuilder`, CUDA), which the CPU accelerator does not implement. "
            "DeepSpeed's ZeRO-3 engine without it generates the naive way; its row is given for "
            "comparison with shardspeed's naive path."
        )
    srows = report["single_rows"]

    def srow(name, b):
        return next((r for r in srows if r.get("name") == name and r.get("batch") == b), None)

    paths = (("hf", "Hugging Face"), ("engine", "the inference engine"), ("direct", "direct"))
    explained = False
    for b in sh["batches"]:
        got = [(label, srow(name, b)) for name, label in paths]
        if not all(r for _, r in got):
            continue
        hf = got[0][1]
        parts = [
            f"{label} {r['tps']:.1f} tok/s ({ms(r['decode'])} ms a decode token, "
            f"{ms(r['forward'])} of it in the model forward)"
            for label, r in got
        ]
        out.append(
            f"- One process, batch {b}: "
            + "; ".join(parts)
            + f". The engine runs at {got[1][1]['tps'] / hf['tps']:.2f}x and direct `generate` at "
            f"{got[2][1]['tps'] / hf['tps']:.2f}x Hugging Face's tokens/s"
            + decode_split(got[1][1], hf)
            + (
                ""
                if explained
                else " All run the same GPT-2 forward with a KV cache, so most of a token's time "
                "is the forward itself; what differs is the cache (Hugging Face's a growing "
                "tensor per layer; shardspeed's the block cache, whose keys and values each "
                "layer writes into blocks and gathers back into a dense right-aligned tensor, "
                "inside the forward column) and the loop around the forward (Hugging Face's "
                "logits processors and stopping criteria; shardspeed's batcher). The engine and "
                "direct `generate` run the same loop; the engine adds its argument handling and "
                "the conversion to Hugging Face's output form."
            )
        )
        explained = True
    hf1 = srow("hf", 1)
    q1, q4 = (
        srow("int8", 1),
        next((r for r in srows if r.get("name") == "int8" and r.get("batch", 1) != 1), None),
    )
    d = data_of(report["runs"], "single") or {}
    info = d.get("methods", {}).get("int8", {}).get("info") or {}
    if q1 and hf1 and info:
        agree = "; ".join(
            f"batch {r['batch']}: "
            + (
                "identical"
                if r.get("identical")
                else f"{100 * r.get('agree', 0):.1f}% of positions"
            )
            for r in (q1, q4)
            if r and "agree" in r
        )
        out.append(
            f"- int8 (weight-only): the {info['quantized']} linear layers' weights go from "
            f"{info['linear_bytes_before'] / MIB:.1f} to {info['linear_bytes_after'] / MIB:.1f}"
            f" MiB, the whole model from {hf1['weight_mib']:.1f} to {q1['weight_mib']:.1f} MiB "
            f"(the token and position embeddings and the output head, tied to the token "
            f"embedding, stay fp32: {', '.join(info['skipped']) or 'nothing'} left out). Batch 1 "
            f"runs at {q1['tps']:.1f} tok/s ({q1['vs_hf']:.2f}x Hugging Face fp32; "
            f"{ms(q1['decode'])} against {ms(hf1['decode'])} ms a decode token, "
            f"{ms(q1['ttft'])} against {ms(hf1['ttft'])} ms to the first token). Greedy tokens "
            f"against fp32: {agree} (random weights give nearly flat logits, so a small weight "
            "error can flip an argmax, and the sequence goes its own way from there)."
        )
    kt = d.get("kernel")
    if q1 and hf1 and kt:
        out.append(
            f"- Why int8 is slower here although it reads a quarter of the bytes: torch's CPU "
            f"kernel for it (`aten._weight_int8pack_mm`) is slower than the fp32 matrix product "
            f"(a BLAS sgemm) on this machine. On one linear of this model's shape (512 -> 1536, 1 "
            f"thread) it took {kt['int8_1']:.0f} us against {kt['fp32_1']:.0f} us for 1 row (a "
            f"decode step) and {kt[f'int8_{PROMPT}']:.0f} us against "
            f"{kt[f'fp32_{PROMPT}']:.0f} us for {PROMPT} rows (the prefill): int8 saves memory "
            "on this CPU, not time."
        )
    brows = report["batching_rows"]
    bc = next((r for r in brows if r["kind"] == "continuous"), None)
    bs = next((r for r in brows if r["kind"] == "static"), None)
    if bc and bs:
        d = report["batching_data"]
        gain = bs["s"] / bc["s"]
        how = f"{gain:.2f}x faster" if gain >= 1 else f"{1 / gain:.2f}x slower"
        out.append(
            f"- Continuous batching: the same {d['workload']['requests']} requests "
            f"({bc['tokens']} new tokens) took {bc['s']:.2f} s against {bs['s']:.2f} s static "
            f"({how}), with {bc['decode_steps']} decode forwards against "
            f"{bs['decode_steps']}. A static batch runs until its longest request is done, its "
            f"finished rows idling (mean occupancy {bs['occupancy']:.2f} of {MAX_BATCH}); "
            f"continuous batching admits the next request as soon as one leaves "
            f"({bc['joined']} requests joined a running batch), so the batch stays fuller "
            f"({bc['occupancy']:.2f}) and the mean request completes in {bc['lat_mean']:.2f} s "
            f"instead of {bs['lat_mean']:.2f} s. Each request's tokens are the same either way "
            f"({d.get('same_results')} of {d['workload']['requests']})."
        )
        fc, fs = bc.get("forwards"), bs.get("forwards")
        if fc and fs:
            rows = {**fs["decode_by_rows"], **fc["decode_by_rows"]}
            shown = [r for r in ("1", "2", "4", "8") if r in rows]
            costs = ", ".join(
                f"{ms(rows[r])} ms at {r} row{'s' if r != '1' else ''}" for r in shown
            )
            out.append(
                f"- Why the gain is {'small' if gain < 1.25 else 'what it is'}: on this CPU (1 "
                f"thread) a decode forward's cost grows with its rows ({costs}; medians of the "
                "first repetition), so a fuller batch saves only the part of a forward that does "
                "not depend on the rows (reading the weights, the Python of the forward). Decode "
                f"forwards took {fc['decode_s']:.2f} s in all with continuous batching against "
                f"{fs['decode_s']:.2f} s static, the prefills (the same prompts either way) "
                f"{fc['prefill_s']:.2f} s against {fs['prefill_s']:.2f} s. Where a decode "
                "forward of 8 rows costs about as much as one of 1 (a GPU at small batches, "
                "bound by reading the weights), the saving comes closer to the ratio of decode "
                "forwards."
                + (
                    " The mean completion time barely moves: every request is queued at the "
                    "start, so it is set by the queue's total work, and each request that joins "
                    "a running batch delays the others by its prefill."
                    if abs(bc["lat_mean"] - bs["lat_mean"]) < 0.1 * bs["lat_mean"]
                    else ""
                )
            )
    trows = report["tp_rows"]

    def trow(key, impl="ours"):
        return next(
            (r for r in trows if r["key"] == key and r["impl"] == impl and "decode" in r), None
        )

    t1, t2, t12 = trow("tp1"), trow("tp2"), trow("tp1_2threads")
    tp2d = data_of(report["runs"], "tp2") or {}
    if t1 and t2:
        ar_us = tp2d.get("allreduce_us")
        calls = t2.get("allreduce_calls_per_token")
        comm = ""
        if ar_us and calls:
            comm = (
                f" Each decode token makes {calls:.0f} all-reduces (2 per layer, after the "
                f"attention output and the MLP output projections, each of a 2 KiB row); one gloo "
                f"all-reduce between the two processes took {ar_us:.0f} us on its own, "
                f"{calls * ar_us / 1000:.1f} ms a token."
            )
        ratio = t1["decode"] / t2["decode"]
        if ratio >= 1.3:
            verdict = f"TP2 cuts the decode latency by {ratio:.2f}x"
        elif ratio >= 0.95:
            verdict = "TP2 leaves the decode latency about where it was"
        else:
            verdict = f"TP2 makes decoding slower ({ratio:.2f}x the speed of one process)"
        out.append(
            f"- Tensor parallelism 2 against 1 (batch 1): decode {ms(t2['decode'])} against "
            f"{ms(t1['decode'])} ms a token (model forward {ms(t2.get('forward'))} against "
            f"{ms(t1.get('forward'))} ms), first token {ms(t2['ttft'])} against {ms(t1['ttft'])} "
            f"ms. On 2 CPU cores over gloo {verdict}. A batch-1 decode step of this model is a "
            "matrix-vector product per layer, bound by reading the weights; TP2 halves that "
            "reading for the split linears only (each rank still runs the embeddings, the "
            "norms, the full output head and all of the Python of the forward and the generation "
            "loop) and adds a synchronisation at every row-parallel layer, where each rank waits "
            "for the other." + comm + f" What TP2 does give is memory: {t2['weight_mib']:.1f} "
            f"MiB of weights a rank against {t1['weight_mib']:.1f} (the embeddings and the "
            "output head stay whole on both)."
        )
        if t12:
            if t12["decode"] < min(t1["decode"], t2["decode"]):
                tail = (
                    f" ({t1['decode'] / t12['decode']:.2f}x one thread, "
                    f"{t2['decode'] / t12['decode']:.2f}x TP2). On one machine of a few cores, "
                    "threads are the cheaper way to use the second core; tensor parallelism pays "
                    "off when a model does not fit one device or its per-layer work is large "
                    "against the communication (big layers, fast interconnect)."
                )
            else:
                tail = (
                    ": no faster than one thread here either; at batch 1 the matrix-vector "
                    "products of this model are too small for two threads to share well."
                )
            out.append(
                f"- One process with both cores instead (2 torch intra-op threads): "
                f"{ms(t12['decode'])} ms a decode token and {ms(t12['ttft'])} ms to the first "
                "token, with no split and no collectives" + tail
            )
    dst = [r for r in trows if r["impl"].startswith("deepspeed") and "error" in r]
    for r in dst:
        out.append(
            f"- {TP_LABELS[r['impl']].replace('t}', str(r['tp']) + '}')} fails at tp {r['tp']}: "
            f"`{r['error']}` (at {r.get('where')})."
            + (
                " DeepSpeed's automatic tensor parallelism refuses models for which it has a "
                "kernel-injection policy (GPT-2 is one), and kernel injection is CUDA."
                if r["impl"] == "deepspeed"
                else " DeepSpeed's column split of a Conv1D (`conv_LinearLayer._tp_partition`, "
                "deepspeed/module_inject/layers.py) sizes the pieces from the weight's dimension "
                "0 but cuts dimension 1: GPT-2's `attn.c_attn` weight is [512, 1536] ([in, out]), "
                "so 256 + 256 does not add up to 1536; only a square weight would be cut right."
            )
        )
    return out


def orchestrate(args) -> int:
    model = build_model()
    n_params = sum(p.numel() for p in model.parameters())
    del model
    cmd = common.command_line("bench_inference.py")
    sh = shape()
    print(
        f"model: Hugging Face GPT2LMHeadModel, {n_params / 1e6:.2f}M params (n_embd {N_EMBD}, "
        f"{N_LAYER} layers, {N_HEAD} heads, vocab {VOCAB}, {N_POSITIONS} positions, fp32); "
        f"prompts {PROMPT} tokens, {sh['new']} new, batches {sh['batches']}; "
        f"{args.warmup} warm-up call(s), {args.steps} timed repetition(s); "
        f"{args.threads} thread(s) per process",
        flush=True,
    )
    source = shardspeed_source()
    print(source, flush=True)
    plan = [p for p in PLAN if p[0] in args.runs]
    runs, total, tmp = run_plan(args, plan)
    merged = None
    if args.merge:
        # The runs not made now come from an earlier invocation's --save-json file.
        prev = json.loads(Path(args.merge).read_text())
        old = prev["report"]["runs"]
        taken = [k for k, *_ in PLAN if k not in runs and k in old]
        runs.update({k: old[k] for k in taken})
        runs = {k: runs[k] for k, *_ in PLAN if k in runs}
        plan = [p for p in PLAN if p[0] in runs]
        merged = {
            "cmd": prev["cmd"],
            "date": prev.get("date"),
            "total": prev["report"].get("total"),
            "source": prev["report"].get("source"),
            "runs": taken,
        }
    report = build_report(runs, plan, source, args, total, n_params)
    report["merged"] = merged
    report["made_now"] = [k for k, *_ in PLAN if k in args.runs]
    print_report(report)
    common.print_run_end(total, tmp, failed_runs(runs))
    if args.save_json:
        saved = {"report": report, "cmd": cmd, "date": datetime.date.today().isoformat()}
        Path(args.save_json).write_text(json.dumps(saved, default=str))
        print(f"saved the results to {args.save_json}")
    common.warn_if_source_changed(source)
    if args.write:
        write_section(args, cmd, report)
        print(f"\nupdated {BENCH_MD}")
    return exit_status(report)


def failed_runs(runs: dict) -> dict:
    """The runs that failed, by key (their results hold the error and the log)."""
    return {key: r for key, r in runs.items() if "error" in r}


def build_report(runs, plan, source, args, total, n_params) -> dict:
    batching, bdata = batching_rows(runs)
    report = {
        "runs": runs,
        "runs_table": runs_table(runs, plan),
        "zero3_rows": zero3_rows(runs),
        "single_rows": single_rows(runs),
        "batching_rows": batching,
        "batching_data": {k: v for k, v in bdata.items() if k != "runs"},
        "tp_rows": tp_rows(runs),
        "source": source,
        "total": total,
        "n_params": n_params,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": args.threads,
    }
    report["version_lines"] = version_lines(runs)
    report["findings"] = findings(report)
    return report


def print_report(report: dict) -> None:
    bd = report["batching_data"]
    for title, text in (
        ("Runs", report["runs_table"]),
        (
            "1. ZeRO-3: naive vs hybrid generation (tokens/s of both ranks)",
            zero3_table(report["zero3_rows"]),
        ),
        ("2. One process", single_table(report["single_rows"])),
        (
            "3. Continuous vs static batching",
            batching_table(report["batching_rows"], bd) if bd else "-",
        ),
        ("4. Tensor parallelism, batch 1", tp_table(report["tp_rows"])),
    ):
        print(f"\n{title}:\n\n{text}")
    print("\nWeight versions:\n" + "\n".join(f"- {x}" for x in report["version_lines"]))
    print("\n" + "\n".join(report["findings"]))


def exit_status(report: dict) -> int:
    """1 when a shardspeed run failed or hybrid generation differs from naive generation."""
    ours = ("zero3", "zero3_tp2", "single", "batching", "tp1", "tp2")
    failed = [k for k in ours if "error" in report["runs"].get(k, {})]
    differs = [
        r["batch"]
        for r in report["zero3_rows"]
        if r.get("identical") is False or r.get("tp2_identical") is False
    ]
    if failed:
        print(f"\nshardspeed runs failed: {failed}")
    if differs:
        print(f"\nHYBRID GENERATION DIFFERS FROM NAIVE at batch {differs}")
    return 1 if failed or differs else 0


def write_section(args, cmd: str, report: dict) -> None:
    sh = shape()
    runs = report["runs"]
    z = data_of(runs, "zero3") or {}
    bd = report["batching_data"]
    wl = bd.get("workload", {})
    notes = [
        f"- Model: `GPT2LMHeadModel(GPT2Config(vocab_size={VOCAB}, n_positions={N_POSITIONS}, "
        f"n_embd={N_EMBD}, n_layer={N_LAYER}, n_head={N_HEAD}, bos_token_id=None, "
        f"eos_token_id=None))` built under `torch.manual_seed({MODEL_SEED})` in every process "
        f"({report['n_params'] / 1e6:.2f}M parameters, fp32, the output head tied to the token "
        "embedding; transformers' default attention, sdpa). Random weights: the tokens are "
        "meaningless, the work is that of a trained model of this shape. No EOS token, so every "
        "generation runs to its max_new_tokens; greedy decoding everywhere.",
        f"- Prompts: {PROMPT} random tokens (rank r's from `torch.Generator().manual_seed("
        f"{PROMPT_SEED} + r)`), {sh['new']} new tokens. Hugging Face-form calls get "
        "`max_new_tokens`, `do_sample=False`, `pad_token_id=0` and an all-ones `attention_mask`.",
        "- Part 1: `shardspeed.initialize(model=model, config="
        f"{json.dumps(zero3_config(1))})` on 2 ranks (gloo), `engine.eval()`; naive = "
        "`engine.module.generate(input_ids, ...)` under `torch.no_grad()` (Hugging Face's "
        "generate with its own KV cache, every forward through ZeRO-3's gather hooks); hybrid = "
        "`engine.generate(input_ids, max_new_tokens=N, do_sample=False)`. Each rank generates its "
        f"own batch of prompts, so tokens/s counts both ranks: 2 x batch x {sh['new']} / time "
        "(rank 0's clock, a barrier before and after each call). The first hybrid call builds the "
        f"inference copy (`engine.generation_stats['gather_s']`); steady state is the median of "
        f"the next {report['steps']} calls. 'identical' compares the new tokens of naive and "
        "hybrid generation on every rank. The all-gather counts and bytes are "
        "`shardspeed.comm.comm_volume()` on rank 0. The `inference_tp_size` 2 run is the same "
        'with `"inference_tp_size": 2`; its tokens are compared with the naive run\'s. DeepSpeed: '
        "the same config through `deepspeed.initialize` (after "
        '`deepspeed.init_distributed(dist_backend="gloo")`), then, without `hybrid_engine`, its '
        "ZeRO-3 engine's `engine.module.generate` (one call per batch size).",
        "- Weight versions (batch 1, "
        f"{(z.get('version_check') or {}).get('new_tokens', sh['check_new'])} new tokens): "
        f"generate, one training step (`engine(input_ids=x, labels=x).loss`, `engine.backward`, "
        f"`engine.step()` on {TRAIN_TOKENS} random tokens a rank), generate twice:",
        *(f"  - {line}" for line in report["version_lines"]),
        f"- Part 2: one process, 1 thread; {report['warmup']} warm-up call(s) of every path at "
        f"every batch size, then {report['steps']} repetitions with the paths interleaved; medians. "
        "Hugging Face, the inference engine and direct `generate` share one model (at fp32 "
        "`init_inference` only puts it in eval mode); int8 and DeepSpeed get fresh copies of the "
        "same weights. Time to first token: from the call to the start of the second model "
        "forward (the prefill plus choosing token 1); decode ms/token: the median interval "
        "between the starts of successive decode forwards (the last one to the call's end), "
        "i.e. the whole cost of a token (forward, sampling, bookkeeping), timed by a forward "
        "pre-hook on the model; every path runs one forward per new token. Weight memory: the "
        "model's parameters and buffers, each storage once.",
        f"- Part 3: {wl.get('requests')} requests, prompt lengths uniform in {PROMPT_RANGE[0]}.."
        f"{PROMPT_RANGE[1]} and max_new_tokens in {NEW_RANGE[0]}..{NEW_RANGE[1]} "
        f"(`torch.Generator().manual_seed({WORKLOAD_SEED})`), all queued at once in the same "
        f"order, greedy, through `ContinuousBatcher(model, {MAX_BATCH}, "
        f"{wl.get('cache_blocks')}, {BLOCK_SIZE}, continuous=True/False)` (the cache holds the "
        f"{MAX_BATCH} largest requests together, so only the batch size limits admission); "
        "`step()` until nothing is pending, the time of each request's last token recorded. One "
        "process, 1 thread; the two kinds alternate over 2 repetitions (both times shown, the "
        "median used). Steps, decode forwards, peak batch, joins and peak blocks are the "
        "batcher's `stats`; mean occupancy = tokens produced by decode forwards (all tokens "
        "minus each request's first, which its prefill gives) / decode forwards.",
        "- Part 4: `init_inference(model, tensor_parallel={'tp_size': t}, dtype=torch.float32)` "
        "and DeepSpeed's `deepspeed.init_inference(model, tensor_parallel={'tp_size': t}, "
        "dtype=torch.float32, replace_with_kernel_inject=False)`, t processes of 1 thread (and t "
        f"= 1 with 2 threads, for information), batch 1, the same prompt on every rank, "
        f"{report['warmup']} warm-up call(s) then {report['steps']} timed calls (a barrier before "
        "each), medians; timed on rank 0 as in part 2. The gloo all-reduce time is 400 "
        "all-reduces of a [1, 1, 512] fp32 tensor between the two ranks after the measurement.",
        "- Runs: a fresh `torch.distributed.run --standalone` per run (gloo on CPU, "
        "`DS_ACCELERATOR=cpu`), one after another, each after waiting for an idle machine; 'other "
        "load' is the CPU used during a run's measured window by anything other than its own "
        "processes (a run above the limit is rerun once).",
    ]
    notes.extend(report["findings"])
    noisy = [k for k, r in runs.items() if r.get("noisy")]
    if noisy:
        notes.append(
            f"- Runs kept although other processes used more than {args.max_other_load} cores "
            f"during their measured window (after {args.retries} rerun): {', '.join(noisy)}; "
            "their figures are less reliable."
        )
    merged = report.get("merged")
    if merged:
        notes.append(
            f"- This section combines two invocations: {', '.join(report['made_now'])} from the "
            f"command above ({report['total']:.0f}s), and {', '.join(merged['runs'])} from an "
            f"earlier one (`.venv/bin/{merged['cmd']}`"
            + (f", {merged['date']}" if merged.get("date") else "")
            + (f", {merged['total']:.0f}s" if merged.get("total") else "")
            + (f", {merged['source']}" if merged.get("source") else "")
            + "), read back from its `--save-json` file with `--merge`."
        )
    notes += common.note_lines(args)
    notes += common.error_notes(failed_runs(runs))
    blocks = [
        (
            "1. ZeRO-3 on 2 ranks: naive generation through the ZeRO-3 hooks against the hybrid "
            f"engine (tokens/s of both ranks together; prompts {PROMPT} tokens, {sh['new']} new):",
            zero3_table(report["zero3_rows"]),
        ),
        (
            f"2. One process, 1 thread (prompts {PROMPT} tokens, {sh['new']} new):",
            single_table(report["single_rows"]),
        ),
        (
            "3. Continuous against static batching, mixed-length workload (one process, 1 thread):",
            batching_table(report["batching_rows"], bd) if bd else "-",
        ),
        (
            f"4. Tensor parallelism 2 against 1, latency at batch 1 (prompt {PROMPT} tokens, "
            f"{sh['new']} new):",
            tp_table(report["tp_rows"]),
        ),
        ("Runs:", report["runs_table"]),
    ]
    section = common.section_text(
        SECTION_TITLE,
        cmd,
        report["total"],
        blocks,
        notes,
        source=report["source"],
        versions_text=f"{versions()}, transformers {_version('transformers')}",
    )
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def main(argv=None) -> int:
    p = common.parser(__doc__)  # --steps: timed repetitions; --warmup: warm-up calls
    p.set_defaults(warmup=1, steps=3)
    p.add_argument(
        "--runs",
        nargs="+",
        default=[k for k, *_ in PLAN],
        choices=[k for k, *_ in PLAN],
        help="runs to make (default all)",
    )
    common.add_noise_args(p, budget=600.0)
    common.add_smoke_arg(p, "every run works: 4 new tokens, a small workload, 1 repetition")
    p.add_argument("--write", action="store_true", help=f"update {BENCH_MD.name}")
    p.add_argument("--save-json", help="also write the results to this JSON file")
    p.add_argument(
        "--merge",
        help="a --save-json file of an earlier invocation: the runs not made now are taken from "
        "it (to redo a disturbed run without redoing the others)",
    )
    p.add_argument("--note", action="append", help=common.NOTE_HELP)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    common.apply_smoke(p, args, warmup=1, steps=1, wait_idle=0.0, retries=0)
    if args.smoke:
        os.environ[SMOKE_ENV] = "1"
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
