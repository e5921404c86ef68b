"""Inference on a random-weight GPT-2: hybrid engine, inference engine, batching, TP, DeepSpeed.

.venv/bin/python benchmarks/bench_inference.py [--quick] [--write]
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
import traceback

import torch

import harness as h
import render

MODES = dict(zero3=2, zero3_tp2=2, deepspeed_zero3=2, single=1, batching=1, tp1=1, tp2=2)
MODES["tp1_2threads"] = 1
SCENARIO = h.Scenario(
    name="inference",
    section="## Inference: hybrid engine, inference engine, continuous batching and TP",
    modes=MODES,
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


# The generation sizes of a run, by --small: new tokens, batch sizes, batching's requests and
# their prompt and new-token length ranges, the version check's new tokens.
SMALL = dict(new=4, batches=(1, 2), requests=6, prompt_range=(4, 20), new_range=(2, 10))
FULL = dict(new=64, batches=(1, 4), requests=32, prompt_range=(8, 128), new_range=(8, 128))
SHAPES = {True: SMALL | {"check_new": 4}, False: FULL | {"check_new": 16}}


def zero3_config(inference_tp: int | None) -> dict:
    """ZeRO-3 at micro batch 1, with the hybrid engine at `inference_tp` (None: without)."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW"}}
    cfg["zero_optimization"] = {"stage": 3}
    hybrid = {"hybrid_engine": {"enabled": True, "inference_tp_size": inference_tp}}
    return cfg | (hybrid if inference_tp else {})


