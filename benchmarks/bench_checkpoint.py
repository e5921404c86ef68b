"""Checkpoint save and load: shardspeed vs DeepSpeed, ZeRO stages 2 and 3, world size 2.

One invocation measures, on the GPT-style model of the other benchmarks scaled up to about 100M
parameters (fp32, AdamW, one training step before the first save so the optimizer state exists):

  per framework (shardspeed, DeepSpeed 0.19.8) and ZeRO stage (2, 3), at world size 2:
    - save wall time: ``engine.save_checkpoint(dir, tag)`` on rank 0, a barrier before and after,
      median over ``--repeats`` saves with distinct tags;
    - save + fsync: that, plus rank 0 fsyncing every file of the tag afterwards (shardspeed has
      fsynced them already; DeepSpeed's torch.save leaves them in the page cache);
    - load wall time: ``engine.load_checkpoint(dir, tag)`` into a fresh engine (same world size
      and stage, parameters set to other values first), barriers around it; the tag's pages are
      dropped from the page cache first (``posix_fadvise(DONTNEED)``; ``--warm-cache`` keeps them);
    - bytes on disk: the sum of the file sizes in the tag directory;
    - a check: after the load, the whole parameters (gathered on rank 0) and every rank's
      optimizer parameters and states equal, bit for bit, what was saved;
  and, as information, shardspeed's resharded load: the stage 3 world size 2 checkpoint loaded at
  world size 1, stage 0 (parameters checked bit for bit).

Each checkpoint is deleted after its measurement. The script is both the orchestrator and the
worker: every run is ``python -m torch.distributed.run ... bench_checkpoint.py --worker MODE``
(gloo on CPU, ``DS_ACCELERATOR=cpu``), started by ``common.run_one``.

    .venv/bin/python benchmarks/bench_checkpoint.py            # measure, print the tables
    .venv/bin/python benchmarks/bench_checkpoint.py --write    # ... and update BENCHMARKS.md
    .venv/bin/python benchmarks/bench_checkpoint.py --small    # ~5M parameters, 1 repeat: smoke
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import common
from common import BENCH_MD, SEQ, VOCAB, build_model, make_batches, shardspeed_commit

HERE = Path(__file__).resolve()
SECTION_TITLE = "## Checkpoint save and load"
WORLD = 2
MIB = 2**20
# The worker's settings beyond the ones common.run_one passes on its command line.
ENV_KEY = "SHARDSPEED_BENCH_CKPT"

# The model of the other benchmarks (common.build_model), scaled through its shape constants:
# 12 * d^2 + 13 d per block, plus 2 * VOCAB * d + SEQ * d + 2 d: 98.5M parameters.
FULL_SHAPE = {"D_MODEL": 768, "N_LAYERS": 13, "N_HEADS": 12}
SMALL_SHAPE = {"D_MODEL": common.D_MODEL, "N_LAYERS": common.N_LAYERS, "N_HEADS": common.N_HEADS}
REPEATS = 3
MICRO_BATCH = 2  # only to populate the optimizer state: one step before the saves

# (mode, world size) in the order they run; ours_reshard loads what ours_s3 left behind.
PLAN = [
    ("ours_s2", WORLD),
    ("deepspeed_s2", WORLD),
    ("ours_s3", WORLD),
    ("deepspeed_s3", WORLD),
    ("ours_reshard", 1),
]
MODES = tuple(m for m, _ in PLAN)
PAIRS = [(2, "ours_s2", "deepspeed_s2"), (3, "ours_s3", "deepspeed_s3")]


def mode_stage(mode: str) -> int:
    """The ZeRO stage a mode runs (the resharded load: stage 0 at world size 1)."""
    return 0 if mode == "ours_reshard" else int(mode[-1])


def apply_shape(shape: dict) -> int:
    """Set common's model constants (build_model reads them at call time); the parameter count."""
    for key, value in shape.items():
        setattr(common, key, value)
    d, n = shape["D_MODEL"], shape["N_LAYERS"]
    return n * (12 * d * d + 13 * d) + 2 * VOCAB * d + SEQ * d + 2 * d


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


