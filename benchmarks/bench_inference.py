"""Inference: the hybrid engine, the inference engine, continuous batching, tensor parallelism,
on a Hugging Face GPT-2 (`GPT2LMHeadModel` from a config: n_embd 512, 8 layers, 8 heads, vocab
4096, 512 positions, random weights from a fixed seed, fp32, no EOS token so that every generation
runs to max_new_tokens; greedy decoding throughout).

    .venv/bin/python benchmarks/bench_inference.py [--quick] [--write]
    .venv/bin/python benchmarks/bench_inference.py --modes zero3 --merge OLD.json --write

Modes: zero3, zero3_tp2 (ZeRO-3 on 2 ranks: naive generation through the hooks against
`engine.generate`, `inference_tp_size` 1 and 2, and a training step between generations),
deepspeed_zero3 (its hybrid engine, and naive generation through its ZeRO-3), single (one process:
Hugging Face `generate`, shardspeed's inference engine, direct `generate`, int8, DeepSpeed's
`init_inference`), batching (continuous against static), tp1, tp2, tp1_2threads (batch-1 latency,
shardspeed and DeepSpeed). `--steps` is the timed repetitions, `--warmup` the warm-up calls.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import traceback

import torch

import harness as h
import render

SCENARIO = h.Scenario(
    name="inference",
    section="## Inference: hybrid engine, inference engine, continuous batching and TP",
    modes={
        "zero3": 2,
        "zero3_tp2": 2,
        "deepspeed_zero3": 2,
        "single": 1,
        "batching": 1,
        "tp1": 1,
        "tp2": 2,
        "tp1_2threads": 1,
    },
    warmup=1,
    steps=3,
    rounds=1,
    env=lambda mode, args: {"OMP_NUM_THREADS": "2"} if mode == "tp1_2threads" else {},
    options={"--small": dict(action="store_true", help="few tokens, a small workload (--quick)")},
    quick={"warmup": 1, "steps": 1, "rounds": 1, "small": True},
)
# The model.
N_EMBD, N_LAYER, N_HEAD, VOCAB, N_POSITIONS = 512, 8, 8, 4096, 512
# Fixed-shape generation (zero3, single, tp): prompts of PROMPT tokens; rank r's prompts from
# torch.Generator().manual_seed(PROMPT_SEED + r).
PROMPT, PROMPT_SEED = 32, 100
# The mixed-length workload of batching.
MAX_BATCH, BLOCK_SIZE, WORKLOAD_SEED = 8, 16, 2024
MIB = 2**20
TRAIN_TOKENS = 64  # the training step between generations: micro batch 1 of this many tokens


def shape(small: bool) -> dict:
    """The generation sizes of a run (small with --small)."""
    if small:
        return {"new": 4, "batches": (1, 2), "requests": 6, "prompt_range": (4, 20)} | {
            "new_range": (2, 10),
            "check_new": 4,
        }
    return {"new": 64, "batches": (1, 4), "requests": 32, "prompt_range": (8, 128)} | {
        "new_range": (8, 128),
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


class Recorder:
    """A worker's result, and the CPU accounting of its measured window (from `start()`)."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.busy0 = self.cpu0 = self.t0 = None

    def start(self) -> None:
        self.busy0, self.cpu0, self.t0 = (
            h.machine_busy_s(),
            time.process_time(),
            time.perf_counter(),
        )

    def result(self) -> dict:
        if self.t0 is not None:
            self.data["elapsed_s"] = time.perf_counter() - self.t0
            self.data["machine_busy_s"] = h.machine_busy_s() - self.busy0
            self.data["own_cpu_s"] = time.process_time() - self.cpu0
        return self.data | {"peak_rss_mib": h.peak_rss_mib()}


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
    torch.manual_seed(h.MODEL_SEED)
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
    sh = shape(args.small)
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
                a == b for a, b in zip(row["naive_tokens"], row["hybrid_tokens"])
            )

    rec.data["version_check"] = version_check(engine, sh["check_new"], rank, itp, timed)
    rec.data["generation_stats"] = dict(engine.generation_stats)


def version_check(engine, cn: int, rank: int, itp: int, timed) -> dict:
    """Generate, a training step, generate twice: the inference copy is rebuilt once per weight
    version, and the tokens follow the weights (`timed(fn)`: (out, seconds, gathers))."""
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
    return check


