"""Turns a benchmark's result JSON into markdown tables and writes them into BENCHMARKS.md."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

BENCH_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
MIB = 2**20


def table(headers: Sequence[str] | str, rows: Iterable[Sequence], align: str = "") -> str:
    """A markdown table; `align` has 'r' (right) or 'l' per column; None cells are '-'."""
    headers = headers.split(" | ") if isinstance(headers, str) else headers
    align = align.ljust(len(headers), "l")
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for row in rows:
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def columns(spec: Sequence[tuple[str, str, Callable]], items: Iterable) -> str:
    """A table with one row per item; `spec` holds (header, align, cell(item)) per column."""
    rows = [[cell(item) for _, _, cell in spec] for item in items]
    return table([c[0] for c in spec], rows, "".join(c[1] for c in spec))


def fmt(value, spec: str = ".0f", missing: str = "-") -> str:
    return missing if value is None or value != value else format(value, spec)


def ratio(a, b, spec: str = ".3f") -> str:
    return format(a / b, spec) if a and b else "-"


def runs(results: dict, mode: str) -> list[dict]:
    return results["runs"].get(mode) or []


def med(results: dict, mode: str, key: str | Callable = "tokens_per_s"):
    """Median over rounds of a rank-0 value (a key or a function of the run); None if no run."""
    values = [key(r) if callable(key) else r.get(key) for r in runs(results, mode)]
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def per_rank(results: dict, mode: str, fn: Callable, agg: Callable = statistics.median) -> list:
    """fn(rank result) for each rank, aggregated over rounds (median by default)."""
    rs = runs(results, mode)
    if not rs:
        return []
    return [agg([fn(run["ranks"][r]) for run in rs]) for r in range(len(rs[0]["ranks"]))]


def slash(values: Sequence, spec: str = ".1f") -> str:
    return " / ".join(fmt(v, spec) for v in values) or "-"


def ranks_text(results: dict, mode: str, fn: Callable, spec=".1f", agg=statistics.median) -> str:
    """fn(rank result) of each rank, aggregated over rounds, as 'rank 0 / rank 1'."""
    return slash(per_rank(results, mode, fn, agg), spec)


def millions(results: dict, mode: str, key: str = "params_local") -> str:
    """Rank 0 / rank 1's `key` in millions ('12.34M / 12.34M')."""
    return " / ".join(f"{p / 1e6:.2f}M" for p in per_rank(results, mode, lambda r: r[key]))


def rss_columns(results: dict, growth: bool = True, peak_header: str = "") -> list[tuple]:
    """The peak RSS column (max over rounds) and, with `growth`, the RSS growth in training."""

    def peak(mode: str) -> str:
        return ranks_text(results, mode, lambda r: r["peak_rss_mib"], ".0f", max)

    def grown(mode: str) -> str:
        return ranks_text(results, mode, lambda r: r["rss_growth_mib"], ".0f")

    out = [(peak_header or "peak RSS per rank (MiB)", "l", peak)]
    return out + [("RSS growth in training (MiB)", "l", grown)] * growth


def speed_columns(results: dict, bases: dict[str, str | Callable]) -> list[tuple]:
    """Median tokens/s, ms/step, and the ratio to each base ('/ NAME' columns)."""

    def against(base):
        def cell(mode: str) -> str:
            other = base(mode) if callable(base) else base
            return ratio(med(results, mode), other and med(results, other))

        return cell

    spec = [("tokens/s (median)", "r", lambda m: fmt(med(results, m)))]
    spec.append(("ms/step", "r", lambda m: fmt(med(results, m, "step_ms"))))
    return spec + [(f"/ {name}", "r", against(base)) for name, base in bases.items()]


def mib_column(results: dict, header: str, key: str, scale: int = 1, missing="-") -> tuple:
    """A column of each rank's `key` in MiB (times `scale`), or `missing` where all are 0."""

    def cell(mode: str) -> str:
        values = per_rank(results, mode, lambda r: scale * (r.get(key) or 0) / MIB)
        return slash(values) if any(values) else missing

    return header, "l", cell


def model_columns(results: dict) -> list[tuple]:
    """Mode, parameters per rank, 16 bytes a parameter, shardspeed's model states measured."""
    return [
        ("mode", "l", str),
        ("parameters per rank (rank 0 / 1)", "l", lambda m: millions(results, m)),
        mib_column(results, "16 B x parameters (MiB)", "params_local", 16),
        mib_column(results, "shardspeed model states, measured (MiB)", "model_state_bytes"),
    ]


def measured(results: dict) -> list[str]:
    """The modes with at least one run, in run order."""
    return [mode for mode, rs in results["runs"].items() if rs]


def failure(results: dict, mode: str) -> str:
    f = results.get("failed", {}).get(mode)
    if f is None:
        return "not run"
    return f"skipped: {f['skipped']}" if "skipped" in f else f"error: {f['error']}"