class Windows:
    """The timed windows of one worker: a barrier, the work, a barrier; the wall time on this
    rank, plus the machine's busy CPU and this process's CPU over all windows (for the
    'other load' of common.run_one)."""

    def __init__(self, barrier):
        self.barrier = barrier
        self.elapsed = 0.0
        self.busy = 0.0
        self.own = 0.0

    @contextlib.contextmanager
    def timed(self, into: list):
        self.barrier()
        busy0, cpu0 = common.machine_busy_s(), time.process_time()
        t0 = time.perf_counter()
        yield
        self.barrier()
        dt = time.perf_counter() - t0
        self.busy += common.machine_busy_s() - busy0
        self.own += time.process_time() - cpu0
        self.elapsed += dt
        into.append(dt)


def tag_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def fsync_files(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cached(files) -> None:
    """Drop the files' (clean) pages from the page cache, so the next read comes from disk."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def content_summary(path: Path) -> dict[str, int]:
    """Tensor bytes in one checkpoint file, by key: for a safetensors file (shardspeed) the key up
    to its last dot (`master`, `optim.exp_avg`, ...), for a torch.save file (DeepSpeed) the
    top-level key (`module`), two keys deep where that holds a dict of containers
    (`optimizer_state_dict.base_optimizer_state`). Each tensor counts once, as numel x itemsize."""
    import torch

    out: dict[str, int] = {}
    if path.suffix == ".safetensors":
        from shardspeed.checkpoint.format import read_header

        header, _ = read_header(path)
        for key, entry in header.items():
            if key != "__metadata__":
                begin, end = entry["data_offsets"]
                group = key.rsplit(".", 1)[0] if "." in key else key
                out[group] = out.get(group, 0) + end - begin
        return out
    if path.suffix != ".pt":
        return out
    try:
        # Never run a file's code, DeepSpeed's included: tensors and plain containers only.
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        # Objects weights_only refuses: count the archive's tensor storages as one total.
        with zipfile.ZipFile(path) as archive:
            stored = [i for i in archive.infolist() if "/data/" in i.filename]
            return {"(storages; the rest needs unpickling)": sum(i.file_size for i in stored)}
    seen: set[tuple] = set()

    def walk(value, key: str) -> None:
        if isinstance(value, torch.Tensor):
            ident = (value.data_ptr(), value.numel(), value.dtype)
            if value.numel() and ident not in seen:
                seen.add(ident)
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
        elif isinstance(value, dict):
            for v in value.values():
                walk(v, key)
        elif isinstance(value, list | tuple):
            for v in value:
                walk(v, key)

    for k, v in obj.items() if isinstance(obj, dict) else [("", obj)]:
        nested = isinstance(v, dict) and not any(isinstance(x, torch.Tensor) for x in v.values())
        for k2, v2 in v.items() if nested else [(None, v)]:
            walk(v2, str(k) if k2 is None else f"{k}.{k2}")
    return {k: v for k, v in out.items() if v}


def full_params(engine, ours: bool, rank: int) -> dict | None:
    """The whole parameters (gathered where sharded; a collective), cloned on rank 0."""
    if ours:
        from shardspeed.zero import GatheredParameters
    else:
        import deepspeed

        GatheredParameters = deepspeed.zero.GatheredParameters
    with GatheredParameters(list(engine.module.parameters())):
        if rank != 0:
            return None
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


# Where each ZeRO optimizer keeps this rank's fp32 master tensors, the keys of its inner torch
# optimizer's state: shardspeed, DeepSpeed stage 3 (its inner param_groups are empty between
# steps), DeepSpeed stages 1-2.
MASTER_ATTRS = ("masters", "fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")


def optimizer_snapshot(engine) -> list[tuple[str, object]]:
    """This rank's fp32 master tensors and each one's optimizer state, in order (copies)."""
    zopt = engine.optimizer
    attr = next(a for a in MASTER_ATTRS if getattr(zopt, a, None) is not None)
    state = zopt.optimizer.state
    out: list[tuple[str, object]] = []
    for i, master in enumerate(getattr(zopt, attr)):
        out.append((f"{attr}[{i}]", master.detach().clone()))
        for k, v in sorted(state.get(master, {}).items()):
            out.append((f"{attr}[{i}].{k}", v.detach().clone() if hasattr(v, "detach") else v))
    return out


def bit_equal(a, b) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        try:
            return float(a) == float(b)
        except (TypeError, ValueError):
            return a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.reshape(-1).contiguous(), b.reshape(-1).contiguous()
    return a.numel() == 0 or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def max_abs_diff(a, b) -> float:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        try:
            return abs(float(a) - float(b))
        except (TypeError, ValueError):
            return float("nan")
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def compare(saved: list[tuple[str, object]], loaded: list[tuple[str, object]]) -> dict:
    """Bit equality of two (name, value) lists: counts, the first differing names, max |diff|."""
    diff, worst = [], 0.0
    names_a, names_b = [n for n, _ in saved], [n for n, _ in loaded]
    if names_a != names_b:
        missing = sorted(set(names_a) ^ set(names_b))
        return {"n": len(saved), "equal": False, "differ": missing[:5], "max_abs": float("inf")}
    for (name, a), (_, b) in zip(saved, loaded):
        if not bit_equal(a, b):
            diff.append(name)
            worst = max(worst, max_abs_diff(a, b))
    return {"n": len(saved), "equal": not diff, "differ": diff[:5], "max_abs": worst}


def make_engine(lib, cfg: dict, *, fresh: bool):
    """An engine over a new model; `fresh`: its parameters moved away from the saved values."""
    import torch

    model = build_model()
    if fresh:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    engine, _opt, _, _ = lib.initialize(
        model=model, model_parameters=model.parameters(), config=cfg
    )
    return engine


def worker(args) -> None:
    spec = json.loads(os.environ[ENV_KEY])
    mode = args.worker
    ours = mode.startswith("ours")
    if not ours:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import torch.distributed as dist

    rank, world = common.worker_setup(args.threads)
    n_params = apply_shape(spec["shape"])
    if ours:
        import shardspeed as lib
    else:
        import deepspeed as lib
    cfg = common.ds_config(args.micro_batch, stage=mode_stage(mode))
    windows = Windows(dist.barrier)
    result: dict = {"mode": mode, "world_size": world, "rank": rank, "stage": mode_stage(mode)}
    result["params"] = n_params
    result.update(saves=[], flushes=[], loads=[], bytes=[], files=[], checks=[], content={})

    if mode == "ours_reshard":
        reshard_loads(args, spec, lib, cfg, windows, result, rank)
    else:
        save_and_load(args, spec, lib, cfg, windows, result, rank, world, ours)

    result.update(
        threads=torch.get_num_threads(),
        elapsed_s=windows.elapsed,
        machine_busy_s=windows.busy,
        own_cpu_s=windows.own,
        peak_rss_mib=common.peak_rss_mib(),
        torch=torch.__version__,
    )
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def save_and_load(args, spec, lib, cfg, windows, result, rank, world, ours) -> None:
    import torch.distributed as dist

    mode = args.worker
    root = Path(spec["ckpt_dir"]) / mode
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # left by an earlier attempt
    engine = make_engine(lib, cfg, fresh=False)
    for x, y in make_batches(rank, args.steps, args.micro_batch):
        engine.backward(engine(x, y))
        engine.step()
    ref_params = full_params(engine, ours, rank)
    ref_opt = optimizer_snapshot(engine)
    keep_last = spec["keep_for_reshard"] and mode == "ours_s3"

    for i in range(spec["repeats"]):
        tag = f"bench_r{i}"
        with windows.timed(result["saves"]):
            engine.save_checkpoint(str(root), tag=tag)
        if rank == 0:
            files = tag_files(root / tag)
            result["bytes"].append(sum(f.stat().st_size for f in files))
            t0 = time.perf_counter()
            fsync_files(files)
            result["flushes"].append(time.perf_counter() - t0)
            if i == 0:
                result["files"] = [
                    [str(f.relative_to(root / tag)), f.stat().st_size] for f in files
                ]
                result["content"] = {
                    str(f.relative_to(root / tag)): content_summary(f) for f in files
                }
                result["outside_tag"] = [
                    [str(f.relative_to(root)), f.stat().st_size]
                    for f in tag_files(root)
                    if tag not in f.relative_to(root).parts
                ]
            if not spec["warm_cache"]:
                drop_cached(files)
        dist.barrier()

        fresh = make_engine(lib, cfg, fresh=True)
        with windows.timed(result["loads"]):
            path, _client = fresh.load_checkpoint(str(root), tag=tag)
        if path is None:
            raise RuntimeError(f"load_checkpoint found no checkpoint {tag!r} in {root}")
        check = {"optimizer": compare(ref_opt, optimizer_snapshot(fresh))}
        loaded = full_params(fresh, ours, rank)
        if rank == 0:
            check["params"] = compare(sorted(ref_params.items()), sorted(loaded.items()))
        result["checks"].append(check)
        del fresh, loaded
        gc.collect()
        dist.barrier()
        if rank == 0 and not (keep_last and i == spec["repeats"] - 1):
            shutil.rmtree(root / tag)
        dist.barrier()

    if keep_last and rank == 0:
        import torch

        torch.save(ref_params, root / "reference_params.pt")
        result["kept_tag"] = f"bench_r{spec['repeats'] - 1}"
    elif rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()


def reshard_loads(args, spec, lib, cfg, windows, result, rank) -> None:
    """World size 1, stage 0: load the tag ours_s3 kept, `repeats` times into fresh engines."""
    import torch

    root = Path(spec["ckpt_dir"]) / "ours_s3"
    tag = spec["reshard_tag"]
    ref_params = torch.load(root / "reference_params.pt", weights_only=True)
    files = tag_files(root / tag)
    result["bytes"] = [sum(f.stat().st_size for f in files)] * spec["repeats"]
    result["files"] = [[str(f.relative_to(root / tag)), f.stat().st_size] for f in files]
    # The checkpoint stays for a rerun of this mode; the orchestrator deletes it afterwards.
    for _ in range(spec["repeats"]):
        if not spec["warm_cache"]:
            drop_cached(files)
        fresh = make_engine(lib, cfg, fresh=True)
        with windows.timed(result["loads"]):
            path, _client = fresh.load_checkpoint(str(root), tag=tag)
        if path is None:
            raise RuntimeError(f"load_checkpoint found no checkpoint {tag!r} in {root}")
        loaded = full_params(fresh, True, rank)
        result["checks"].append(
            {"params": compare(sorted(ref_params.items()), sorted(loaded.items()))}
        )
        del fresh, loaded
        gc.collect()


# --------------------------------------------------------------------------------------------
# Orchestrator side
# --------------------------------------------------------------------------------------------


def filesystem_of(path: Path) -> str:
    """'<type> on <device>' of the mount holding `path`, from /proc/mounts."""
    best = ("", "unknown filesystem", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    except OSError:
        pass
    return f"{best[1]} on {best[2]}"


def run_plan(args, spec: dict, tmp: Path):
    """Every mode of PLAN once, rerun (up to --retries, within --budget) when other work used more
    than --max-other-load cores during its timed windows."""
    results, errors, discarded = {}, {}, []
    t_start = time.perf_counter()
    for mode, world in PLAN:
        if mode == "ours_reshard":
            kept = results.get("ours_s3", {}).get("kept_tag")
            if not kept:
                errors[mode] = {"error": "skipped: ours_s3 left no checkpoint", "log": ""}
                continue
            spec = {**spec, "reshard_tag": kept}
        os.environ[ENV_KEY] = json.dumps(spec)
        for attempt in range(args.retries + 1):
            r = common.run_one(HERE, mode, world, args, tmp, f"a{attempt}")
            if "error" in r or r["foreign_cores"] <= args.max_other_load:
                break
            if attempt == args.retries or time.perf_counter() - t_start > args.budget:
                r["noisy"] = True
                break
            discarded.append(r)
            print(
                f"{mode:13s} discarded (other load {r['foreign_cores']:.2f} cores > "
                f"{args.max_other_load}), retrying",
                flush=True,
            )
        if mode == "ours_reshard":
            shutil.rmtree(Path(spec["ckpt_dir"]) / "ours_s3", ignore_errors=True)
        if "error" in r:
            errors[mode] = r
            print(f"{mode:13s} FAILED ({r['error']})", flush=True)
            continue
        results[mode] = r
        print(f"{mode:13s} {progress_line(r)}", flush=True)
    return results, errors, discarded, time.perf_counter() - t_start


def fmt_times(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs) or "-"


def saved_plus_flush(r: dict) -> list[float]:
    return [s + f for s, f in zip(r["saves"], r["flushes"])]


def check_text(r: dict) -> tuple[str, str]:
    """(parameters, optimizer state) verdicts over all repeats: 'bit-equal' or what differed."""

    def verdict(kind: str) -> str:
        checks = [c[kind] for c in r["checks"] if kind in c]
        for rank in r["ranks"][1:]:
            checks += [c[kind] for c in rank["checks"] if kind in c]
        if not checks:
            return "-"
        bad = [c for c in checks if not c["equal"]]
        if not bad:
            return f"bit-equal ({checks[0]['n']} tensors x {len(checks)})"
        worst = max(c["max_abs"] for c in bad)
        return f"DIFFER in {len(bad)}/{len(checks)} ({', '.join(bad[0]['differ'])}; max abs {worst:.3g})"

    return verdict("params"), verdict("optimizer")


def progress_line(r: dict) -> str:
    median = common.median
    p, o = check_text(r)
    save = f"save {median(r['saves']):.2f}s, " if r["saves"] else ""
    size = f"{r['bytes'][0] / MIB:.1f} MiB" if r["bytes"] else "-"
    return (
        f"{save}load {median(r['loads']):.2f}s, {size}, params {p}, optimizer {o}, "
        f"rss {r['peak_rss_mib']:.0f} MiB, run {r['wall_s']:.0f}s, other load "
        f"{r['foreign_cores']:.2f} cores{', NOISY' if r.get('noisy') else ''}"
    )


def tables(results: dict, errors: dict) -> tuple[str, str, str]:
    """The ratio table, the per-mode table and the table of what each mode writes, as markdown."""
    median = common.median
    lines = [
        "| stage | measure | shardspeed | DeepSpeed | ratio shardspeed / DeepSpeed (lower is better) |",
        "|---:|---|---:|---:|---:|",
    ]
    for stage, a, b in PAIRS:
        ra, rb = results.get(a), results.get(b)
        measures = [
            ("save (s, median)", lambda r: median(r["saves"]), "{:.2f}"),
            (
                "save + fsync of its files (s, median)",
                lambda r: median(saved_plus_flush(r)),
                "{:.2f}",
            ),
            ("load into a fresh engine (s, median)", lambda r: median(r["loads"]), "{:.2f}"),
            ("bytes on disk (MiB)", lambda r: r["bytes"][0] / MIB, "{:.1f}"),
        ]
        for label, get, form in measures:
            va = get(ra) if ra else None
            vb = get(rb) if rb else None
            sa = form.format(va) if va is not None else ("error" if a in errors else "not run")
            sb = form.format(vb) if vb is not None else ("error" if b in errors else "not run")
            ratio = f"{va / vb:.3f}" if va is not None and vb else "n/a"
            lines.append(f"| {stage} | {label} | {sa} | {sb} | {ratio} |")
    ratio_table = "\n".join(lines)

    lines = [
        "| mode | world size | stage | save s (all repeats) | fsync after save s | load s (all repeats) "
        "| bytes on disk | files | parameters after load | optimizer state after load (every rank) "
        "| peak RSS (MiB, max over ranks) | other load (cores) |",
        "|---|---:|---:|---|---|---|---:|---:|---|---|---:|---:|",
    ]
    for mode, world in PLAN:
        r = results.get(mode)
        if r is None:
            err = errors.get(mode, {}).get("error", "not run")
            lines.append(f"| {mode} | {world} | {mode_stage(mode)} | {err} |" + " - |" * 8)
            continue
        p, o = check_text(r)
        if mode == "ours_reshard":
            p += " (vs the parameters ours_s3 saved)"
            o = "not checked (other layout)"
        size = f"{r['bytes'][0]:,}" if r["bytes"] else "-"
        lines.append(
            f"| {mode} | {world} | {r['stage']} | {fmt_times(r['saves'])} | "
            f"{fmt_times(r['flushes'])} | {fmt_times(r['loads'])} | {size} | {len(r['files'])} | "
            f"{p} | {o} | {r['peak_rss_mib']:.0f} | {r['foreign_cores']:.2f}"
            f"{'*' if r.get('noisy') else ''} |"
        )
    mode_table = "\n".join(lines)

    lines = [
        "| mode | file (in the tag directory) | bytes | tensor bytes in it, by key |",
        "|---|---|---:|---|",
    ]
    for mode, _world in PLAN:
        r = results.get(mode)
        if r is None or mode == "ours_reshard":
            continue
        for name, size in r["files"]:
            content = r["content"].get(name, {})
            parts = sorted(content.items(), key=lambda kv: -kv[1])
            desc = ", ".join(f"`{k}` {v / MIB:.1f} MiB" for k, v in parts) or "no tensors"
            lines.append(f"| {mode} | `{name}` | {size:,} | {desc} |")
    files_table = "\n".join(lines)
    return ratio_table, mode_table, files_table


def orchestrate(args) -> int:
    shape = SMALL_SHAPE if args.small else FULL_SHAPE
    repeats = args.repeats or (1 if args.small else REPEATS)
    n_params = apply_shape(shape)
    cmd = common.command_line("bench_checkpoint.py")
    base = Path(args.dir or tempfile.gettempdir()).resolve()
    tmp = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=base))
    ckpt_dir = tmp / "checkpoints"
    fs = filesystem_of(ckpt_dir)
    spec = {
        "shape": shape,
        "repeats": repeats,
        "ckpt_dir": str(ckpt_dir),
        "warm_cache": args.warm_cache,
        "keep_for_reshard": True,
    }
    print(
        f"model: {n_params / 1e6:.2f}M params (d_model {shape['D_MODEL']}, {shape['N_LAYERS']} "
        f"layers, {shape['N_HEADS']} heads, vocab {VOCAB}, seq {SEQ}), fp32 AdamW, "
        f"{args.steps} training step(s) before saving, {repeats} repeat(s), world size {WORLD}, "
        f"{args.threads} thread(s) per process; checkpoints under {ckpt_dir} ({fs}); "
        f"{'warm' if args.warm_cache else 'cold'} page cache for loads",
        flush=True,
    )
    print(shardspeed_commit(), flush=True)
    try:
        results, errors, discarded, total = run_plan(args, spec, tmp)
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    ratio_table, mode_table, files_table = tables(results, errors)
    print()
    print(ratio_table)
    print()
    print(mode_table)
    print()
    print(files_table)
    outside = {m: r.get("outside_tag", []) for m, r in results.items() if r.get("outside_tag")}
    for mode, extra in outside.items():
        print(
            f"{mode}: also in the save directory: " + ", ".join(f"{n} ({s:,} B)" for n, s in extra)
        )
    common.print_run_end(total, tmp, errors)
    if args.write:
        where = f"`{base}` ({fs})"
        write_section(args, cmd, n_params, shape, repeats, where, total, results, errors, discarded)
        print(f"\nupdated {BENCH_MD}")
    return 1 if errors else 0


def write_section(args, cmd, n_params, shape, repeats, where, total, results, errors, discarded):
    ratio_table, mode_table, files_table = tables(results, errors)
    outside = sorted(
        {n for r in results.values() for n, _s in r.get("outside_tag", []) if "bench_r" not in n}
    )
    noisy = sum(bool(r.get("noisy")) for r in results.values())
    notes = [
        "- Model: the GPT-style LM of the sections above"
        + (
            " (`--small`: unchanged) "
            if shape == SMALL_SHAPE
            else ", scaled up through its shape constants "
        )
        + f"(`common.D_MODEL` {shape['D_MODEL']}, `N_LAYERS` {shape['N_LAYERS']}, `N_HEADS` "
        f"{shape['N_HEADS']}; vocab {VOCAB}, seq {SEQ}): {n_params:,} parameters, fp32. Both "
        "frameworks get the same config dict, only the stage differing: "
        f"`{json.dumps(common.ds_config(args.micro_batch, 2))}`; {args.steps} training step(s) "
        f"(micro batch {args.micro_batch} per rank) before the first save, so AdamW's state "
        f"exists. {shardspeed_commit()}.",
        f"- Per mode one `torch.distributed.run --standalone` run (gloo on CPU, {args.threads} "
        f"thread(s) per process, `DS_ACCELERATOR=cpu` for DeepSpeed) with {repeats} repeat(s): "
        "`save_checkpoint(dir, tag)` with a new tag each time (timed on rank 0 between barriers); "
        "rank 0 sums the file sizes in the tag directory and fsyncs its files (timed apart: "
        "'fsync after save'); "
        + (
            "the pages are left in the page cache; "
            if args.warm_cache
            else "their pages are dropped from the page cache (`posix_fadvise(DONTNEED)`), so "
            "loads read from disk; "
        )
        + "a fresh engine (new model, every parameter + 0.5, same world size and stage) "
        "runs `load_checkpoint(dir, tag)` (timed the same way, start-up and `initialize` not "
        "timed); then the check, and the tag directory is deleted. Times are medians over the "
        "repeats; ratios are shardspeed / DeepSpeed, lower is better for all of them.",
        f"- Checkpoints are written under {where}, the local disk, each deleted after its "
        "measurement.",
        "- The check: after each load, the whole parameters (gathered on rank 0 with each "
        "framework's `GatheredParameters`) and, on every rank, the fp32 master tensors "
        "(shardspeed `optimizer.masters`, DeepSpeed `single_partition_of_fp32_groups` at stage 2, "
        "`fp32_partitioned_groups_flat` at stage 3) with every state the inner optimizer keeps for "
        "each (`exp_avg`, `exp_avg_sq`, `step`) are compared byte for byte with copies taken "
        "before the first save. shardspeed "
        "must be bit-equal; each entry counts the tensors compared x the checks (repeats, and "
        "ranks for the optimizer state).",
        "- What each writes (see the file table): shardspeed one safetensors file per rank "
        "(`master.*`: the rank's fp32 master shard, `optim.exp_avg.*` / `optim.exp_avg_sq.*`: its "
        "AdamW moments, `rng.*`: the rank's RNG states) plus `manifest.json` (every logical "
        "tensor's pieces, hyperparameters, Adam's step, counters, a CRC-32 per 4 MiB block of "
        "each file): 12 bytes per parameter, no 16-bit or module copy (the model's weights are "
        "the masters, cast for a 16-bit model). Each file is fsynced and read back once to "
        "compute its CRCs, the directory renamed into place and fsynced. DeepSpeed pickles with `torch.save` (zip "
        "serialization): `mp_rank_00_model_states.pt` (the module's state dict: at stage 2 the "
        "whole fp32 parameters, 4 bytes per parameter, from rank 0; at stage 3 one "
        "`zero_pp_rank_*_mp_rank_00_model_states.pt` per rank with empty parameter placeholders), "
        "and per rank `zero_pp_rank_*_mp_rank_00_optim_states.pt` (the fp32 partition and its "
        "AdamW state, 12 bytes per parameter over the ranks); nothing is fsynced, so 'save' "
        "compares shardspeed's durable save with DeepSpeed's writes into the page cache, and "
        "'save + fsync' both made durable."
        + (
            f" Outside the tag directory (not counted) the saves also leave: {', '.join(outside)}."
            if outside
            else ""
        ),
        "- Resharded load (information, shardspeed only): the checkpoint of the last ours_s3 "
        "repeat is kept and loaded by a world size 1, stage 0 engine (a new run), repeats times "
        "into fresh engines; its parameters are compared bit for bit with the whole parameters "
        "ours_s3 saved (the optimizer state is laid out differently there and not compared).",
        f"- 'other load' is the CPU used during the timed windows by anything other than the "
        f"run's ranks (from /proc/stat), in cores; kernel threads writing the files back count "
        f"there too. {len(discarded)} run(s) rerun for more than {args.max_other_load} cores, "
        f"{noisy} noisy run(s) kept (marked *).",
        *common.note_lines(args),
        *common.error_notes(errors, markers=()),
    ]
    blocks = [
        ratio_table,
        ("Per mode:", mode_table),
        (
            "What each writes (first repeat, rank 0's view of the tag directory; MiB = 2**20 bytes):",
            files_table,
        ),
    ]
    section = common.section_text(SECTION_TITLE, cmd, total, blocks, notes)
    common.write_markdown(section, SECTION_TITLE, BENCH_MD)


def main(argv=None) -> int:
    p = common.parser(__doc__, MODES, profile_dir=False, orchestration=False)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)  # from run_one
    p.add_argument(
        "--steps", type=int, default=1, help="training steps before the first save (default 1)"
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        default=MICRO_BATCH,
        help=f"micro batch per rank of those steps (default {MICRO_BATCH})",
    )
    p.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"saves and loads per mode (default {REPEATS}; 1 with --small)",
    )
    p.add_argument(
        "--small",
        action="store_true",
        help="smoke run: the other benchmarks' ~5M-parameter model and 1 repeat",
    )
    p.add_argument(
        "--dir", help="where the temporary checkpoints go (default: the system temp directory)"
    )
    p.add_argument(
        "--warm-cache",
        action="store_true",
        help="load from the page cache instead of dropping the tag's pages before each load",
    )
    common.add_noise_args(p, budget=900.0)
    common.add_write_args(p)
    p.set_defaults(retries=None)  # 1, or 0 with --small (a smoke run is not worth rerunning)
    args = p.parse_args(argv)
    if args.retries is None:
        args.retries = 0 if args.small else 1
    if args.worker:
        worker(args)
        return 0
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