def build_model():
    """The GPT-2 of every mode, built from the same seed (so the same weights everywhere)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = dict(vocab_size=VOCAB, n_positions=N_POSITIONS, n_embd=N_EMBD, n_layer=N_LAYER)
    config = GPT2Config(**sizes, n_head=N_HEAD, bos_token_id=None, eos_token_id=None)
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
    return h.Census().add("w", [*module.parameters(), *module.buffers()]).bytes["w"]


class ForwardClock:
    """Start, end and input shape of every forward of the model: TTFT and decode latency."""

    def __init__(self, model) -> None:
        self.forwards: list[list] = []  # [start, end or None, shape]
        pre = model.register_forward_pre_hook(self._pre, with_kwargs=True)
        self.handles = [pre, model.register_forward_hook(self._post)]

    def _pre(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = tuple(ids.shape) if ids is not None else None
        self.forwards.append([time.perf_counter(), None, shape])

    def _post(self, _module, _args, _out) -> None:
        self.forwards[-1][1] = time.perf_counter()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def timed(self, fn, barrier=None):
        """(fn(), timing): total, forwards, time to first token, decode intervals."""
        if barrier:
            barrier()
        self.forwards.clear()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        s = [f[0] for f in self.forwards]
        e = [f[1] for f in self.forwards if f[1] is not None]
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

    def by_shape(self) -> dict:
        """Prefill and decode seconds in all, and the median decode forward by rows."""
        times: dict[tuple[int, int], list[float]] = {}
        for start, end, shape in self.forwards:
            times.setdefault(shape, []).append(end - start)
        decode = {r: v for (r, w), v in sorted(times.items()) if w == 1}
        out = {"prefill_s": sum(sum(v) for (_r, w), v in times.items() if w > 1)}
        out["decode_s"] = sum(sum(v) for v in decode.values())
        out["decode_by_rows"] = {str(r): statistics.median(v) for r, v in decode.items()}
        return out | {"n": {str(r): len(v) for r, v in decode.items()}}


def failure(e: BaseException) -> dict:
    """An exception as a result: its type and first line, and where it was raised."""
    frames = traceback.extract_tb(e.__traceback__)
    where = ""
    if frames:
        # The innermost frame in a library under test (torch's own frames say less).
        libs = ("deepspeed/", "shardspeed/", "transformers/")
        f = ([f for f in frames if any(lib in f.filename for lib in libs)] or frames)[-1]
        names = [f.filename.split(m, 1)[1] for m in ("site-packages/", "src/") if m in f.filename]
        name = (names or [f.filename])[0]
        where = f"{name}:{f.lineno}"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    return {"error": f"{type(e).__name__}: {first}", "where": where}


def worker_zero3(args, data: dict, window: h.Window, rank: int, world: int) -> None:
    """Part 1, shardspeed: naive ZeRO-3 against `engine.generate`, then the version check."""
    import shardspeed
    from shardspeed.comm import comm_volume, reset_comm_volume

    itp = 2 if args.worker == "zero3_tp2" else 1
    sh = SHAPES[args.small]
    model = build_model()
    data["params"] = sum(p.numel() for p in model.parameters())
    data["config"] = cfg = zero3_config(itp)
    engine, *_ = shardspeed.initialize(model=model, config=cfg)
    engine.eval()  # dropout off for the naive path (the hybrid copy is in eval mode anyway)

    @torch.no_grad()
    def naive(ids, n):
        return hf_generate(engine.module.generate, ids, n)

    def hybrid(ids, n):
        return engine.generate(ids, max_new_tokens=n, do_sample=False)

    def timed(fn) -> tuple[list, dict]:
        """fn()'s new tokens, and its seconds, all-gathers and inference copies built."""
        stats = engine.generation_stats
        built, gather_s = stats["copies_built"], stats["gather_s"]
        h.barrier()
        reset_comm_volume()
        t0 = time.perf_counter()
        out = fn()
        h.barrier()
        t = {"s": time.perf_counter() - t0, "copies_built": engine.generation_stats["copies_built"]}
        t["built"] = t["copies_built"] - built
        t["gather_s"] = engine.generation_stats["gather_s"] - gather_s
        gathers = [v for k, v in comm_volume().items() if k.startswith("all_gather")]
        t["gather_calls"] = sum(v["calls"] for v in gathers)
        t["gather_bytes"] = sum(v["bytes"] for v in gathers)
        return out[:, PROMPT:].tolist(), t

    window.start()
    data["batches"] = parts = {}
    for b in sh["batches"]:
        ids = prompts(b, rank)
        row = parts[str(b)] = {"batch": b}
        if itp == 1:
            row["naive_tokens"], row["naive"] = timed(lambda ids=ids: naive(ids, sh["new"]))
        runs = [timed(lambda ids=ids: hybrid(ids, sh["new"])) for _ in range(1 + args.steps)]
        row["hybrid_tokens"], row["hybrid_first"] = runs[0]
        row["hybrid_steady"] = [t for _, t in runs[1:]]
        if any(tokens != row["hybrid_tokens"] for tokens, _ in runs[1:]):
            row["hybrid_repeat_differs"] = True
        if itp == 1:
            pairs = zip(row["naive_tokens"], row["hybrid_tokens"])
            row["identical"] = row["naive_tokens"] == row["hybrid_tokens"]
            row["rows_identical"] = sum(a == b for a, b in pairs)

    ids, cn, seq = prompts(1, rank), sh["check_new"], []

    def generate(label: str) -> list[int]:
        tokens, t = timed(lambda: hybrid(ids, cn))
        seq.append({"label": label} | t)
        return tokens[0]

    before = generate("generate (weights v0)")
    engine.train()
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randint(0, VOCAB, (1, TRAIN_TOKENS), generator=gen)
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    after = generate("generate after one training step (weights v1)")
    again = generate("generate again (weights v1)")
    check: dict = {"sequence": seq, "loss": loss.item(), "new_tokens": cn}
    check |= {"changed_after_step": before != after, "repeat_same": after == again}
    if itp == 1:
        check["naive_after_identical"] = naive(ids, cn)[0, PROMPT:].tolist() == after
    data["version_check"] = check
    data["generation_stats"] = dict(engine.generation_stats)


