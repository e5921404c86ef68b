"""DeepSpeed checkpoints resume under shardspeed: written by DeepSpeed 0.19.8 itself (the fixtures
in `tests/data/deepspeed_checkpoints/`, made by its `make_fixtures.py`), loaded at another world
size and ZeRO stage, continued two steps, equal to DeepSpeed's own continuation.

Tolerance: 1e-5 relative for fp32 (the same AdamW arithmetic, summed in another order); bf16
compares the bf16 weights both runs end with, which are their fp32 masters rounded: 1e-2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import shardspeed
from shardspeed.checkpoint import CheckpointError
from shardspeed.testing import RankPool

HERE = Path(__file__).resolve().parent / "data" / "deepspeed_checkpoints"
sys.path.insert(0, str(HERE))
from make_fixtures import STEPS_MORE, STEPS_SAVED, batch, config  # noqa: E402

CASES = json.loads((HERE / "cases.json").read_text())
# Where each checkpoint is loaded: (processes, ZeRO stage), other than where it was written.
TARGETS = [(1, 0), (2, 2), (2, 3)]


def continue_from(case: str, stage: int, universal: bool = False) -> dict:
    """Load `case` into an engine of this pool's size at `stage`, train the remaining steps."""
    spec = CASES["z2_fp32_ws2" if universal else case]
    world = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    settings = config(stage, spec["precision"], world, 1)
    if universal:
        settings["checkpoint"] = {"load_universal": True}
    engine, *_ = shardspeed.initialize(model=model, config=settings)
    path, client = engine.load_checkpoint(str(HERE / case))
    loaded_steps = engine.global_steps
    rank, dtype = engine.global_rank, next(engine.module.parameters()).dtype
    micro = 8 // world
    for step in range(STEPS_SAVED, STEPS_SAVED + STEPS_MORE):
        x, y = batch(step)
        xs, ys = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        engine.backward(F.mse_loss(engine(xs.to(dtype)).float(), ys))
        engine.step()
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {
        "path": path,
        "client": client,
        "loaded_steps": loaded_steps,
        "params": params,
        "lr": engine.get_lr()[0],
    }


@pytest.fixture(scope="module")
def pool1():
    with RankPool(1) as pool:
        yield pool


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


MATRIX = [(case, world, stage) for case in CASES for world, stage in TARGETS]


