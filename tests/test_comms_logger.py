"""The comms logger: what each wrapped collective records (bytes, count, latency, bandwidths) on two
gloo ranks, the prof_ops filter, nothing while disabled, and the summaries."""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
from collections.abc import Iterator

import pytest
import torch

from shardspeed import comm
from shardspeed.comm.logger import bus_factor
from shardspeed.config.schema import CommsLoggerConfig

F32 = 4


@contextlib.contextmanager
def _logging(**keys: object) -> Iterator[comm.CommsLogger]:
    """The process's logger configured with `keys`, empty; disabled and emptied again after."""
    logger = comm.configure_comms_logger(CommsLoggerConfig(enabled=True, **keys))
    comm.reset_log()
    try:
        yield logger
    finally:
        comm.configure_comms_logger(CommsLoggerConfig())
        comm.reset_log()


def _every_collective(async_op: bool) -> dict[str, int]:
    """Run each wrapper once (sizes differ per op, and double when async); the payload of each."""
    k = 2 if async_op else 1
    works = [
        comm.all_reduce(torch.ones(5 * k), async_op=async_op),
        comm.all_gather_into_tensor(torch.empty(6 * k), torch.ones(3 * k), async_op=async_op),
        comm.reduce_scatter_tensor(torch.empty(4 * k), torch.ones(8 * k), async_op=async_op),
        comm.broadcast(torch.ones(7 * k), src=0, async_op=async_op),
        comm.reduce(torch.ones(9 * k), dst=0, async_op=async_op),
        comm.all_to_all_single(torch.empty(10 * k), torch.ones(10 * k), async_op=async_op),
        comm.all_gather(
            [torch.empty(11 * k) for _ in range(2)], torch.ones(11 * k), None, async_op
        ),
    ]
    if async_op:
        for work in works:
            work.wait()
    else:
        comm.barrier()
    expected = {
        "all_reduce": 5 * k * F32,
        "all_gather_into_tensor": 6 * k * F32,  # the gathered output
        "reduce_scatter_tensor": 8 * k * F32,  # the full input
        "broadcast": 7 * k * F32,
        "reduce": 9 * k * F32,
        "all_to_all_single": 10 * k * F32,
        "all_gather": 2 * 11 * k * F32,
    }
    return expected if async_op else {**expected, "barrier": 0}


def _records() -> dict:
    with _logging():
        comm.reset_comm_volume()
        expected = {False: _every_collective(False), True: _every_collective(True)}
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            summary = comm.log_summary()
        return {
            "expected": expected,
            "summary": summary,
            "volume": comm.comm_volume(),
            "table": table.getvalue(),
        }


def test_every_collective_records_its_payload_latency_and_bandwidths(pool2):
    for rank, out in enumerate(pool2.run(_records)):
        summary = out["summary"]
        assert summary["metadata"] == {"rank": rank, "world_size": 2}
        assert summary["straggler_analysis"] is None
        rows = summary["summary"]
        expected: dict[str, set[int]] = {}
        for sizes in out["expected"].values():
            for op, nbytes in sizes.items():
                expected.setdefault(op, set()).add(nbytes)
        assert {op: set(by_size) for op, by_size in rows.items()} == expected
        for op, by_size in rows.items():
            for nbytes, row in by_size.items():
                assert row["count"] == 1 and row["msg_size_bytes"] == nbytes
                assert row["total_latency_ms"] == row["avg_latency_ms"] > 0
                algbw = nbytes * 8 / (row["avg_latency_ms"] / 1e3) / 1e9
                assert row["algbw_avg_gbps"] == pytest.approx(algbw)
                assert row["busbw_avg_gbps"] == pytest.approx(algbw * bus_factor(op, 2))
        # The logger's sizes are comm_volume's payloads (which groups by pattern, not by name).
        volume = out["volume"]
        for op, volume_name in [
            ("all_reduce", "all_reduce"),
            ("reduce_scatter_tensor", "reduce_scatter"),
            ("broadcast", "broadcast"),
            ("reduce", "reduce"),
            ("all_to_all_single", "all_to_all"),
        ]:
            assert sum(rows[op]) == volume[volume_name]["bytes"]
        gathered = sum(rows["all_gather_into_tensor"]) + sum(rows["all_gather"])
        assert gathered == volume["all_gather"]["bytes"]
        if rank == 0:
            lines = out["table"].splitlines()
            assert lines[0].split()[:5] == ["Comm.", "Op", "Message", "Size", "Count"]
            assert "busbw (Gbps)" in lines[0] and "algbw (Gbps)" in lines[0]
            assert [line for line in lines if line and not line[0].isspace()][1:] == sorted(rows)
            at = lines.index("all_reduce")
            assert lines[at + 1].split()[:3] == ["20", "B", "1"]
            assert lines[at + 2].split()[:3] == ["40", "B", "1"]
        else:
            assert out["table"] == ""  # the table comes from rank 0 only


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5
    for op in (
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ):
        assert bus_factor(op, 4) == 0.75
    for op in ("broadcast", "reduce", "barrier"):
        assert bus_factor(op, 4) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0  # one rank: nothing crosses a link


