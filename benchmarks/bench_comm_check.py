"""The gloo same-call check's cost: its share of the step, timed inside the check's own functions
on every rank, in the Ulysses benchmark's model at sp 4 and the ZeRO-3 benchmark's GPT at 2 and 4
ranks; each with the check following the steps' agreed sequence (the default), checking call by
call (the engine's step marks switched off: how every call was checked before), and switched off
('comms_same_call_check': false). Wall-clock tokens/s are information only: this machine's noise
is larger than 2%.

    .venv/bin/python benchmarks/bench_comm_check.py [--quick] [--write]
"""

from __future__ import annotations

import time

import bench_sequence
import harness as h
import render

CHECKS = ("agreed", "by_call", "off")
FAMILIES = {"ulysses_sp4": 4, "zero3_ws2": 2, "zero3_ws4": 4}
SCENARIO = h.Scenario(
    name="comm_check",
    section="## The same-call check's cost",
    modes={f"{family}_{check}": world for family, world in FAMILIES.items() for check in CHECKS},
    warmup=3,
    steps=8,
    rounds=2,
    micro_batch=4,
    quick={"warmup": 1, "steps": 2, "rounds": 1, "seq_len": 256},
    options={"--seq-len": dict(type=int, default=2048, help="Ulysses' global sequence length")},
    timeout=600,
)
TIMED = ("_call", "_check_same_call", "_agree_on_departure")  # the check's functions in comm.py
TARGET = 0.02  # the check's most share of a step


class CheckClock:
    """Seconds spent inside the check's functions, and how often each ran (wraps them in place:
    `_run` looks them up as module globals on every call)."""

    def __init__(self) -> None:
        from shardspeed.comm import comm as impl

        self.seconds, self.calls = 0.0, dict.fromkeys(TIMED, 0)
        for name in TIMED:
            setattr(impl, name, self._timed(name, getattr(impl, name)))

    def _timed(self, name: str, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls[name] += 1

        return timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, dict.fromkeys(TIMED, 0)


def ulysses_step(rank: int, world: int, args):
    """Batches and a step of the Ulysses benchmark's Llama-like model at sp `world`."""
    _, step = bench_sequence.engine_for("ours", world, 1)
    data, labelled = bench_sequence.batches(args.warmup + args.steps, args.seq_len, 1, rank, world)
    return [(x, y) for x, y in data], lambda x, y: step(x, y, labelled), args.seq_len


def zero3_step(rank: int, world: int, args):
    """Batches and a step of the ZeRO benchmark's GPT at stage 3."""
    model = h.build_lm()
    batches = h.random_batches(rank, args.warmup + args.steps, args.micro_batch)
    forward, backward, update, _ = h.trainer("ours", model, h.config(args.micro_batch, 3))
    return batches, h.step_fn(forward, backward, update), world * args.micro_batch * h.SEQ


def worker(mode: str, args) -> dict:
    from shardspeed import comm
    from shardspeed.runtime import engine as engine_module

    rank, world = h.setup(args.threads)
    check = next(c for c in CHECKS if mode.endswith(f"_{c}"))
    family = mode[: -len(check) - 1]
    clock = CheckClock()
    if check == "by_call":
        engine_module.mark_step = lambda: None  # no step marks: no sequence is ever offered
    build = ulysses_step if family.startswith("ulysses") else zero3_step
    batches, step, tokens = build(rank, world, args)
    if check == "off":
        comm.set_same_call_check(False)  # every rank, at the same point
    for x, y in batches[: args.warmup]:
        step(x, y)
    h.barrier()
    clock.reset()
    sequence = comm.collective_sequence()
    result = h.timed(step, batches, 0, args.steps, tokens)
    window = 1000 * result["elapsed_s"]
    return result | {
        "check_ms": 1000 * clock.seconds,
        "check_share": clock.seconds / result["elapsed_s"],
        "check_calls": clock.calls,
        "collectives": comm.collective_sequence() - sequence,
        "window_ms": window,
        "steps": args.steps,
    }


def share(results: dict, mode: str) -> float | None:
    """The check's largest share of the timed steps over the ranks, median over the rounds."""
    values = [max(r["check_share"] for r in run["ranks"]) for run in render.runs(results, mode)]
    return h.median(values) if values else None


def cost_table(results: dict) -> str:
    rows = []
    for family in FAMILIES:
        for check in CHECKS:
            mode = f"{family}_{check}"
            runs = render.runs(results, mode)
            if not runs:
                continue
            first = runs[0]
            counts = first["ranks"][0]["check_calls"]
            tps = h.median(run["tokens_per_s"] for run in runs)
            value = share(results, mode)
            verdict = "" if check != "agreed" else ("met" if value <= TARGET else "missed")
            rows.append(
                [
                    family,
                    check.replace("_", " "),
                    str(first["ranks"][0]["collectives"] // max(1, first["steps"])),
                    str(counts["_check_same_call"] // max(1, first["steps"])),
                    str(counts["_agree_on_departure"]),
                    render.fmt(100 * value, ".2f") + " %",
                    f"{tps:.0f}",
                    verdict,
                ]
            )
    header = (
        "model | check | collectives / step | call-by-call checks / step | departures | "
        "check's share of the step (largest rank) | tokens/s | < 2 %"
    )
    return render.table(header, rows, "llrrrrrl")


def tables(results: dict) -> dict:
    return {"cost": cost_table(results), "run": render.run_line(results)}


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_comm_check.py")