def worker_deepspeed_zero3(args, data: dict, window: h.Window, rank: int, world: int) -> None:
    """Part 1, DeepSpeed: its hybrid engine, then naive generation through its ZeRO-3."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    sh = SHAPES[args.small]

    def engine(inference_tp: int | None):
        model = build_model()
        cfg, params = zero3_config(inference_tp), model.parameters()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
        return engine.eval()

    window.start()
    try:
        hf_generate(engine(1).generate, prompts(1, rank), sh["new"])
        data["hybrid"] = {"ran": True}
    except Exception as e:
        data["hybrid"] = failure(e)
    h.barrier()
    try:
        generate, naive = hf_form(engine(None).module.generate), {}
        for b in sh["batches"]:
            ids = prompts(b, rank)
            h.barrier()
            t0 = time.perf_counter()
            tokens = generate(ids, sh["new"])
            h.barrier()
            naive[str(b)] = {"s": time.perf_counter() - t0, "tokens": tokens}
            data["naive"] = naive
    except Exception as e:
        data["naive"] = failure(e)


def hf_generate(gen_fn, ids: torch.Tensor, n: int):
    """A Hugging Face-form generate: greedy, `n` new tokens, pad 0, all-ones attention mask."""
    mask = torch.ones_like(ids)
    return gen_fn(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)


def hf_form(gen_fn):
    """A Hugging Face-form generate as call(ids, n) -> the new tokens."""

    @torch.no_grad()
    def call(ids, n):
        return hf_generate(gen_fn, ids, n)[:, ids.size(1) :].tolist()

    return call


def generation_path(name: str, shared):
    """(module, call(ids, n) -> new tokens, info) of one generation path of `worker_single`."""
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
        info = {"linear_bytes_before": rep.bytes_before, "linear_bytes_after": rep.bytes_after}
        info |= {"quantized": len(rep.quantized), "skipped": list(rep.skipped)}
        return model, hf_form(eng.generate), info
    if name == "deepspeed":
        eng = deepspeed_inference(1)
        return eng.module, hf_form(eng.generate), {"engine": type(eng).__module__}
    raise ValueError(name)


def worker_single(args, data: dict, window: h.Window, _rank: int, _world: int) -> None:
    """Part 2: the generation paths of one process, interleaved over the repetitions."""
    sh = SHAPES[args.small]
    shared = build_model()  # hf, engine and direct: init_inference at fp32 leaves it as it is
    data["weights_fp32_bytes"] = weight_bytes(shared)
    out, paths = data.setdefault("methods", {}), {}
    for name in METHOD_LABELS:
        try:
            module, call, info = generation_path(name, shared)
            paths[name] = (module, call, ForwardClock(module))
            out[name] = {"weight_bytes": weight_bytes(module), "info": info, "runs": {}}
        except Exception as e:
            out[name] = failure(e)
    for _ in range(args.warmup):  # every path at every batch size, a few tokens
        for (_module, call, _clock), b in itertools.product(paths.values(), sh["batches"]):
            with contextlib.suppress(Exception):
                call(prompts(b, 0), 4)
    window.start()
    for _rep in range(args.steps):
        for name, (module, call, clock) in list(paths.items()):
            for b in sh["batches"]:
                ids = prompts(b, 0)
                try:
                    tokens, timing = clock.timed(lambda call=call, ids=ids: call(ids, sh["new"]))
                except Exception as e:
                    out[name] = failure(e) | {"weight_bytes": weight_bytes(module)}
                    del paths[name]
                    break
                out[name]["runs"].setdefault(str(b), []).append(timing)
                out[name].setdefault("tokens", {})[str(b)] = tokens
    data["kernel"] = int8_kernel_times(args.small)


def int8_kernel_times(small: bool) -> dict:
    """Median microseconds of fp32 `F.linear` and the int8 kernel on 512 -> 1536 linears."""
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


def worker_batching(args, data: dict, window: h.Window, _rank: int, _world: int) -> None:
    """Part 3: continuous against static batching on the mixed-length workload."""
    import dataclasses

    from shardspeed.inference.generation import ContinuousBatcher
    from shardspeed.inference.sampling import SamplingParams

    sh = SHAPES[args.small]
    reqs = workload(sh["requests"], sh["prompt_range"], sh["new_range"])
    needs = sorted((-(-(len(p) + m - 1) // BLOCK_SIZE) for p, m in reqs), reverse=True)
    cache_blocks = sum(needs[:MAX_BATCH])
    model = build_model()
    data["workload"] = {"requests": len(reqs), "prompt_lengths": [len(p) for p, _ in reqs]}
    data["workload"] |= {"max_new_tokens": [m for _, m in reqs], "cache_blocks": cache_blocks}
    data["workload"] |= {"block_size": BLOCK_SIZE, "max_batch_size": MAX_BATCH}
    # Warm-up: a few requests through a small batcher.
    for _ in range(args.warmup):
        b = ContinuousBatcher(model, MAX_BATCH, cache_blocks, BLOCK_SIZE)
        for p, _m in reqs[:MAX_BATCH]:
            b.add_request(p, SamplingParams(max_new_tokens=4))
        b.run()
    window.start()
    runs = data["runs"] = {"continuous": [], "static": []}
    results: dict = {}
    for rep in range(max(1, min(args.steps, 2))):
        order = ("continuous", "static") if rep % 2 == 0 else ("static", "continuous")
        for kind in order:
            sizes = (MAX_BATCH, cache_blocks, BLOCK_SIZE)
            batcher = ContinuousBatcher(model, *sizes, continuous=kind == "continuous")
            ids = [batcher.add_request(p, SamplingParams(max_new_tokens=m)) for p, m in reqs]
            clock = ForwardClock(model) if rep == 0 else None
            done_at: dict[int, float] = {}
            t0 = time.perf_counter()
            while batcher.has_pending():
                for rid in batcher.step():
                    done_at[rid] = time.perf_counter() - t0
            total = time.perf_counter() - t0
            out = batcher.run()
            run = {"s": total, "stats": dataclasses.asdict(batcher.stats)}
            run["latency_s"] = [done_at[i] for i in ids]
            runs[kind].append(run | {"forwards": clock.by_shape() if clock else None})
            if clock:
                clock.remove()
            results.setdefault(kind, [out[i] for i in ids])
    same = [a == b for a, b in zip(results["continuous"], results["static"])]
    data["same_results"] = sum(same)
    data["tokens_generated"] = sum(len(t) for t in results["continuous"])


def deepspeed_inference(tp: int, policy: bool = False):
    """DeepSpeed's init_inference at fp32 and TP `tp` (`policy`: GPT-2's row layers named)."""
    import deepspeed
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    deepspeed.init_distributed(dist_backend="gloo")
    kw = {"injection_policy": {GPT2Block: ("attn.c_proj", "mlp.c_proj")}} if policy else {}
    kw |= dict(tensor_parallel={"tp_size": tp}, replace_with_kernel_inject=False)
    return deepspeed.init_inference(build_model(), dtype=torch.float32, **kw)


def worker_tp(args, data: dict, window: h.Window, rank: int, world: int) -> None:
    """Part 4: batch-1 latency at tensor parallelism `world`, shardspeed then DeepSpeed."""
    import torch.distributed as dist

    from shardspeed.comm import comm_volume, reset_comm_volume
    from shardspeed.inference.engine import init_inference

    new = SHAPES[args.small]["new"]
    ids = prompts(1, 0)  # every rank of the group the same prompt
    impls = data["impls"] = {}
    window.start()

    def measure(name: str, make) -> None:
        try:
            module, gen_fn = make()
        except Exception as e:
            impls[name] = failure(e)
            return
        clock, call = ForwardClock(module), hf_form(gen_fn)
        entry = impls[name] = {"weight_bytes": weight_bytes(module), "runs": []}
        try:
            for _ in range(args.warmup):
                call(ids, 4)
            for i in range(args.steps):
                reset_comm_volume()  # shardspeed's collectives only: the first call's are kept
                tokens, timing = clock.timed(lambda: call(ids, new), h.barrier)
                if name == "ours" and i == 0:
                    entry["comm"] = comm_volume()
                entry["runs"].append(timing)
                entry["tokens"] = tokens
        except Exception as e:
            impls[name] = failure(e)

    def ours():
        model = build_model()
        eng = init_inference(model, tensor_parallel={"tp_size": world}, dtype=torch.float32)
        return model, eng.generate

    def deepspeed(policy: bool = False):
        eng = deepspeed_inference(world, policy)
        return eng.module, eng.generate

    measure("ours", ours)
    h.barrier()
    measure("deepspeed", deepspeed)
    if world > 1:
        h.barrier()
        measure("deepspeed_policy", lambda: deepspeed(policy=True))
        # The all-reduce a row-parallel layer does at batch 1 decode: [1, 1, n_embd] fp32.
        x = torch.ones(1, 1, N_EMBD)
        for _ in range(20):
            dist.all_reduce(x)
        h.barrier()
        n = 50 if args.small else 400
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(x)
        data["allreduce_us"] = 1e6 * (time.perf_counter() - t0) / n


WORKERS = {"zero3": worker_zero3, "zero3_tp2": worker_zero3}
WORKERS |= {"deepspeed_zero3": worker_deepspeed_zero3, "single": worker_single}
WORKERS |= {"batching": worker_batching, "tp1": worker_tp, "tp2": worker_tp}
WORKERS["tp1_2threads"] = worker_tp


def worker(mode: str, args) -> dict:
    threads = 2 if mode == "tp1_2threads" else args.threads
    rank, world = h.setup(threads, init=SCENARIO.modes[mode] > 1)
    if mode == "deepspeed_zero3":
        h.library("deepspeed")
    data, window = {}, h.Window(sync=lambda: None)
    WORKERS[mode](args, data, window, rank, world)
    window.stop()
    extra = {"peak_rss_mib": h.peak_rss_mib(), "shape": SHAPES[args.small], "threads": threads}
    return data | window.result() | extra


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


def yes_no(x) -> str:
    return "-" if x is None else ("yes" if x else "NO")


def zero3_table(runs: dict, world: int = 2) -> str:
    """Per batch size: naive and hybrid tokens/s (both ranks together)."""
    sh, out = sizes(runs), []
    ds_naive = (data_of(runs, "deepspeed_zero3") or {}).get("naive")

    def batch(data: dict | None, b: int) -> dict:
        return (data or {}).get("batches", {}).get(str(b), {})

    def steady_tps(part: dict, tokens: int) -> float | None:
        steady = [r["s"] for r in part["hybrid_steady"]]
        return tokens / med(steady) if steady else None

    for b in sh["batches"]:
        tokens = world * b * sh["new"]
        zb, z2b = batch(data_of(runs, "zero3"), b), batch(data_of(runs, "zero3_tp2"), b)
        naive = tokens / zb["naive"]["s"] if "naive" in zb else None
        first, steady, verdict, ident, tp2, ds = "-", None, "-", None, "-", "-"
        if "hybrid_first" in zb:
            f = zb["hybrid_first"]
            built = f"{f['gather_s']:.2f} building the copy" if f["built"] else "copy already built"
            first = f"{f['s']:.2f} ({built})"
            steady = steady_tps(zb, tokens)
            if naive and steady:
                verdict = f"{steady / naive:.2f}x {'met' if steady / naive >= 5 else 'MISSED'}"
            # Identity on every rank: each rank generated its own prompts.
            ranks = [batch(r, b) for r in rank_data(runs, "zero3")]
            ident = all(x.get("identical") for x in ranks) if ranks else zb.get("identical")
        if "hybrid_first" in z2b and (tp2_tps := steady_tps(z2b, tokens)):
            pairs = list(zip(rank_data(runs, "zero3"), rank_data(runs, "zero3_tp2")))
            naive_tokens = [batch(a, b).get("naive_tokens") for a, _ in pairs]
            same = [x == batch(c, b).get("hybrid_tokens") for x, (_, c) in zip(naive_tokens, pairs)]
            tp2 = f"{z2b['hybrid_first']['s']:.2f} / {tp2_tps:.1f} / "
            tp2 += f"{fmt(naive and tp2_tps / naive, '.2f')}x / "
            tp2 += yes_no(all(same) if pairs else None)
        if isinstance(ds_naive, dict) and str(b) in ds_naive:
            ds = f"{tokens / ds_naive[str(b)]['s']:.1f}"
            if zb.get("naive_tokens") is not None:
                same = ds_naive[str(b)]["tokens"] == zb["naive_tokens"]
                ds += f" (tokens {'the same as' if same else 'DIFFER from'} ours)"
        cells = [fmt(naive, ".1f"), first, fmt(steady, ".1f"), verdict, yes_no(ident), tp2, ds]
        out.append([b, *cells])
    head = "batch per rank | naive (ZeRO-3 hooks) tok/s | hybrid first call (s; copy built in)"
    head += " | hybrid steady tok/s | speedup (target >= 5x) | identical to naive | hybrid"
    head += " inference_tp_size 2: first call (s) / steady tok/s / vs naive / identical"
    return render.table(head + " | DeepSpeed ZeRO-3 naive tok/s", out, "rrlrrllr")


TIMING_KEYS = ("ttft_s", "decode_median_s", "forward_median_s")
METHOD_LABELS = {
    "hf": "Hugging Face `model.generate` (its own KV cache)",
    "engine": "shardspeed `init_inference(model, dtype=torch.float32).generate` (HF form)",
    "direct": "shardspeed `generate(model, prompts, SamplingParams(max_new_tokens=N))`",
    "int8": "shardspeed `init_inference(model, dtype=torch.int8).generate` (weight-only int8)",
    "deepspeed": "DeepSpeed `init_inference(model, tensor_parallel={'tp_size': 1}, "
    "dtype=torch.float32, replace_with_kernel_inject=False).generate`",
}


def single_table(runs: dict) -> str:
    sh = sizes(runs)
    methods = (data_of(runs, "single") or {}).get("methods", {})
    ref, hf_tps, out = methods.get("hf", {}).get("tokens", {}), {}, []
    for name, label in METHOD_LABELS.items():  # hf first: the others' reference
        m = methods.get(name) or {"error": "not run"}
        if "error" in m:
            error = f"error: `{m['error']}` (at {m.get('where')})"
            mem = fmt(m["weight_bytes"] / MIB if "weight_bytes" in m else None, ".1f")
            out.append([label, "-", error, "-", "-", "-", "-", mem, "-"])
            continue
        for b in sh["batches"]:
            rr = m["runs"].get(str(b), [])
            if not rr:
                continue
            tps = b * sh["new"] / med([r["total_s"] for r in rr])
            hf_tps.setdefault(b, tps if name == "hf" else None)
            same = "-"
            toks, want = m.get("tokens", {}).get(str(b)), ref.get(str(b))
            if toks is not None and want is not None:
                flat = [(x, y) for a, c in zip(toks, want) for x, y in zip(a, c)]
                agree = sum(x == y for x, y in flat) / len(flat)
                same = "yes (identical)" if toks == want else f"{100 * agree:.1f}% of tokens"
            vs_hf = fmt(hf_tps[b] and tps / hf_tps[b], ".2f")
            cells = [f"{tps:.1f}", f"{vs_hf}x"]
            cells += [ms(med([r.get(k) for r in rr])) for k in TIMING_KEYS]
            out.append([label, b, *cells, f"{m['weight_bytes'] / MIB:.1f}", same])
    head = "generation path | batch | tokens/s | vs HF | time to first token (ms)"
    head += " | decode ms/token (median) | of which the model forward (ms) | weight memory (MiB)"
    return render.table(head + " | same tokens as HF", out, "lrrrrrrrl")


def batching_runs(runs: dict) -> dict[str, list[dict]]:
    """The batching run's repetitions by kind (continuous, static), the kinds that ran."""
    by_kind = (data_of(runs, "batching") or {}).get("runs", {})
    return {kind: by_kind[kind] for kind in ("continuous", "static") if by_kind.get(kind)}


