"""Checkpoint save, fsync and load: shardspeed vs DeepSpeed, ZeRO stages 2 and 3, on the 98.5M GPT.

.venv/bin/python benchmarks/bench_checkpoint.py [--quick] [--write]
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import time
import zipfile
from pathlib import Path

import harness as h
import render

SCENARIO = h.Scenario(
    name="checkpoint",
    section="## Checkpoint save and load",
    # In this order: ours_reshard loads what ours_s3 left behind.
    modes={"ours_s2": 2, "deepspeed_s2": 2, "ours_s3": 2, "deepspeed_s3": 2, "ours_reshard": 1},
    warmup=0,
    steps=1,  # training steps before the first save
    rounds=1,
    micro_batch=2,
    options={
        "--repeats": dict(type=int, default=3, help="saves and loads per mode (default 3)"),
        "--small": dict(action="store_true", help="the ~5M-parameter model (what --quick runs)"),
    },
    quick={"steps": 1, "rounds": 1, "repeats": 1, "small": True},
)
CHECKPOINT_DIR = Path("/tmp/bench_checkpoint")
PAIRS = [(2, "ours_s2", "deepspeed_s2"), (3, "ours_s3", "deepspeed_s3")]
# Where each ZeRO optimizer keeps this rank's fp32 master tensors: shardspeed, DeepSpeed stage 3,
# DeepSpeed stages 1-2.
MASTER_ATTRS = ("masters", "fp32_partitioned_groups_flat", "single_partition_of_fp32_groups")


def tag_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def each_fd(files, fn) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            fn(fd)
        finally:
            os.close(fd)


def drop_cached(files) -> None:
    """Drop the files' (clean) pages from the page cache, so the next read comes from disk."""
    each_fd(files, lambda fd: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED))


