"""Checkpoints: round trips at every stage and precision, resharding between world sizes and
stages, crash safety, corruption detection, and that nothing in a checkpoint is a pickle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardspeed
from reference_training import (
    SCHEDULE,
    assert_close_relative,
    batch,
    config,
    make_model,
    param_groups,
)
from shardspeed.checkpoint import CheckpointError
from shardspeed.testing import RankFailure

PRECISIONS = {"fp32": {}, "fp16": {"fp16": {"enabled": True}}, "bf16": {"bf16": {"enabled": True}}}


def session(
    keys: dict, micro: int, stop: int, save: str | None = None, load: str | None = None
) -> dict:
    """Train global batches up to `stop` (after loading `load`, if given); save at the end."""
    torch.manual_seed(1234)  # a fresh process state: anything restored must come from the file
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=param_groups(model),
        config=config(micro, scheduler=SCHEDULE, gradient_clipping=0.05, **keys),
    )
    client = None
    if load is not None:
        path, client = engine.load_checkpoint(load)
        assert path is not None
    after_load = torch.rand(2)  # the RNG: restored by a load, as it stood at the save
    rank, world = engine.global_rank, engine.dp_world_size
    gas = engine.gradient_accumulation_steps()
    dtype = next(engine.module.parameters()).dtype
    for step in range(engine.global_steps, stop):
        x, y = batch(step)
        for m in range(gas):
            start = (m * world + rank) * micro
            loss = F.mse_loss(
                engine(x[start : start + micro].to(dtype)).float(), y[start : start + micro]
            )
            engine.backward(loss)
            engine.step()
    if save is not None:
        engine.save_checkpoint(save, client_state={"stop": stop, "ids": torch.arange(3)})
    with shardspeed.zero.GatheredParameters(list(model.parameters())):
        params = [p.detach().float().clone() for p in model.parameters()]
    return {
        "params": params,
        "steps": engine.global_steps,
        "lr": engine.get_lr(),
        "scale": engine.optimizer.loss_scale,
        "client": client,
        "after_load": after_load,
        "stage": engine.optimizer.stage,
    }


def stage_keys(stage: int, precision: str) -> dict:
    zero = {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}
    return {"zero_optimization": zero, **PRECISIONS[precision]}


@pytest.mark.parametrize("precision", sorted(PRECISIONS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_round_trip_continues_bit_for_bit(pool2, tmp_path, stage, precision):
    keys = stage_keys(stage, precision)
    straight = pool2.run(session, keys, 2, 5)
    pool2.run(session, keys, 2, 2, str(tmp_path))
    resumed = pool2.run(session, keys, 2, 5, None, str(tmp_path))
    for a, b in zip(straight, resumed):
        assert b["steps"] == 5
        assert b["client"]["stop"] == 2 and b["client"]["ids"].tolist() == [0, 1, 2]
        assert b["lr"] == a["lr"] and b["scale"] == a["scale"]
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)


def test_rng_state_restored_per_rank(pool2, tmp_path):
    saved = pool2.run(session, stage_keys(2, "fp32"), 2, 2, str(tmp_path))
    del saved
    resumed = pool2.run(session, stage_keys(2, "fp32"), 2, 2, None, str(tmp_path))
    # Each rank draws from its own restored state: equal to what that rank drew after its save.
    after_save = pool2.run(_draw_after_steps, stage_keys(2, "fp32"), 2)
    for r, expected in zip(resumed, after_save):
        assert torch.equal(r["after_load"], expected)


def _draw_after_steps(keys: dict, stop: int) -> torch.Tensor:
    session(keys, 2, stop)
    return torch.rand(2)


RESHARD = [
    # (writer world, writer stage, reader world, reader stage)
    (4, 3, 2, 1),
    (4, 3, 1, 0),
    (1, 0, 4, 3),
    (2, 1, 4, 3),
    (2, 3, 4, 2),
]


@pytest.mark.parametrize(("w_world", "w_stage", "r_world", "r_stage"), RESHARD)
def test_reshard_between_world_sizes_and_stages(
    pool2, pool4, tmp_path, w_world, w_stage, r_world, r_stage
):
    pools = {2: pool2, 4: pool4}
    reference = session(stage_keys(0, "fp32"), 8, 5)

    def run(world: int, *args):
        return pools[world].run(session, *args) if world > 1 else [session(*args)]

    run(w_world, stage_keys(w_stage, "fp32"), 8 // w_world // 2 or 1, 2, str(tmp_path))
    resumed = run(
        r_world, stage_keys(r_stage, "fp32"), 8 // r_world // 2 or 1, 5, None, str(tmp_path)
    )
    for result in resumed:
        assert result["steps"] == 5
        assert_close_relative(result["params"], reference["params"], 1e-5)


def test_no_file_is_a_pickle(pool2, tmp_path):
    pool2.run(session, stage_keys(3, "bf16"), 2, 1, str(tmp_path))
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {
        ".lock",  # JSON naming the job that saves here
        "latest",
        "index.jsonl",  # what one rank of a load reads of the manifest, by offset
        "manifest.json",
        "rank00000.safetensors",
        "rank00001.safetensors",
        "zero_to_fp32.py",  # the consolidation script DeepSpeed users run (a text file)
    }
    for path in files:
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80", f"{path} starts like a pickle"
        assert not head.startswith(b"PK"), f"{path} is a zip (torch.save) archive"
    manifest = json.loads((tmp_path / "global_step1" / "manifest.json").read_text())
    assert manifest["written_by"]["zero_stage"] == 3


def test_flipped_byte_is_reported(pool2, tmp_path):
    pool2.run(session, stage_keys(2, "fp32"), 2, 1, str(tmp_path))
    shard = tmp_path / "global_step1" / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RankFailure, match=r"rank00001.safetensors: checksum mismatch"):
        pool2.run(session, stage_keys(2, "fp32"), 2, 2, None, str(tmp_path))


def test_truncated_file_is_reported(tmp_path):
    session(stage_keys(0, "fp32"), 8, 1, str(tmp_path))
    shard = tmp_path / "global_step1" / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(
        CheckpointError, match=r"rank00000.safetensors: .* bytes, the manifest says"
    ):
        session(stage_keys(0, "fp32"), 8, 2, None, str(tmp_path))


def test_failed_save_on_one_rank_fails_everywhere_and_keeps_latest(pool2, tmp_path):
    pool2.run(session, stage_keys(2, "fp32"), 2, 1, str(tmp_path))
    # Rank 0 writes client_state and fails on it; rank 1 wrote its file fine and fails too.
    with pytest.raises(RankFailure, match=r"failed on ranks \[0, 1\]") as failure:
        pool2.run(_save_with_bad_client_state, str(tmp_path))
    assert (
        str(failure.value).count(
            "rank 0: CheckpointError: client_state['bad'] is a object: checkpoints hold JSON"
        )
        == 2
    )
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step1",
        "latest",
        "zero_to_fp32.py",
    ]


def _save_with_bad_client_state(save_dir: str) -> None:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config=config(2, **stage_keys(2, "fp32")))
    engine.load_checkpoint(save_dir, load_optimizer_states=False)
    bad = {"bad": object()} if engine.global_rank == 0 else {}
    engine.save_checkpoint(save_dir, tag="broken", client_state=bad)


def test_missing_latest_loads_nothing(tmp_path):
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config=config(8))
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)


def test_strict_load_names_mismatched_parameters(tmp_path):
    session(stage_keys(0, "fp32"), 8, 1, str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    engine, *_ = shardspeed.initialize(model=model, config=config(8))
    with pytest.raises(CheckpointError, match="does not match the model"):
        engine.load_checkpoint(str(tmp_path))


def test_manifest_lists_every_tensor_with_its_pieces(tmp_path):
    session(stage_keys(0, "fp32"), 8, 1, str(tmp_path))
    manifest = json.loads(Path(tmp_path, "global_step1", "manifest.json").read_text())
    names = set(manifest["tensors"])
    model = make_model()
    for name, p in model.named_parameters():
        assert f"param/{name}" in names
        assert f"optim/exp_avg/{name}" in names and f"optim/exp_avg_sq/{name}" in names
        entry = manifest["tensors"][f"param/{name}"]
        assert entry["shape"] == list(p.shape)
        assert sum(piece[3] for piece in entry["pieces"]) == p.numel()


def save_with_rank_tags(save_dir: str, mode: str) -> str:
    model = make_model()
    engine, *_ = shardspeed.initialize(
        model=model, config=config(4, checkpoint={"tag_validation": mode})
    )
    try:
        engine.save_checkpoint(save_dir, tag=f"tag{engine.global_rank}")
    except CheckpointError as err:
        return str(err)
    return "saved"


def test_tag_validation_fail_refuses_different_tags(pool2, tmp_path):
    for message in pool2.run(save_with_rank_tags, str(tmp_path), "Fail"):
        assert "checkpoint tags differ between ranks: ['tag0', 'tag1']" in message
    assert not (tmp_path / "latest").exists()
    # Otherwise every rank writes under rank 0's tag (DeepSpeed would write two broken halves).
    assert pool2.run(save_with_rank_tags, str(tmp_path), "ignore") == ["saved", "saved"]
    assert (tmp_path / "latest").read_text() == "tag0"


def load_module_only(load_dir: str) -> dict:
    model = make_model()
    engine, *_ = shardspeed.initialize(model=model, config=config(8))
    engine.load_checkpoint(load_dir, load_module_only=True)
    return {
        "steps": engine.global_steps,
        "optimizer_state": len(engine.optimizer.state),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def test_load_module_only_leaves_optimizer_and_counters(tmp_path):
    trained = session(stage_keys(0, "fp32"), 8, 2, str(tmp_path))
    result = load_module_only(str(tmp_path))
    assert result["steps"] == 0 and result["optimizer_state"] == 0
    for a, b in zip(result["params"], trained["params"]):
        assert torch.equal(a, b)


def session_in_small_files(*args) -> dict:
    """`session`, with each rank's checkpoint split into files of about 4 KiB."""
    from shardspeed.checkpoint import engine_state

    defaults = engine_state._RankFiles.__init__.__defaults__
    engine_state._RankFiles.__init__.__defaults__ = (4096,)
    try:
        return session(*args)
    finally:
        engine_state._RankFiles.__init__.__defaults__ = defaults


def test_a_rank_writes_several_files_when_its_part_is_large(pool2, tmp_path):
    keys = stage_keys(3, "fp32")
    straight = pool2.run(session, keys, 2, 4)
    pool2.run(session_in_small_files, keys, 2, 2, str(tmp_path))
    names = {p.name for p in (tmp_path / "global_step2").iterdir()}
    assert {"rank00000.safetensors", "rank00000-1.safetensors", "rank00001-1.safetensors"} <= names
    from shardspeed.checkpoint.cli import main as ckpt_cli

    assert ckpt_cli(["verify", str(tmp_path)]) == 0
    resumed = pool2.run(session, keys, 2, 4, None, str(tmp_path))
    for a, b in zip(straight, resumed):
        for x, y in zip(a["params"], b["params"]):
            assert torch.equal(x, y)