def batching_table(runs: dict) -> str:
    workload, out = (data_of(runs, "batching") or {}).get("workload"), []
    for kind, rr in batching_runs(runs).items():
        st, seconds = rr[0]["stats"], [r["s"] for r in rr]
        total, lat = med(seconds), sorted(rr[0]["latency_s"])
        # Tokens from decode forwards: every token but each request's first (its prefill's).
        decoded = st["tokens_generated"] - workload["requests"]
        occupancy = decoded / st["decode_steps"] if st["decode_steps"] else None
        cells = [f"{total:.2f} ({', '.join(f'{x:.2f}' for x in seconds)})"]
        cells += [f"{st['tokens_generated'] / total:.1f}", st["steps"], st["decode_steps"]]
        cells += [fmt(occupancy, ".2f"), st["joined_while_running"]]
        cells.append(f"{st['peak_blocks_in_use']} of {workload['cache_blocks']}")
        latency = f"{statistics.mean(lat):.2f} / {lat[len(lat) // 2]:.2f} / {lat[-1]:.2f}"
        out.append([kind, *cells, latency])
    head = "batching | total time (s) | tokens/s | steps | decode forwards | mean batch occupancy"
    head += " (of 8) | requests joined a running batch | peak KV blocks in use | request"
    return render.table(head + " completion time mean / median / last (s)", out, "lrrrrrrrl")


