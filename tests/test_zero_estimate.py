"""Model-state memory estimates (shardspeed.zero.estimate) against the ZeRO paper and DeepSpeed."""

from __future__ import annotations

import subprocess
import sys
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest
import torch
from torch import nn

from shardspeed.zero import estimate
from shardspeed.zero.estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_state_bytes,
)

GB = 1e9  # the paper's unit
GIB = 2**30  # DeepSpeed's

# ZeRO paper (arXiv:1910.02054) Table 1: GB per device for P_os / P_os+g / P_os+g+p (stages 1, 2, 3),
# with fp16 mixed-precision Adam (K = 12), as printed.
TABLE_1 = {
    7.5e9: {
        1: ("120", "120", "120"),
        4: ("52.5", "41.3", "30"),
        16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"),
        256: ("30.4", "15.4", "0.47"),
        1024: ("30.1", "15.1", "0.12"),
    },
    128e9: {
        1: ("2048", "2048", "2048"),
        4: ("896", "704", "512"),
        16: ("608", "368", "128"),
        64: ("536", "284", "32"),
        256: ("518", "263", "8"),
        1024: ("513", "257", "2"),
    },
    1e12: {
        1: ("16000", "16000", "16000"),
        4: ("7000", "5500", "4000"),
        16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"),
        256: ("4046", "2054", "62.5"),
        1024: ("4011", "2013", "15.6"),
    },
}


def _as_printed(value: float, printed: str) -> bool:
    """Whether `printed` is `value` rounded or cut off at the printed decimal place.

    Mostly three significant figures, rounded, but the paper cuts some figures off (4187.5 is printed
    4187, 513.5 is 513) and gives small ones two decimals (0.46875 is 0.47).
    """
    shown = Decimal(printed)
    place = Decimal(1).scaleb(shown.as_tuple().exponent)
    exact = Decimal(value)
    return shown in (exact.quantize(place, ROUND_HALF_UP), exact.quantize(place, ROUND_DOWN))


@pytest.mark.parametrize("params", sorted(TABLE_1))
def test_paper_table_1(params: float) -> None:
    for ranks, printed in TABLE_1[params].items():
        for stage, shown in zip((1, 2, 3), printed):
            total = model_state_bytes(int(params), ranks, stage)["total"] / GB
            assert _as_printed(total, shown), (params, ranks, stage, total, shown)


def test_paper_figure_1() -> None:
    # 7.5B parameters on 64 ranks: baseline, P_os, P_os+g, P_os+g+p.
    totals = [model_state_bytes(7_500_000_000, 64, stage)["total"] for stage in range(4)]
    assert totals[0] == 120e9
    assert [round(total / GB, 3) for total in totals[1:]] == [31.406, 16.641, 1.875]
    assert all(_as_printed(t / GB, s) for t, s in zip(totals, ("120", "31.4", "16.6", "1.88")))


def test_mixed_precision_parts_per_stage() -> None:
    params, ranks = 1_000, 8
    expected = {  # parameters, gradients, master weights, optimizer states
        0: (2000, 2000, 4000, 8000),
        1: (2000, 2000, 500, 1000),
        2: (2000, 250, 500, 1000),
        3: (250, 250, 500, 1000),
    }
    for precision in ("fp16", "bf16"):
        for stage, parts in expected.items():
            got = model_state_bytes(params, ranks, stage, precision)
            assert (
                got["parameters"],
                got["gradients"],
                got["master_weights"],
                got["optimizer_states"],
            ) == parts
            assert got["total"] == got["device_total"] == sum(parts)
            assert got["cpu_total"] == 0


def test_fp32_formulas() -> None:
    params, ranks = 1_000, 8
    totals = [model_state_bytes(params, ranks, stage, "fp32")["total"] for stage in range(4)]
    p_over_n = params / ranks
    assert totals == [
        16 * params,
        8 * params + 8 * p_over_n,
        4 * params + 12 * p_over_n,
        16 * p_over_n,
    ]
    assert model_state_bytes(params, ranks, 2, "fp32")["master_weights"] == 0


def test_optimizer_state_size_sets_k() -> None:
    # SGD with momentum keeps 4 bytes a parameter: K = 8, stage 1 = 4P + 8P/N.
    assert model_state_bytes(1_000, 4, 1, optimizer_state_bytes_per_param=4)["total"] == 6000
    assert model_state_bytes(1_000, 4, 3, optimizer_state_bytes_per_param=0)["total"] == 2000