def worker_deepspeed_zero3(args, rec: Recorder, rank: int, world: int, barrier) -> None:
    """Part 1, DeepSpeed: its hybrid engine (expected not to run on CPU), then naive generation
    through its ZeRO-3 engine."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    sh = shape(args.small)
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
    except Exception as e:
        rec.data["naive"] = failure(e)


def hf_form(gen_fn):
    """A Hugging Face-form generate as call(ids, n) -> the new tokens."""

    def call(ids, n):
        with torch.no_grad():
            return gen_fn(ids, **hf_kwargs(ids, n))[:, ids.size(1) :].tolist()

    return call


def generation_path(name: str, shared):
    """(module, call(ids, n) -> new tokens, info) of one generation path of `worker_single`;
    hf, engine and direct share `shared` (init_inference at fp32 leaves it as it is)."""
    from shardspeed.inference.engine import init_inference
    from shardspeed.inference.generation import generate
    from shardspeed.inference.sampling import SamplingParams

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


def worker_single(args, rec: Recorder) -> None:
    """Part 2: the generation paths of one process, interleaved over the repetitions."""
    sh = shape(args.small)
    new = sh["new"]
    shared = build_model()  # hf, engine and direct: init_inference at fp32 leaves it as it is
    methods: dict = {}

    rec.data["weights_fp32_bytes"] = weight_bytes(shared)
    for name in METHOD_LABELS:
        try:
            module, call, info = generation_path(name, shared)
            entry = {"call": call, "clock": ForwardClock(module), "module": module}
            methods[name] = entry
            rec.data.setdefault("methods", {})[name] = {
                "weight_bytes": weight_bytes(module),
                "info": info,
                "runs": {},
            }
        except Exception as e:
            rec.data.setdefault("methods", {})[name] = failure(e)
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
    rec.data["kernel"] = int8_kernel_times(args.small)


def int8_kernel_times(small: bool) -> dict:
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
            for _ in range(20 if small else 200):
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
        for handle in self.handles:
            handle.remove()

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

    sh = shape(args.small)
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
    same = [a == b for a, b in zip(results["continuous"], results["static"])]
    rec.data["same_results"] = sum(same)
    rec.data["tokens_generated"] = sum(len(t) for t in results["continuous"])


def deepspeed_tp(world: int, policy: bool):
    """DeepSpeed's init_inference at tensor parallelism `world` (`policy`: GPT-2's row layers named)."""
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


def worker_tp(args, rec: Recorder, rank: int, world: int, barrier) -> None:
    """Part 4: batch-1 latency at tensor parallelism `world`, shardspeed then DeepSpeed."""
    import torch.distributed as dist

    from shardspeed.inference.engine import init_inference

    sh = shape(args.small)
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

    def ours():
        model = build_model()
        eng = init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32)
        return model, eng.generate

    measure("ours", ours)
    barrier()
    measure("deepspeed", lambda: deepspeed_tp(world, False))
    if world > 1:
        barrier()
        measure("deepspeed_policy", lambda: deepspeed_tp(world, True))
        # The all-reduce a row-parallel layer does at batch 1 decode: [1, 1, n_embd] fp32.
        x = torch.ones(1, 1, N_EMBD)
        for _ in range(20):
            dist.all_reduce(x)
        barrier()
        n = 50 if args.small else 400
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        rec.data["allreduce_us"] = 1e6 * (time.perf_counter() - t0) / n


def worker(mode: str, args) -> dict:
    threads = 2 if mode == "tp1_2threads" else args.threads
    rank, world = h.setup(threads, init=world_of(mode) > 1 or mode.startswith(("zero3", "deep")))
    if mode == "deepspeed_zero3":
        h.library("deepspeed")
    rec = Recorder()
    if mode in ("single", "batching"):
        (worker_single if mode == "single" else worker_batching)(args, rec)
    else:
        fn = worker_tp if mode.startswith("tp") else worker_zero3
        (worker_deepspeed_zero3 if mode == "deepspeed_zero3" else fn)(
            args, rec, rank, world, h.barrier
        )
    return rec.result() | {"shape": shape(args.small), "threads": threads}


def world_of(mode: str) -> int:
    return SCENARIO.modes[mode]


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def data_of(runs: dict, key: str) -> dict | None:
    """Rank 0's result of a mode's run, or None."""
    return runs[key][0] if runs.get(key) else None


def rank_data(runs: dict, key: str) -> list[dict]:
    return runs[key][0]["ranks"] if runs.get(key) else []


def sizes(runs: dict) -> dict:
    """The generation sizes the runs used."""
    return next(rs[0]["shape"] for rs in runs.values() if rs)


def ms(x) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


fmt = render.fmt


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def zero3_rows(runs: dict, world: int = 2) -> list[dict]:
    """Per batch size: naive and hybrid tokens/s (both ranks together)."""
    sh = sizes(runs)
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
    sh = sizes(runs)
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
    sh = sizes(runs)
    rows = []
    base: dict = {}
    for key, tp, threads in TP_RUNS:
        d = data_of(runs, key)
        if d is None:
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


def gather_table(runs: dict) -> str:
    """Rank 0's all-gathers during naive generation and during the hybrid path's first call."""
    rows = []
    for b, zb in ((data_of(runs, "zero3") or {}).get("batches") or {}).items():
        new = sizes(runs)["new"]
        for path, key in (("naive", "naive"), ("hybrid first call", "hybrid_first")):
            if key in zb:
                g = zb[key]
                mib = g["gather_bytes"] / MIB
                cells = [g["gather_calls"], f"{mib:.0f}", f"{mib / new:.1f}", f"{g['s']:.2f}"]
                rows.append([b, path, *cells, f"{1000 * g['s'] / new:.0f}"])
    head = ["batch per rank", "path", "all-gathers (rank 0)", "MiB gathered", "MiB per token"]
    return render.table([*head, "seconds", "ms per token"], rows, "rlrrrrr")


def version_table(runs: dict) -> str:
    """Generate, a training step, generate twice: times, copies built, and what the tokens did."""
    rows = []
    for key in ("zero3", "zero3_tp2"):
        vc = (data_of(runs, key) or {}).get("version_check")
        for s in (vc or {}).get("sequence", []):
            built = f"{s['gather_s']:.2f}" if s["built"] else "-"
            rows.append([key, s["label"], f"{s['s']:.2f}", s["copies_built"], built])
        if vc:
            same = [vc.get("changed_after_step"), vc.get("repeat_same")]
            same.append(vc.get("naive_after_identical"))
            rows.append([key, "tokens: changed after the step / repeat the same / = naive"])
            rows[-1] += [" / ".join(map(yes_no, same)), "-", "-"]
    head = ["mode", "call (batch 1)", "seconds", "copies built so far", "building it (s)"]
    return render.table(head, rows, "llrrr")


def decode_rows_table(runs: dict) -> str:
    """Batching's decode forwards: median ms by rows in the batch, and their total seconds."""
    rows = []
    for r in batching_rows(runs)[0]:
        f = r["forwards"] or {}
        by = ", ".join(f"{k}: {1000 * v:.1f}" for k, v in f.get("decode_by_rows", {}).items())
        cells = [fmt(f.get("decode_s"), ".2f"), fmt(f.get("prefill_s"), ".2f"), by]
        rows.append([r["kind"], *cells])
    head = ["batching", "decode forwards (s, all)", "prefill forwards (s, all)"]
    return render.table([*head, "median decode forward ms by rows"], rows, "lrrl")