def ratio_table(results: dict, comparisons: Sequence[tuple]) -> str:
    """One row per (ours, baseline, target, label): tokens/s, ratios, target met."""
    rows = []
    for a, b, target, label in comparisons:
        ma, mb = med(results, a), med(results, b)
        if ma is None and mb is None:
            continue
        pairs = zip(runs(results, a), runs(results, b))
        per_round = ", ".join(f"{x['tokens_per_s'] / y['tokens_per_s']:.3f}" for x, y in pairs)
        r = ma / mb if ma and mb else None
        verdict = "not measured" if r is None else "info only" if target is None else None
        verdict = verdict or ("met" if r >= target else "MISSED")
        cells = [fmt(ma) if ma else failure(results, a), fmt(mb) if mb else failure(results, b)]
        target_text = "-" if target is None else f">= {target:.2f}"
        rows.append([label, *cells, fmt(r, ".3f", "n/a"), per_round or "-", target_text, verdict])
    head = "comparison | ours tok/s | baseline tok/s | ratio (median) | per-round ratios | target"
    return table(head + " | result", rows, "lrrrlrl")


def mode_table(results: dict, modes: Iterable[str] | None = None) -> str:
    """Per mode: world size, tokens/s per round, ms/step, peak RSS, losses, other load."""
    rows = []
    for mode in modes or results["runs"]:
        rs = runs(results, mode)
        if not rs:
            rows.append([mode, "-", failure(results, mode), "-", "-", "-", "-", "-"])
            continue
        rounds = ", ".join(f"{r['tokens_per_s']:.0f}{'*' * bool(r.get('noisy'))}" for r in rs)
        cells = [rs[0]["world_size"], fmt(med(results, mode)), rounds]
        cells += [fmt(med(results, mode, "step_ms")), fmt(max(r["peak_rss_mib"] for r in rs))]
        cells.append(f"{rs[0]['first_loss']:.4f} -> {rs[0]['last_loss']:.4f}")
        rows.append([mode, *cells, ", ".join(fmt(r.get("other_load"), ".2f") for r in rs)])
    head = "mode | world size | tokens/s (median) | all rounds | ms/step | peak RSS per rank (MiB)"
    return table(head + " | loss first -> last | other load (cores, per round)", rows, "lrrlrrll")


def comm_text(calls: dict, nbytes: dict) -> str:
    """'all_reduce 49 x (96.0 MiB), ...' from a CommCounter snapshot."""
    return ", ".join(f"{k} {calls[k]} x ({nbytes[k] / MIB:.1f} MiB)" for k in sorted(calls)) or (
        "none seen"
    )


def loss_lines(results: dict, reference: str, tolerance: float, key: str = "losses") -> str:
    """Each mode's losses against the reference mode's (first step within `tolerance`)."""
    ref = runs(results, reference)
    ref_losses = ref[0][key] if ref else None
    rows = []
    for mode, rs in results["runs"].items():
        if not rs:
            continue
        losses = rs[0][key]
        first = worst = None
        if ref_losses and mode != reference:
            first = abs(losses[0] - ref_losses[0]) / abs(ref_losses[0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        within = None if first is None else ("yes" if first <= tolerance else "NO")
        cells = [f"{losses[0]:.5f}", f"{losses[-1]:.5f}", len(losses), fmt(first, ".1e")]
        rows.append([mode, *cells, within, fmt(worst, ".1e")])
    head = f"mode | first loss | last loss | steps | first step vs {reference} (relative)"
    head += f" | within {tolerance:g} | largest over all steps"
    return table(head, rows, "lrrrrlr")


def run_line(results: dict) -> str:
    """The provenance line of a rendered run."""
    m = results["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    return (
        f"Run of {m['date']} ({m['machine']}; {versions}; shardspeed at commit {m['commit']}): "
        f"`{m['command']}`, {m['total_s']:.0f}s; {m['discarded']} run(s) rerun for other "
        f"load, {m['noisy']} noisy run(s) kept (marked *)."
    )


def write(name: str, tables: dict[str, str], path: Path = BENCH_MD) -> None:
    """Replace each table `name/ID` between its markers in BENCHMARKS.md (append new ones)."""
    text = path.read_text()
    for tid, body in tables.items():
        start, end = f"<!-- table {name}/{tid} -->", "<!-- /table -->"
        block = f"{start}\n{body}\n{end}"
        pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
        if pattern.search(text):
            text = pattern.sub(lambda _m, b=block: b, text, count=1)
        else:
            text = text.rstrip("\n") + f"\n\n{block}\n"
    path.write_text(text)
    print(f"wrote {len(tables)} table(s) of {name} into {path.name}")


def training_tables(
    results: dict, comparisons, throughput: str, own: dict, tolerance: float
) -> dict:
    """The tables of a training benchmark (pipe, tp, moe)."""
    out = {"ratios": ratio_table(results, comparisons), "throughput": throughput}
    out |= {"modes": mode_table(results), **own}
    return out | {"losses": loss_lines(results, "ours_dp", tolerance), "run": run_line(results)}