def _filtered_and_disabled() -> dict:
    out = {}
    with _logging(prof_all=False, prof_ops=["all_reduce", "broadcast"]):
        for _ in range(3):
            comm.all_reduce(torch.ones(4))
        comm.broadcast(torch.ones(4), src=1)
        comm.broadcast(torch.ones(4), src=0, async_op=True).wait()
        comm.all_gather_into_tensor(torch.empty(4), torch.ones(2))
        comm.all_gather_into_tensor(torch.empty(4), torch.ones(2), async_op=True).wait()
        out["filtered"] = comm.log_summary()["summary"]
        out["step"] = comm.comms_logger.step_summary()
    comm.reset_comm_volume()
    with _logging():
        comm.configure_comms_logger(CommsLoggerConfig(enabled=False))
        comm.all_reduce(torch.ones(4))
        work = comm.all_reduce(torch.ones(4), async_op=True)
        out["disabled_timing"] = work._timing
        work.wait()
        out["disabled"] = comm.log_summary()["summary"]
        out["disabled_step"] = comm.comms_logger.step_summary()
    out["volume"] = comm.comm_volume()  # counted all the same
    return out


def test_prof_ops_picks_operations_and_a_disabled_logger_records_nothing(pool2):
    for out in pool2.run(_filtered_and_disabled):
        assert {op: list(rows) for op, rows in out["filtered"].items()} == {
            "all_reduce": [16],
            "broadcast": [16],
        }
        assert out["filtered"]["all_reduce"][16]["count"] == 3
        assert out["filtered"]["broadcast"][16]["count"] == 2
        step = out["step"]
        assert {op: (s["count"], s["bytes"]) for op, s in step.items()} == {
            "all_reduce": (3, 48),
            "broadcast": (2, 32),
        }
        assert step["all_reduce"]["busbw_gbps"] == pytest.approx(step["all_reduce"]["algbw_gbps"])
        assert step["broadcast"]["latency_ms"] > 0
        assert out["disabled"] == {} and out["disabled_step"] == {}
        assert out["disabled_timing"] is None
        assert out["volume"]["all_reduce"] == {"calls": 2, "bytes": 32}


def _steps_debug_verbose_and_stragglers() -> dict:
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger("shardspeed")
    log.addHandler(handler)
    out: dict = {}
    try:
        with _logging(verbose=True, debug=True):
            work = comm.all_reduce(torch.ones(8), async_op=True)
            time.sleep(0.05)  # overlapped work counts: the latency runs until wait() returns
            work.wait()
            work.wait()  # recorded once
            out["first"] = comm.comms_logger.step_summary()
            comm.reduce_scatter_tensor(torch.empty(4), torch.ones(8))
            out["second"] = comm.comms_logger.step_summary()
            out["empty"] = comm.comms_logger.step_summary()
            with contextlib.redirect_stdout(io.StringIO()):
                out["summary"] = comm.log_summary(show_straggler=True)
                comm.reset_log()
                out["after_reset"] = comm.log_summary()["summary"]
    finally:
        log.removeHandler(handler)
    out["seen"] = seen
    return out


def test_steps_debug_callers_verbose_lines_and_straggler_breakdown(pool2):
    caller = re.compile(r"all_reduce \| test_comms_logger\.py:\d+ in _steps_debug_verbose_and_")
    for rank, out in enumerate(pool2.run(_steps_debug_verbose_and_stragglers)):
        [(reduce_label, first)] = out["first"].items()
        assert caller.match(reduce_label)
        assert first["count"] == 1 and first["bytes"] == 32
        assert first["latency_ms"] >= 50
        [(scatter_label, second)] = out["second"].items()
        assert scatter_label.startswith("reduce_scatter_tensor | test_comms_logger.py:")
        assert second["busbw_gbps"] == pytest.approx(second["algbw_gbps"] / 2)
        assert out["empty"] == {}
        summary = out["summary"]
        assert sorted(summary["summary"]) == sorted([reduce_label, scatter_label])
        stragglers = summary["straggler_analysis"]
        for label, by_size in summary["summary"].items():
            for nbytes, row in by_size.items():
                lag = stragglers[label][nbytes]
                assert lag["count"] == row["count"] == 1
                total = lag["total_comm_lat_ms"] + lag["total_straggler_ms"]
                assert total == pytest.approx(row["total_latency_ms"])
                assert lag["total_straggler_ms"] >= 0
        assert out["after_reset"] == {}
        if rank == 0:  # each op is logged as it happens, on rank 0 only (as DeepSpeed does)
            assert len(out["seen"]) == 2
            assert out["seen"][0].startswith(f"comm op: {reduce_label} | time (ms): ")
            assert "msg size: 32 B | group: 2 |" in out["seen"][0]
        else:
            assert out["seen"] == []


def test_profiling_comms_switches_prof_all():
    logger = comm.CommsLogger()
    logger.stop_profiling_comms()
    assert logger.prof_all is False and logger.start("all_reduce", 8, None) is None
    logger.start_profiling_comms()
    assert logger.prof_all is True


def _inference_sum() -> list[float]:
    x = torch.full((3,), float(comm.get_rank() + 1), dtype=torch.bfloat16)
    comm.inference_all_reduce(x)
    return x.tolist()


def test_inference_all_reduce_sums_over_ranks(pool2):
    assert pool2.run(_inference_sum) == [[3.0, 3.0, 3.0]] * 2