def kernel_table(runs: dict) -> str:
    k = (data_of(runs, "single") or {}).get("kernel") or {}
    rows = [[n, fmt(k.get(f"fp32_{n}")), fmt(k.get(f"int8_{n}"))] for n in (1, PROMPT)]
    head = ["rows (512 -> 1536 linear, 1 thread)", "fp32 F.linear (us)"]
    return render.table([*head, "int8 _weight_int8pack_mm (us)"], rows, "rrr")


def runs_table(results: dict) -> str:
    rows = []
    for mode, world in SCENARIO.modes.items():
        rs = render.runs(results, mode)
        if not rs:
            rows.append([mode, world, "-", "-", "-", render.failure(results, mode)])
            continue
        r, load = rs[0], render.fmt(rs[0].get("other_load"), ".2f")
        cells = [f"{r['wall_s']:.0f}", load + " (noisy, kept)" * bool(r.get("noisy"))]
        rows.append([mode, f"{world} x {r['threads']}", *cells, f"{r['peak_rss_mib']:.0f}", "ok"])
    head = ["run", "processes x threads", "wall time (s)", "other load (cores)"]
    return render.table([*head, "peak RSS per rank (MiB)", "result"], rows, "llrrrl")


def tables(results: dict) -> dict:
    runs = results["runs"]
    if not any(runs.values()):
        return {"runs": runs_table(results)}
    out = {
        "zero3": zero3_table(zero3_rows(runs)),
        "gathers": gather_table(runs),
        "versions": version_table(runs),
        "single": single_table(single_rows(runs)),
        "kernel": kernel_table(runs),
        "batching": batching_table(*batching_rows(runs)),
        "decode-rows": decode_rows_table(runs),
        "tp": tp_table(tp_rows(runs)),
        "runs": runs_table(results),
        "run": render.run_line(results),
    }
    return out


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_inference.py")
