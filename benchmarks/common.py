"""Pieces shared by the benchmark scripts not yet moved onto harness.py (bench_checkpoint,
bench_offload, bench_offload_headline, bench_inference, bench_autotune, bench_hf, bench_gpu).

The model, the batches, the timed loop a worker runs, how the orchestrator starts a worker under
``torch.distributed.run``, the rounds with load-noise detection, the ratio and per-mode tables, the
command-line options every script shares (worker, smoke, write and note options), the end of an
orchestrator's output, and the section of BENCHMARKS.md (its header, its closing notes, its
update). The scripts put this directory first on ``sys.path`` (as Python does for the script being
run), so ``import common`` finds this file.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
BENCH_MD = REPO / "BENCHMARKS.md"

# Model / data shape (small GPT-style LM, a few million parameters).
VOCAB = 4096
D_MODEL = 256
N_LAYERS = 4
N_HEADS = 4
SEQ = 128
MICRO_BATCH = 8
MODEL_SEED = 1234
DATA_SEED = 4321
LR = 3e-4
CLIP = 1.0

# Orchestration defaults.
ROUNDS = 3
WARMUP = 5
STEPS = 20


def ds_config(micro_batch: int, stage: int = 0) -> dict:
    """The config given verbatim to both shardspeed and DeepSpeed."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
    }


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def build_model():
    """examples/gpt.py's GPT at this module's shape constants (read at call time, so scripts
    scale it by setting them), with PyTorch's default initialisation, built under MODEL_SEED;
    `model(x, y)` returns the loss."""
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(MODEL_SEED)
    shape = dict(vocab_size=VOCAB, block_size=SEQ, n_layer=N_LAYERS, n_head=N_HEADS)
    return GPT(GPTConfig(**shape, n_embd=D_MODEL, init="torch"))


def make_batches(rank: int, n: int, micro_batch: int):
    """Deterministic synthetic batches: batch i of rank r is the same in every mode."""
    import torch

    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(DATA_SEED + 1_000_003 * rank + i)
        seq = torch.randint(0, VOCAB, (micro_batch, SEQ + 1), generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def worker_setup(threads: int, *, init: bool = True) -> tuple[int, int]:
    """A worker's start under ``torch.distributed.run``: torch's thread count, its rank and world
    size, and (``init``) the gloo process group. Returns (rank, world)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if init:
        dist.init_process_group("gloo")
    return rank, world


def machine_busy_s() -> float:
    """Machine-wide busy CPU seconds (all cores) from /proc/stat; nan where unavailable."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return float("nan")
    idle = f[3] + (f[4] if len(f) > 4 else 0)
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_run(
    step: Callable,
    batches: list,
    args,
    *,
    mode: str,
    rank: int,
    world: int,
    n_params: int,
    barrier: Callable[[], None],
) -> dict:
    """Warm-up steps, a barrier, the timed steps (rank 0 optionally profiled), a barrier.

    Returns the result dict a worker writes (tokens/s, ms/step, peak RSS so far, losses, CPU
    accounting); writes the profile files when ``args.profile_dir`` is set (rank 0).
    """
    import torch

    losses = []
    for x, y in batches[: args.warmup]:
        losses.append(step(x, y).item())
    barrier()

    prof_ctx = contextlib.nullcontext()
    cprof = None
    if args.profile_dir and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        prof_ctx = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
        import cProfile

        cprof = cProfile.Profile()

    with prof_ctx as prof:
        if cprof:
            cprof.enable()
        busy0, cpu0 = machine_busy_s(), time.process_time()
        t0 = time.perf_counter()
        for x, y in batches[args.warmup : args.warmup + args.steps]:
            loss = step(x, y)
        last = loss.item()
        barrier()
        elapsed = time.perf_counter() - t0
        busy1, cpu1 = machine_busy_s(), time.process_time()
        if cprof:
            cprof.disable()
    losses.append(last)

    tokens = args.steps * args.micro_batch * SEQ * world
    result = {
        "mode": mode,
        "world_size": world,
        "rank": rank,
        "threads": torch.get_num_threads(),
        "params": n_params,
        "steps": args.steps,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "step_ms": 1000 * elapsed / args.steps,
        "peak_rss_mib": peak_rss_mib(),
        "machine_busy_s": busy1 - busy0,
        "own_cpu_s": cpu1 - cpu0,
        "first_loss": losses[0],
        "last_loss": last,
        "torch": torch.__version__,
    }
    if args.profile_dir and rank == 0:
        import io
        import pstats

        pdir = Path(args.profile_dir)
        pdir.mkdir(parents=True, exist_ok=True)
        (pdir / f"{mode}_ws{world}_ops.txt").write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        )
        s = io.StringIO()
        pstats.Stats(cprof, stream=s).sort_stats("cumulative").print_stats(60)
        (pdir / f"{mode}_ws{world}_cprofile.txt").write_text(s.getvalue())
        s = io.StringIO()
        pstats.Stats(cprof, stream=s).sort_stats("tottime").print_stats(40)
        (pdir / f"{mode}_ws{world}_cprofile_tottime.txt").write_text(s.getvalue())
    return result


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def wait_idle(max_wait: float, threshold: float = 0.3) -> float:
    """Wait (at most max_wait s) until the machine uses < threshold cores; return the last load."""
    deadline = time.perf_counter() + max_wait
    while True:
        b0, t0 = machine_busy_s(), time.perf_counter()
        time.sleep(1.0)
        load = (machine_busy_s() - b0) / (time.perf_counter() - t0)
        if not load >= threshold or time.perf_counter() >= deadline:
            return load