TP_LABELS = {
    "ours": "shardspeed `init_inference(tensor_parallel={'tp_size': t})`",
    "deepspeed": "DeepSpeed `init_inference(tensor_parallel={'tp_size': t}, "
    "replace_with_kernel_inject=False)`",
    "deepspeed_policy": "DeepSpeed, same plus `injection_policy={GPT2Block: ('attn.c_proj', "
    "'mlp.c_proj')}`",
}
TP_RUNS = (("tp1", 1, 1), ("tp2", 2, 1), ("tp1_2threads", 1, 2))


def tp_table(runs: dict) -> str:
    """Batch-1 latency per implementation and tp; speed-ups and tokens against tp 1."""
    out, base = [], {}
    for key, tp, threads in TP_RUNS:  # tp1 first: the others' reference
        for impl, e in ((data_of(runs, key) or {}).get("impls") or {}).items():
            head = [TP_LABELS.get(impl, impl), tp, f"{tp} x {threads}"]
            if "error" in e:
                out.append([*head, f"error: `{e['error']}` (at {e.get('where')})", *["-"] * 6])
                continue
            if not e.get("runs"):
                continue
            ttft, decode, forward = (med([r.get(k) for r in e["runs"]]) for k in TIMING_KEYS)
            tps = sizes(runs)["new"] / med([r["total_s"] for r in e["runs"]])
            row = {"ttft": ttft, "decode": decode, "tokens": e.get("tokens")}
            if key == "tp1":
                base[impl] = row
            b, sp, same = base.get(impl) or base.get("ours"), "-", "-"
            if key != "tp1":
                up = b and decode and b["decode"]
                ratios = [up and b["ttft"] / ttft, up and b["decode"] / decode]
                sp = " / ".join(f"{fmt(x, '.2f')}x" for x in ratios)
                known = b and row["tokens"] is not None and b["tokens"] is not None
                same = yes_no(row["tokens"] == b["tokens"] if known else None)
            cells = [ms(ttft), ms(decode), ms(forward), sp, f"{tps:.1f}"]
            out.append([*head, *cells, f"{e['weight_bytes'] / MIB:.1f}", same])
    head = "implementation | tp | processes x threads | time to first token (ms) | decode"
    head += " ms/token (median) | of which the model forward (ms) | speedup over tp 1 (first"
    head += " token / decode) | tokens/s | weight memory per rank (MiB) | same tokens as tp 1"
    return render.table(head, out, "lrlrrrlrrl")


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
    for kind, rr in batching_runs(runs).items():
        f = rr[0].get("forwards") or {}
        by = ", ".join(f"{k}: {1000 * v:.1f}" for k, v in f.get("decode_by_rows", {}).items())
        cells = [fmt(f.get("decode_s"), ".2f"), fmt(f.get("prefill_s"), ".2f"), by]
        rows.append([kind, *cells])
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
        "zero3": zero3_table(runs),
        "gathers": gather_table(runs),
        "versions": version_table(runs),
    }
    out |= {"single": single_table(runs), "kernel": kernel_table(runs)}
    out |= {"batching": batching_table(runs), "decode-rows": decode_rows_table(runs)}
    out |= {"tp": tp_table(runs), "runs": runs_table(results)}
    return out | {"run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_inference.py")