def content_summary(path: Path) -> dict[str, int]:
    """Tensor bytes in one checkpoint file by key (safetensors prefix or torch.save key)."""
    import torch

    out: dict[str, int] = {}
    if path.suffix == ".safetensors":
        from shardspeed.checkpoint.format import read_header

        for key, entry in read_header(path)[0].items():
            if key != "__metadata__":
                group = key.rsplit(".", 1)[0]
                out[group] = out.get(group, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
        return out
    if path.suffix != ".pt":
        return out
    try:  # never run a file's code, DeepSpeed's included: tensors and plain containers only
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        with zipfile.ZipFile(path) as archive:
            stored = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
            return {"(storages; the rest needs unpickling)": stored}
    seen: set[tuple] = set()
    for k, v in obj.items() if isinstance(obj, dict) else [("", obj)]:
        nested = isinstance(v, dict) and not any(isinstance(x, torch.Tensor) for x in v.values())
        for k2, v2 in v.items() if nested else [(None, v)]:
            key = str(k) if k2 is None else f"{k}.{k2}"
            for t in h.reachable_tensors(v2, ()):
                ident = (t.data_ptr(), t.numel(), t.dtype)
                if t.numel() and ident not in seen:
                    seen.add(ident)
                    out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def full_params(lib, engine, rank: int) -> dict | None:
    """The whole parameters (gathered where sharded; a collective), cloned on rank 0."""
    with lib.zero.GatheredParameters(list(engine.module.parameters())):
        if rank == 0:
            return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return None


def optimizer_snapshot(engine) -> list[tuple[str, object]]:
    """This rank's fp32 master tensors and each one's optimizer state, in order (copies)."""
    zopt = engine.optimizer
    attr = next(a for a in MASTER_ATTRS if getattr(zopt, a, None) is not None)
    out: list[tuple[str, object]] = []
    for i, master in enumerate(getattr(zopt, attr)):
        out.append((f"{attr}[{i}]", master.detach().clone()))
        for k, v in sorted(zopt.optimizer.state.get(master, {}).items()):
            out.append((f"{attr}[{i}].{k}", v.detach().clone() if hasattr(v, "detach") else v))
    return out


def compare(saved: list[tuple[str, object]], loaded: list[tuple[str, object]]) -> dict:
    """Bit equality of two (name, value) lists: count, the first differing names, max |diff|."""
    import torch

    if [n for n, _ in saved] != [n for n, _ in loaded]:
        differ = sorted({n for n, _ in saved} ^ {n for n, _ in loaded})
        return {"n": len(saved), "equal": False, "differ": differ[:5], "max_abs": float("inf")}
    differ, worst = [], 0.0
    for (name, a), (_, b) in zip(saved, loaded):
        if not isinstance(a, torch.Tensor):
            a, b = torch.tensor(float(a)), torch.tensor(float(b))
        if a.dtype != b.dtype or a.shape != b.shape:
            differ.append(name)
            worst = float("inf")
        elif a.numel() and not torch.equal(*(x.flatten().view(torch.uint8) for x in (a, b))):
            differ.append(name)
            worst = max(worst, (a.double() - b.double()).abs().max().item())
    return {"n": len(saved), "equal": not differ, "differ": differ[:5], "max_abs": worst}


def make_engine(lib: str, args, stage: int, *, fresh: bool):
    """An engine over a new model and its parameter count; `fresh`: parameters moved away."""
    import torch

    model = h.build_lm() if args.small else h.build_lm(**h.LM_100M)
    n_params = sum(p.numel() for p in model.parameters())
    if fresh:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    return h.trainer(lib, model, h.config(args.micro_batch, stage))[3], n_params


def worker(mode: str, args) -> dict:
    name = mode.split("_")[0]
    lib = h.library(name)
    rank, _world = h.setup(args.threads)
    stage = 0 if mode == "ours_reshard" else int(mode[-1])
    result = {"stage": stage, "saves": [], "flushes": [], "loads": [], "bytes": [], "checks": []}
    result |= {"files": [], "content": {}}
    windows = h.Window()
    if mode == "ours_reshard":
        reshard_loads(lib, args, CHECKPOINT_DIR / "ours_s3", windows, result)
    else:
        save_and_load((name, lib), args, mode, CHECKPOINT_DIR / mode, windows, result, rank)
    return result | windows.result() | {"peak_rss_mib": h.peak_rss_mib()}


def save_and_load(libs, args, mode: str, root: Path, windows, result: dict, rank: int) -> None:
    """`--repeats` saves and loads; ours_s3 keeps its last checkpoint for ours_reshard."""
    import torch

    (name, lib) = libs
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # left by an earlier attempt
    engine, result["params"] = make_engine(name, args, result["stage"], fresh=False)
    for x, y in h.random_batches(rank, args.steps, args.micro_batch):
        engine.backward(engine(x, y))
        engine.step()
    ref_params, ref_opt = full_params(lib, engine, rank), optimizer_snapshot(engine)
    for i in range(args.repeats):
        tag = f"bench_r{i}"
        with windows:
            engine.save_checkpoint(str(root), tag=tag)
        result["saves"].append(windows.last)
        if rank == 0:
            files = tag_files(root / tag)
            result["bytes"].append(sum(f.stat().st_size for f in files))
            t0 = time.perf_counter()
            each_fd(files, os.fsync)
            result["flushes"].append(time.perf_counter() - t0)
            if i == 0:
                result["files"] = [[f.name, f.stat().st_size] for f in files]
                result["content"] = {f.name: content_summary(f) for f in files}
                result["outside_tag"] = [str(f.relative_to(root)) for f in tag_files(root)]
                result["outside_tag"] = [n for n in result["outside_tag"] if tag not in n]
            drop_cached(files)
        fresh, _ = make_engine(name, args, result["stage"], fresh=True)
        with windows:
            path, _client = fresh.load_checkpoint(str(root), tag=tag)
        result["loads"].append(windows.last)
        if path is None:
            raise RuntimeError(f"load_checkpoint found no checkpoint {tag!r} in {root}")
        check = {"optimizer": compare(ref_opt, optimizer_snapshot(fresh))}
        loaded = full_params(lib, fresh, rank)
        if rank == 0:
            check["params"] = compare(sorted(ref_params.items()), sorted(loaded.items()))
        result["checks"].append(check)
        del fresh, loaded
        gc.collect()
        h.barrier()
        if rank == 0 and not (mode == "ours_s3" and i == args.repeats - 1):
            shutil.rmtree(root / tag)
    if rank == 0 and mode == "ours_s3":
        torch.save(ref_params, root / "reference_params.pt")
    elif rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def reshard_loads(lib, args, root: Path, windows, result: dict) -> None:
    """World size 1, stage 0: load the checkpoint ours_s3 kept, `--repeats` times; then delete it."""
    import torch

    tags = sorted(root.glob("bench_r*"))
    if not tags or not (root / "reference_params.pt").exists():
        raise h.Skip(f"no checkpoint of ours_s3 under {root}: run ours_s3 first")
    ref_params = torch.load(root / "reference_params.pt", weights_only=True)
    files = tag_files(tags[-1])
    result["bytes"] = [sum(f.stat().st_size for f in files)] * args.repeats
    result["files"] = [[f.name, f.stat().st_size] for f in files]
    for _ in range(args.repeats):
        drop_cached(files)
        fresh, result["params"] = make_engine("ours", args, 0, fresh=True)
        with windows:
            fresh.load_checkpoint(str(root), tag=tags[-1].name)
        result["loads"].append(windows.last)
        loaded = full_params(lib, fresh, 0)
        check = compare(sorted(ref_params.items()), sorted(loaded.items()))
        result["checks"].append({"params": check})
        del fresh, loaded
        gc.collect()
    shutil.rmtree(root)


def verdict(run: dict, kind: str) -> str:
    """'bit-equal (N tensors x checks)' over every rank and repeat, or what differed."""
    checks = [c[kind] for rank in run["ranks"] for c in rank["checks"] if kind in c]
    bad = [c for c in checks if not c["equal"]]
    if not checks:
        return "-"
    if not bad:
        return f"bit-equal ({checks[0]['n']} tensors x {len(checks)})"
    worst = max(c["max_abs"] for c in bad)
    first = ", ".join(bad[0]["differ"])
    return f"DIFFER in {len(bad)}/{len(checks)} ({first}; max abs {worst:.3g})"


def tables(results: dict) -> dict:
    med, times = h.median, lambda xs: ", ".join(f"{x:.2f}" for x in xs) or "-"

    def synced(r: dict) -> float:
        return med(map(sum, zip(r["saves"], r["flushes"])))

    measures = [("save (s, median)", lambda r: med(r["saves"]), ".2f")]
    measures.append(("save + fsync of its files (s, median)", synced, ".2f"))
    measures.append(("load into a fresh engine (s, median)", lambda r: med(r["loads"]), ".2f"))
    measures.append(("bytes on disk (MiB)", lambda r: r["bytes"][0] / render.MIB, ".1f"))
    ratios = []
    for stage, a, b in PAIRS:
        ra, rb = render.runs(results, a), render.runs(results, b)
        for label, get, spec in measures:
            va, vb = (get(r[0]) if r else None for r in (ra, rb))
            pairs = ((va, a), (vb, b))
            cells = [
                render.failure(results, m) if v is None else render.fmt(v, spec) for v, m in pairs
            ]
            ratios.append([stage, label, *cells, render.ratio(va, vb)])
    modes, files = [], []
    for mode, world in SCENARIO.modes.items():
        rs = render.runs(results, mode)
        if not rs:
            modes.append([mode, world, "-", render.failure(results, mode)] + ["-"] * 8)
            continue
        r = rs[0]
        p, o = verdict(r, "params"), verdict(r, "optimizer")
        if mode == "ours_reshard":
            p, o = p + " (vs the parameters ours_s3 saved)", "not checked (other layout)"
        load = render.fmt(r.get("other_load"), ".2f") + "*" * bool(r.get("noisy"))
        size = f"{r['bytes'][0]:,}" if r["bytes"] else "-"
        cells = [r["stage"], times(r["saves"]), times(r["flushes"]), times(r["loads"]), size]
        cells += [len(r["files"]), p, o, render.fmt(r["peak_rss_mib"]), load]
        modes.append([mode, world, *cells])
        for name, size in r["files"] if mode != "ours_reshard" else []:
            parts = sorted(r["content"].get(name, {}).items(), key=lambda kv: -kv[1])
            desc = ", ".join(f"`{k}` {v / render.MIB:.1f} MiB" for k, v in parts) or "no tensors"
            files.append([mode, f"`{name}`", f"{size:,}", desc])
    mode_head = ["mode", "world size", "stage", "save s (all repeats)", "fsync after save s"]
    mode_head += ["load s (all repeats)", "bytes on disk", "files", "parameters after load"]
    mode_head += ["optimizer state after load (every rank)", "peak RSS (MiB, max over ranks)"]
    mode_head += ["other load (cores)"]
    ratio_head = ["stage", "measure", "shardspeed", "DeepSpeed"]
    ratio_head += ["ratio shardspeed / DeepSpeed (lower is better)"]
    file_head = ["mode", "file (in the tag directory)", "bytes", "tensor bytes in it, by key"]
    outside = {n for rs in results["runs"].values() for r in rs for n in r.get("outside_tag", [])}
    run = render.run_line(results)
    run += f" Outside the tag directory: {', '.join(sorted(outside))}." if outside else ""
    out = {"ratios": render.table(ratio_head, ratios, "rlrrr")}
    out["modes"] = render.table(mode_head, modes, "lrrlllrrllrr")
    return out | {"files": render.table(file_head, files, "llrl"), "run": run}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_checkpoint.py")