def run_one(
    script: Path, mode: str, world: int, args, tmp: Path, tag: str, profile_dir: str | None = None
):
    """One measured run: ``torch.distributed.run`` of ``script --worker MODE``; rank 0's result
    with ``peak_rss_mib`` the max over ranks, ``ranks`` every rank's result, ``wall_s`` and
    ``foreign_cores`` added (or a dict with ``error`` and the log's tail)."""
    if args.wait_idle > 0:
        wait_idle(args.wait_idle)
    out = tmp / f"{tag}_{mode}_ws{world}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        str(script),
        "--worker",
        mode,
        "--out",
        str(out),
        "--threads",
        str(args.threads),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--micro-batch",
        str(args.micro_batch),
    ]
    if profile_dir:
        cmd += ["--profile-dir", profile_dir]
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("PYTHONUNBUFFERED", "1")
    log = tmp / f"{tag}_{mode}_ws{world}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-4000:]
        return {"mode": mode, "world_size": world, "error": f"exit {proc.returncode}", "log": tail}
    ranks = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
    r0 = dict(ranks[0])
    r0["ranks"] = ranks
    r0["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)
    r0["wall_s"] = wall
    # CPU used during the timed window by anything other than this run's ranks, in cores.
    own = sum(r["own_cpu_s"] for r in ranks)
    r0["foreign_cores"] = max(0.0, (r0["machine_busy_s"] - own) / r0["elapsed_s"])
    return r0


def ratio_text(a, b, digits: int = 3) -> str:
    """a / b for a table cell; '-' where either is missing."""
    return f"{a / b:.{digits}f}" if a and b else "-"


def comparisons_among(rows: Sequence[tuple], modes: Collection[str], world: int) -> list:
    """The ``(a, b, target, label)`` rows of ``summarize`` whose two modes both run, at
    ``world``."""
    return [
        ((a, world), (b, world), target, label)
        for a, b, target, label in rows
        if a in modes and b in modes
    ]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def measure(
    script: Path, plan: Sequence[tuple[str, int]], args, prefix: str = "bench_", width: int = 9
):
    """Run every (mode, world) of ``plan`` ``args.rounds`` times, interleaved, the order rotated
    every round; rerun a run whose timed window saw more than ``args.max_other_load`` cores of
    other work (up to ``args.retries`` times, until ``args.budget`` seconds have passed)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    plan = list(plan)
    results: dict[tuple[str, int], list[dict]] = {k: [] for k in plan}
    errors: dict[tuple[str, int], dict] = {}
    discarded: list[dict] = []
    t_start = time.perf_counter()
    for rnd in range(args.rounds):
        # Rotate the order every round so no mode always runs first / last.
        order = plan[rnd % len(plan) :] + plan[: rnd % len(plan)]
        for mode, world in order:
            if (mode, world) in errors:
                continue
            for attempt in range(args.retries + 1):
                r = run_one(script, mode, world, args, tmp, f"r{rnd}a{attempt}")
                if "error" in r or r["foreign_cores"] <= args.max_other_load:
                    break
                over_budget = time.perf_counter() - t_start > args.budget
                if attempt == args.retries or over_budget:
                    r["noisy"] = True
                    break
                discarded.append(r)
                print(
                    f"[round {rnd}] {mode:{width}s} ws{world}: {r['tokens_per_s']:8.0f} tok/s discarded "
                    f"(other load {r['foreign_cores']:.2f} cores > {args.max_other_load}), retrying",
                    flush=True,
                )
            if "error" in r:
                errors[(mode, world)] = r
                print(f"[round {rnd}] {mode} ws{world}: FAILED ({r['error']})", flush=True)
                continue
            results[(mode, world)].append(r)
            print(
                f"[round {rnd}] {mode:{width}s} ws{world}: {r['tokens_per_s']:8.0f} tok/s "
                f"({r['step_ms']:.0f} ms/step, rss {r['peak_rss_mib']:.0f} MiB, "
                f"loss {r['first_loss']:.4f}->{r['last_loss']:.4f}, run {r['wall_s']:.0f}s, "
                f"other load {r['foreign_cores']:.2f} cores{', NOISY' if r.get('noisy') else ''})",
                flush=True,
            )
    total = time.perf_counter() - t_start
    return results, errors, total, tmp, discarded


def summarize(results, errors, comparisons):
    """The ratio table (one row per ``(a, b, target, label)`` of ``comparisons``; target None:
    information only) and the per-mode table, as markdown; and the rows as dicts."""
    med = {k: median([r["tokens_per_s"] for r in v]) if v else None for k, v in results.items()}
    rss = {k: max(r["peak_rss_mib"] for r in v) if v else None for k, v in results.items()}

    def per_round_ratios(a, b):
        ra, rb = results.get(a, []), results.get(b, [])
        return [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(ra, rb)]

    rows = []
    for a, b, target, label in comparisons:
        if (a not in results and b not in results) or (target is None and b not in results):
            continue
        ma, mb = med.get(a), med.get(b)
        ratio = ma / mb if ma and mb else None
        rounds = per_round_ratios(a, b)
        if ratio is None:
            verdict = "not measured"
        elif target is None:
            verdict = "info only"
        else:
            verdict = "met" if ratio >= target else "MISSED"
        rows.append(
            {
                "label": label,
                "ratio": ratio,
                "target": target,
                "verdict": verdict,
                "per_round": rounds,
                "a": ma,
                "b": mb,
                "a_state": "error" if a in errors else "not run",
                "b_state": "error" if b in errors else "not run",
            }
        )

    lines = []
    lines.append(
        "| comparison | ours tok/s | baseline tok/s | ratio (median) | per-round ratios | target | result |"
    )
    lines.append("|---|---:|---:|---:|---|---:|---|")
    for r in rows:
        a = f"{r['a']:.0f}" if r["a"] else r["a_state"]
        b = f"{r['b']:.0f}" if r["b"] else r["b_state"]
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else "n/a"
        pr = ", ".join(f"{x:.3f}" for x in r["per_round"]) or "-"
        target = "-" if r["target"] is None else f">= {r['target']:.2f}"
        lines.append(f"| {r['label']} | {a} | {b} | {ratio} | {pr} | {target} | {r['verdict']} |")
    ratio_table = "\n".join(lines)

    lines = []
    lines.append(
        "| mode | world size | tokens/s (median) | all rounds | ms/step | peak RSS per rank (MiB) | loss first -> last | other load (cores, per round) |"
    )
    lines.append("|---|---:|---:|---|---:|---:|---|---|")
    for (mode, world), v in results.items():
        if not v:
            err = errors.get((mode, world), {}).get("error", "no result")
            lines.append(f"| {mode} | {world} | error: {err} | - | - | - | - | - |")
            continue
        allr = ", ".join(f"{r['tokens_per_s']:.0f}{'*' if r.get('noisy') else ''}" for r in v)
        ms = median([r["step_ms"] for r in v])
        load = ", ".join(f"{r['foreign_cores']:.2f}" for r in v)
        lines.append(
            f"| {mode} | {world} | {med[(mode, world)]:.0f} | {allr} | {ms:.0f} | "
            f"{rss[(mode, world)]:.0f} | {v[0]['first_loss']:.4f} -> {v[0]['last_loss']:.4f} | {load} |"
        )
    mode_table = "\n".join(lines)
    return rows, ratio_table, mode_table


def load_line(results, discarded, args) -> str:
    noisy = sum(bool(r.get("noisy")) for v in results.values() for r in v)
    return (
        f"{len(discarded)} run(s) discarded and rerun because other processes used more than "
        f"{args.max_other_load} cores during the timed window; {noisy} noisy run(s) kept "
        "(marked * in 'all rounds': retries or time budget exhausted)."
    )


def spread_note(results) -> str | None:
    spreads = [
        ((max(t) - min(t)) / statistics.median(t), f"{mode} ws{world}")
        for (mode, world), v in results.items()
        if len(t := [r["tokens_per_s"] for r in v]) > 1
    ]
    if not spreads:
        return None
    worst = max(spreads)
    return (
        f"- Run-to-run spread (max - min over rounds, relative to the median) is up to "
        f"{100 * worst[0]:.0f}% ({worst[1]}) in this run: ratios closer to their target "
        "than that are within the noise."
    )


def machine_desc() -> str:
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{mem_kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        mem = "unknown RAM"
    return f"{os.cpu_count()} CPU cores ({model}), {mem}, no GPU, {platform.system()} {platform.release()}"


def versions() -> str:
    out = []
    for name in ("torch", "deepspeed"):
        try:
            from importlib.metadata import version

            out.append(f"{name} {version(name)}")
        except Exception:
            out.append(f"{name} not installed")
    out.append(f"Python {platform.python_version()}")
    return ", ".join(out)


def write_markdown(section: str, title: str, path: Path = BENCH_MD) -> None:
    """Replace the section that starts with the line ``title`` (up to the next ``## ``) with
    ``section``, or append it; the rest of the file is kept."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(rf"^{re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section.rstrip("\n") + "\n\n", text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def add_orchestration_args(p) -> None:
    """The options every benchmark script shares (rounds, steps, threads, load-noise handling)."""
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH)
    p.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")


def add_noise_args(p, *, budget: float = 200.0) -> None:
    """Waiting for an idle machine and rerunning runs that other work disturbed."""
    p.add_argument(
        "--wait-idle",
        type=float,
        default=10.0,
        help="before each run wait up to this many seconds for the machine to be idle (default 10)",
    )
    p.add_argument(
        "--max-other-load",
        type=float,
        default=0.25,
        help="rerun a run when other processes used more than this many cores during its timed "
        "window (default 0.25)",
    )
    p.add_argument("--retries", type=int, default=1, help="reruns per noisy run (default 1)")
    p.add_argument(
        "--budget",
        type=float,
        default=budget,
        help="seconds after which noisy runs are kept (flagged) instead of rerun "
        f"(default {budget:g})",
    )


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

NOTE_HELP = "a line added to the notes of the written section"


def parser(
    doc: str,
    modes: Sequence[str] | None = None,
    *,
    profile_dir: bool = True,
    orchestration: bool = True,
) -> argparse.ArgumentParser:
    """A script's parser: its docstring as the description, the hidden options ``run_one``
    starts a worker with (``--worker`` one of ``modes``; ``--profile-dir`` where it profiles)
    and, with ``orchestration``, the options of ``add_orchestration_args``."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--worker", choices=modes, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    if profile_dir:
        p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    if orchestration:
        add_orchestration_args(p)
    return p


def add_modes_arg(p: argparse.ArgumentParser, modes: Collection[str]) -> None:
    """``--modes``: a subset of the script's modes, all by default."""
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(modes),
        choices=list(modes),
        help="modes to run (default all)",
    )


def add_smoke_arg(p: argparse.ArgumentParser, quick: str = "", *, help: str | None = None) -> None:
    """``--smoke``: a quick check that the script still runs; ``quick`` says what it runs."""
    p.add_argument(
        "--smoke",
        action="store_true",
        help=help
        or f"a quick check that {quick}, no idle wait, no reruns (figures meaningless; refuses "
        "--write)",
    )


def apply_smoke(p: argparse.ArgumentParser, args: argparse.Namespace, **settings) -> None:
    """With ``--smoke``: refuse ``--write`` (its figures are not benchmarks), then set the
    script's quick ``settings`` on ``args``."""
    if not args.smoke:
        return
    if args.write:
        p.error("--smoke figures are not benchmarks: no --write")
    for key, value in settings.items():
        setattr(args, key, value)


def add_write_args(p: argparse.ArgumentParser, note_help: str = NOTE_HELP) -> None:
    """``--write`` (update BENCHMARKS.md) and ``--note`` (repeatable lines for its notes)."""
    p.add_argument("--write", action="store_true", help=f"update {BENCH_MD.name}")
    p.add_argument("--note", action="append", help=note_help)


def without_notes(argv: Sequence[str]) -> list[str]:
    """The command line minus its --note texts (they go into the notes)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--note":
            skip = True
        elif not a.startswith("--note="):
            out.append(a)
    return out


def command_line(script: str, *, keep_notes: bool = False) -> str:
    """This run's command as a section quotes it: ``python benchmarks/SCRIPT ARGS``."""
    argv = sys.argv[1:] if keep_notes else without_notes(sys.argv[1:])
    return shlex.join(["python", f"benchmarks/{script}", *argv])


# --------------------------------------------------------------------------------------------
# Provenance and the end of a run
# --------------------------------------------------------------------------------------------


def git(*a: str) -> str:
    """The output of a read-only git command in this checkout ('' where git fails)."""
    proc = subprocess.run(
        ["git", "--no-optional-locks", *a], cwd=REPO, capture_output=True, text=True, check=False
    )
    return proc.stdout.strip()


def shardspeed_commit() -> str:
    """This checkout's commit and whether src/ has uncommitted changes."""
    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = " plus uncommitted changes under src/" if git("status", "--porcelain", "src") else ""
    return f"shardspeed from src/ at commit {head}{dirty}"


def shardspeed_source() -> str:
    """Where the workers import shardspeed from and, for this checkout, its commit and whether
    that directory has uncommitted changes."""
    import importlib.util

    spec = importlib.util.find_spec("shardspeed")
    origin = Path(spec.origin).resolve().parent.parent if spec and spec.origin else None
    if origin is None:
        return "shardspeed: not found"
    try:
        rel = origin.relative_to(REPO)
    except ValueError:
        return f"shardspeed imported from `{origin}` (outside this checkout)"
    head = git("rev-parse", "--short", "HEAD") or "?"
    dirty = git("status", "--porcelain", "--", str(rel))
    return f"shardspeed from `{rel}/` at commit {head}" + (
        " plus uncommitted changes under it" if dirty else ""
    )


def warn_if_source_changed(source: str) -> None:
    """Figures from a run during which shardspeed changed mix two versions: say so."""
    now = shardspeed_source()
    if now != source:
        print(f"\nWARNING: the shardspeed source changed during the run (now: {now})")


def print_run_end(
    total: float,
    tmp: Path,
    errors: dict,
    *,
    load_line: str | None = None,
    log_chars: int | None = None,
    with_world: bool = True,
    losses_ok: bool = True,
    losses_where: str = "'Losses' above",
    source: str | None = None,
) -> None:
    """The end of an orchestrator's output: the load line, where the worker logs are, every
    failed run with its log (its last ``log_chars`` characters), a failed loss check, and a
    warning when shardspeed changed since ``source`` was read."""
    head = f"\n{load_line}\n" if load_line else "\n"
    print(f"{head}total benchmark time {total:.0f}s; worker logs in {tmp}")
    for key, e in errors.items():
        mode, world = key if isinstance(key, tuple) else (key, None)
        label = f"{mode} ws{world}" if with_world else mode
        log = e.get("log", "")
        print(f"\n--- {label} failed: {e['error']} ---\n{log[-log_chars:] if log_chars else log}")
    if not losses_ok:
        print(f"\nLOSS CHECK FAILED (see {losses_where})")
    if source is not None:
        warn_if_source_changed(source)


def profile_modes(script: Path, modes: Sequence[str], args, prefix: str, world: int = 2) -> int:
    """``--profile``: run each mode once at ``world`` with rank 0 profiled; print its speed and
    where the profiles went."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    pdir = Path(args.profile_out or tmp / "profiles")
    for mode in modes:
        r = run_one(script, mode, world, args, tmp, "prof", profile_dir=str(pdir))
        if "error" in r:
            print(f"{mode}: FAILED {r['error']}\n{r['log']}")
            continue
        print(
            f"{mode} ws{world} (profiled): {r['tokens_per_s']:.0f} tok/s, {r['step_ms']:.0f} "
            f"ms/step, other load {r['foreign_cores']:.2f} cores"
        )
    print(f"profiles written to {pdir}")
    return 0


# --------------------------------------------------------------------------------------------
# The written section
# --------------------------------------------------------------------------------------------

ERROR_MARKERS = ("Error", "error:", "terminate")


def error_line(
    label: str, e: dict, *, markers: Sequence[str] = ERROR_MARKERS, width: int = 400
) -> str:
    """'LABEL failed: ERROR', with the first line of the worker log holding one of ``markers``
    (no markers: none), so the notes say why without the whole log."""
    why = [
        x
        for x in e.get("log", "").splitlines()
        if any(m in x for m in markers) and "Traceback" not in x
    ][:1]
    return (
        f"{label} failed: {e['error']}"
        + (f": `{why[0].strip()[:width]}`" if why else "")
        + " (see the worker log)"
    )


def error_notes(errors: dict, *, with_world: bool = False, **line_kw) -> list[str]:
    """A note per failed run (keyed by mode or by (mode, world)); ``line_kw`` go to error_line."""
    out = []
    for key, e in errors.items():
        mode, world = key if isinstance(key, tuple) else (key, None)
        label = f"{mode} at world size {world}" if with_world else mode
        out.append(f"- {error_line(label, e, **line_kw)}.")
    return out


def targets_missed(rows: Sequence[dict], *, ratios: bool = True, end: str = ".") -> list[str]:
    """The note naming the comparisons of ``summarize`` that missed their target (none: [])."""
    missed = [r for r in rows if r["verdict"] == "MISSED"]
    if not missed:
        return []
    names = (f"{r['label']} ({r['ratio']:.3f})" if ratios else r["label"] for r in missed)
    return ["- Targets missed: " + "; ".join(names) + end]


def note_lines(args) -> list[str]:
    """The ``--note`` lines, as notes."""
    return [f"- {line}" for line in getattr(args, "note", None) or []]


def closing_notes(
    load_line: str,
    results,
    rows: Sequence[dict],
    args,
    errors: dict,
    *,
    ratios: bool = True,
    **error_kw,
) -> list[str]:
    """The notes a measured section ends with: this run's load, the run-to-run spread, the
    missed targets (``ratios``: with their ratios), the ``--note`` lines and the failures."""
    spread = spread_note(results)
    return [
        f"- This run: {load_line}",
        *([spread] if spread else []),
        *targets_missed(rows, ratios=ratios),
        *note_lines(args),
        *error_notes(errors, **error_kw),
    ]


def each_run_note(args, global_batch: int) -> str:
    """The method note of the sections measured with ``measure`` at a fixed global batch."""
    return (
        f"- Each run: {args.warmup} warm-up steps, then {args.steps} timed steps (barrier before "
        f"and after); tokens/s = {global_batch} x {SEQ} x steps / time on rank 0. {args.rounds} "
        "rounds, modes interleaved (order rotated per round); ratios are of medians; per-round "
        f"ratios pair runs of the same round. Threads: {args.threads} per process; a fresh "
        "`torch.distributed.run --standalone` process group per run (gloo on CPU)."
    )


def section_text(
    title: str,
    cmd: str,
    total: float,
    blocks: Sequence[str | tuple[str, str]],
    notes: Sequence[str],
    *,
    source: str | None = None,
    versions_text: str | None = None,
    date: str | None = None,
    command_tail: str = "",
) -> str:
    """A BENCHMARKS.md section: the title; date, machine and versions (and ``source``); the
    command; the ``blocks`` (a table, or a (caption, table) pair); the notes."""
    header = (
        f"Date: {date or datetime.date.today().isoformat()}. Machine: {machine_desc()}. "
        f"Versions: {versions_text or versions()}."
    )
    lines = [
        title,
        "",
        header + (f" {source}." if source else ""),
        "",
        f"Command (from the repository root): `.venv/bin/{cmd}` (total run time {total:.0f}s)"
        f"{command_tail}.",
        "",
    ]
    for block in blocks:
        lines += [block[0], "", block[1], ""] if isinstance(block, tuple) else [block, ""]
    return "\n".join([*lines, "Notes:", "", *notes, ""])