def test_offload_split() -> None:
    params, ranks = 1_000, 4
    stage2 = model_state_bytes(params, ranks, 2, offload_optimizer=True)
    assert (
        stage2["cpu_total"] == 4 * 250 + 8 * 250
    )  # master weights + Adam states, this rank's share
    assert stage2["device_total"] == 2000 + 500  # fp16 parameters + gradient partition
    assert stage2["total"] == model_state_bytes(params, ranks, 2)["total"]

    stage3 = model_state_bytes(params, ranks, 3, offload_optimizer=True, offload_param=True)
    assert stage3["cpu_total"] == 500 + 1000 + 2000
    assert stage3["device_total"] == 500  # only the gradient partition stays

    # fp32: parameters on the device, optimizer on the CPU, so the CPU needs its own fp32 copy ...
    fp32 = model_state_bytes(params, ranks, 2, "fp32", offload_optimizer=True)
    assert fp32["master_weights"] == 1000
    assert (fp32["device_total"], fp32["cpu_total"]) == (4000 + 1000, 1000 + 2000)
    # ... unless the parameter partition is on the CPU too, and then it is the master copy.
    both = model_state_bytes(params, ranks, 3, "fp32", offload_optimizer=True, offload_param=True)
    assert both["master_weights"] == 0
    assert (both["device_total"], both["cpu_total"]) == (1000, 1000 + 2000)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_params": -1}, "num_params"),
        ({"num_params": 1.5}, "num_params"),
        ({"num_params": True}, "num_params"),
        ({"dp_world_size": 0}, "dp_world_size"),
        ({"stage": 4}, "stage"),
        ({"stage": True}, "stage"),
        ({"precision": "fp8"}, "precision"),
        ({"optimizer_state_bytes_per_param": -4}, "optimizer_state_bytes_per_param"),
        ({"stage": 0, "offload_optimizer": True}, "offload_optimizer"),
        ({"stage": 2, "offload_param": True}, "offload_param"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, object], message: str) -> None:
    arguments = {"num_params": 1_000, "dp_world_size": 2, "stage": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        model_state_bytes(**arguments)


def test_whole_float_sizes_are_accepted() -> None:
    assert model_state_bytes(7.5e9, 1, 0)["total"] == 120e9


class TiedModel(nn.Module):
    """64,000 embedding weights shared with the output head, plus a 64x64 layer (4,160)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight


def test_model_counts() -> None:
    model = TiedModel()
    assert estimate._total_params(model) == 68_160
    assert estimate._largest_layer_params(model) == 64_000


def test_deepspeed_zero2_helper_by_hand() -> None:
    # P = 68,160 over 1 node x 4 GPUs, buffer factor 1.5.
    # offload:    GPU 2P = 136,320;               CPU P * max(4*4, 16) * 1.5 = 1,635,840
    # no offload: GPU 2P + int(18P/4) = 443,040;  CPU P * 4 * 4 * 1.5 = 1,635,840
    assert estimate_zero2_model_states_mem_needs(68_160, 4) == (1_635_840, 136_320)
    assert estimate_zero2_model_states_mem_needs(68_160, 4, cpu_offload=False) == (
        1_635_840,
        443_040,
    )
    # Over 2 nodes the offloaded CPU figure grows with all 8 GPUs: P * 32 * 1.5.
    assert estimate_zero2_model_states_mem_needs(68_160, 4, 2) == (3_271_680, 136_320)


def test_deepspeed_zero3_helper_by_hand() -> None:
    # P = 68,160, L = 64,000 over 2 nodes x 4 GPUs (8), buffer 1.5; every GPU holds 4L = 256,000.
    cases = {  # (offload_optimizer, offload_param, zero_init): (CPU, GPU)
        (True, True, True): (920_160, 256_000),  # CPU P * 18 / 2 * 1.5
        (True, True, False): (1_635_840, 256_000),  # CPU P * max(4*4, 9) * 1.5
        (True, False, True): (817_920, 273_040),  # CPU P * 16 / 2 * 1.5; GPU + int(2P/8)
        (True, False, False): (1_635_840, 273_040),  # CPU P * max(16, 8) * 1.5
        (False, False, True): (1_536_000, 409_360),  # CPU L * 4 * 4 * 1.5; GPU + int(18P/8)
        (False, False, False): (1_635_840, 409_360),  # CPU P * 4 * 4 * 1.5
    }
    for (optimizer, param, zero_init), (cpu, gpu) in cases.items():
        got = estimate_zero3_model_states_mem_needs(
            68_160, 64_000, 4, 2, optimizer, param, zero_init
        )
        assert got == (cpu, gpu, 256_000), (optimizer, param, zero_init)
    # Parameter offload counts only with optimizer offload.
    assert estimate_zero3_model_states_mem_needs(68_160, 64_000, 4, 2, False, True, True)[:2] == (
        1_536_000,
        409_360,
    )


def _rows(output: str) -> list[tuple[str, ...]]:
    """(per CPU, per GPU, options) of each table row."""
    return [
        tuple(cell.strip() for cell in line.split("|"))
        for line in output.splitlines()
        if line.count("|") == 2 and "GiB" in line
    ]


def _meta_model() -> nn.Module:
    # 2**28 + 2**27 parameters (largest layer 2**28) without allocating them: P = 0.375 GiB-worth.
    with torch.device("meta"):
        return nn.Sequential(
            nn.Linear(16384, 16384, bias=False), nn.ReLU(), nn.Linear(16384, 8192, bias=False)
        )


def test_zero2_all_live_prints_deepspeed_figures(capsys: pytest.CaptureFixture[str]) -> None:
    # P = 402,653,184 on 2 nodes x 4 GPUs, buffer 1.5:
    # offload:    CPU P * 32 * 1.5 = 18 GiB;  GPU 2P = 0.75 GiB
    # no offload: CPU P * 16 * 1.5 = 9 GiB;   GPU 2P + int(18P/8) = 1.59375 GiB
    assert estimate_zero2_model_states_mem_needs_all_live(_meta_model(), 4, 2) is None
    output = capsys.readouterr().out
    assert "402,653,184 parameters" in output
    assert "2 nodes, 4 GPUs per node" in output
    assert _rows(output) == [
        ("18.00GiB", "0.75GiB", "offload_optimizer=cpu"),
        ("9.00GiB", "1.59GiB", "offload_optimizer=none"),
    ]


def test_zero3_all_live_prints_deepspeed_figures(capsys: pytest.CaptureFixture[str]) -> None:
    # P = 402,653,184, L = 268,435,456 (4L = 1 GiB) on 2 nodes x 4 GPUs, buffer 1.5.
    assert estimate_zero3_model_states_mem_needs_all_live(_meta_model(), 4, 2) is None
    output = capsys.readouterr().out
    assert "402,653,184 parameters, 268,435,456 in the largest layer" in output
    assert _rows(output) == [
        ("5.06GiB", "1.00GiB", "offload_param=cpu, offload_optimizer=cpu, zero_init=1"),  # 13.5P
        ("9.00GiB", "1.00GiB", "offload_param=cpu, offload_optimizer=cpu, zero_init=0"),  # 24P
        ("4.50GiB", "1.09GiB", "offload_param=none, offload_optimizer=cpu, zero_init=1"),  # 12P
        ("9.00GiB", "1.09GiB", "offload_param=none, offload_optimizer=cpu, zero_init=0"),
        ("6.00GiB", "1.84GiB", "offload_param=none, offload_optimizer=none, zero_init=1"),  # 24L
        ("9.00GiB", "1.84GiB", "offload_param=none, offload_optimizer=none, zero_init=0"),
    ]


def test_all_cold_matches_all_live(capsys: pytest.CaptureFixture[str]) -> None:
    model = TiedModel()
    estimate_zero2_model_states_mem_needs_all_live(model, 2)
    live2 = capsys.readouterr().out
    assert estimate_zero2_model_states_mem_needs_all_cold(68_160, 2) is None
    assert capsys.readouterr().out == live2
    assert "1 node, 2 GPUs per node" in live2 and "68,160 parameters" in live2

    estimate_zero3_model_states_mem_needs_all_live(model, 2)
    live3 = capsys.readouterr().out
    assert estimate_zero3_model_states_mem_needs_all_cold(68_160, 64_000, 2) is None
    assert capsys.readouterr().out == live3
    assert len(_rows(live3)) == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_gpus_per_node": 0}, "num_gpus_per_node"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"additional_buffer_factor": 0}, "additional_buffer_factor"),
    ],
)
def test_deepspeed_estimators_reject_bad_setups(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate_zero2_model_states_mem_needs_all_cold(1_000, **kwargs)
    with pytest.raises(ValueError, match=message):
        estimate_zero3_model_states_mem_needs_all_cold(1_000, 10, **kwargs)


def test_deepspeed_import_paths_through_the_alias(tmp_path: Path) -> None:
    probe = (
        "import shardspeed.compat\n"
        "shardspeed.compat.install()\n"
        "from deepspeed.runtime.zero.stage_1_and_2 import "
        "estimate_zero2_model_states_mem_needs_all_live as z2\n"
        "from deepspeed.runtime.zero.stage3 import "
        "estimate_zero3_model_states_mem_needs_all_cold as z3\n"
        "from shardspeed.zero import estimate\n"
        "assert z2 is estimate.estimate_zero2_model_states_mem_needs_all_live\n"
        "assert z3 is estimate.estimate_zero3_model_states_mem_needs_all_cold\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