@pytest.mark.parametrize(
    ("case", "world", "stage"), MATRIX, ids=[f"{c}-to-ws{w}-z{s}" for c, w, s in MATRIX]
)
def test_deepspeed_checkpoint_resumes_like_deepspeed(pool1, pool2, case, world, stage) -> None:
    pool = pool1 if world == 1 else pool2
    expected = load_file(HERE / case / "continued.safetensors")
    tolerance = 1e-2 if CASES[case]["precision"] == "bf16" else 1e-5
    for result in pool.run(continue_from, case, stage):
        assert result["loaded_steps"] == STEPS_SAVED
        assert result["path"] == str(HERE / case / f"global_step{STEPS_SAVED}")
        assert result["client"] == {}
        assert result["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert relative(result["params"][name], value) <= tolerance, (name, case)


def test_universal_checkpoint_resumes_like_deepspeed(pool1) -> None:
    expected = load_file(HERE / "universal" / "continued.safetensors")
    (result,) = pool1.run(continue_from, "universal", 3, True)
    assert result["loaded_steps"] == STEPS_SAVED
    for name, value in expected.items():
        assert relative(result["params"][name], value) <= 1e-5, name


def test_import_deepspeed_writes_a_shardspeed_checkpoint(tmp_path: Path) -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "shardspeed.checkpoint.cli", "import-deepspeed",
         str(HERE / "z3_fp32_ws2"), str(tmp_path / "converted")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    tag = tmp_path / "converted" / "global_step3"
    assert (tmp_path / "converted" / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tag.iterdir()) == [
        "index.jsonl",
        "manifest.json",
        "rank00000.safetensors",
    ]
    verify = subprocess.run(
        [sys.executable, "-m", "shardspeed.checkpoint.cli", "verify", str(tag)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ours = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "converted"))
    from shardspeed.checkpoint.deepspeed import read_deepspeed

    theirs = read_deepspeed(HERE / "z3_fp32_ws2" / "global_step3").params
    assert ours.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name


class Payload:
    """Stands for any class a pickle could name: reading it would run its code."""

    def __reduce__(self):
        return (print, ("this would have run",))


def test_a_pickle_outside_the_allowed_classes_is_refused(tmp_path: Path) -> None:
    import shutil

    from shardspeed.checkpoint.deepspeed import read_deepspeed
    from shardspeed.checkpoint.deepspeed import read_pt as read_deepspeed_file

    copy = tmp_path / "ckpt"
    shutil.copytree(HERE / "z0_fp32_ws1", copy)
    states = copy / "global_step3" / "mp_rank_00_model_states.pt"
    good = read_deepspeed_file(states)
    torch.save({**good, "extra": Payload()}, states)
    with pytest.raises(CheckpointError, match="holds an object of class print"):
        read_deepspeed(copy / "global_step3")
    # Scripts put their argparse arguments into client_state; that is a class too.
    torch.save({**good, "args": argparse.Namespace(lr=0.1)}, states)
    with pytest.raises(CheckpointError, match=r"holds an object of class argparse\.Namespace"):
        read_deepspeed(copy / "global_step3")


# -- DeepSpeed's file names and key names -----------------------------------------------------------


def test_optim_files_come_in_rank_order(tmp_path: Path) -> None:
    from shardspeed.utils.zero_to_fp32 import get_optim_files

    written = [tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(12)]
    for path in reversed(written):
        path.write_text("")
    (tmp_path / "mp_rank_00_model_states.pt").write_text("")
    # Rank 10 sorts after rank 9, not after rank 1 as the names would alphabetically.
    assert get_optim_files(tmp_path) == [str(p) for p in written]
    with pytest.raises(FileNotFoundError, match=r"_optim_states\.pt"):
        get_optim_files(tmp_path / "nowhere")


def test_deepspeed_file_names_are_the_ones_deepspeed_wrote() -> None:
    from shardspeed.checkpoint.deepspeed import (
        FP32_FLAT_GROUPS,
        OPTIMIZER_STATE_DICT,
        PARAM_SHAPES,
        ZERO_STAGE,
        read_pt,
    )
    from shardspeed.checkpoint.utils import get_model_ckpt_name_for_rank
    from shardspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files

    tag = HERE / "z2_fp32_ws2" / "global_step3"
    model_file = get_model_ckpt_name_for_rank(tag, "00")
    assert model_file == str(tag / "mp_rank_00_model_states.pt")
    assert get_model_state_files(tag) == [model_file]
    assert PARAM_SHAPES in read_pt(Path(model_file))

    tag = HERE / "z3_fp32_ws2" / "global_step3"
    ranks = get_optim_files(tag)
    assert [Path(p).name for p in ranks] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)
    ]
    optimizer = read_pt(Path(ranks[1]))[OPTIMIZER_STATE_DICT]
    assert optimizer[ZERO_STAGE] == 3 and FP32_FLAT_GROUPS in optimizer


def test_deepspeed_checkpoint_names_import_under_the_alias() -> None:
    probe = (
        "import shardspeed.compat\n"
        "shardspeed.compat.install()\n"
        "from deepspeed.checkpoint import UNIVERSAL_CHECKPOINT_INFO, get_model_ckpt_name_for_rank\n"
        "from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, ZERO_STAGE\n"
        "from deepspeed.checkpoint.utils import clone_tensors_for_torch_save\n"
        "from deepspeed.utils.zero_to_fp32 import get_model_state_files, get_optim_files\n"
        "import shardspeed.checkpoint.deepspeed as layout\n"
        "assert OPTIMIZER_STATE_DICT == layout.OPTIMIZER_STATE_DICT == 'optimizer_state_dict'\n"
        "assert get_model_ckpt_name_for_rank is layout.get_model_ckpt_name_for_rank\n"
        "assert get_optim_files is layout.get_optim_files\n"
    )
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def _load_own_copy(directories: list[str]) -> tuple[str, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    engine, *_ = shardspeed.initialize(model=model, config=config(2, "fp32", 2, 1))
    path, _ = engine.load_checkpoint(directories[torch.distributed.get_rank()])
    return Path(path).name, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_deepspeed_latest_is_read_by_rank_0_alone(pool2, tmp_path: Path) -> None:
    """Rank 1's `latest` names a tag that is not there (it moved between the ranks' reads): the
    ranks still load the one tag rank 0 found."""
    import shutil

    seen_by_0, seen_by_1 = tmp_path / "rank0_view", tmp_path / "rank1_view"
    shutil.copytree(HERE / "z1_fp32_ws2", seen_by_0)
    shutil.copytree(HERE / "z1_fp32_ws2", seen_by_1)
    (seen_by_1 / "latest").write_text("global_step99")
    (name_0, params_0), (name_1, params_1) = pool2.run(
        _load_own_copy, [str(seen_by_0), str(seen_by_1)]
    )
    assert name_0 == name_1 == f"global_step{STEPS_SAVED}"
    assert all(torch.equal(params_0[n], params_1[n]) for n in params_0)
