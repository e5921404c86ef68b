"""The engine composed of parts: observers called at fixed points, components that add DeepSpeed's
pipeline and hybrid calls, `isinstance` views for DeepSpeed's engine class names, the generated
accessors, and no import cycle between the runtime, pipe and inference rooms."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import shardspeed
from shardspeed.common.observer import EngineComponent
from shardspeed.inference.hybrid import DeepSpeedHybridEngine, HybridEngine
from shardspeed.pipe import LayerSpec, PipelineEngine, PipelineError, PipelineModule
from shardspeed.runtime.engine import ShardSpeedEngine

CONFIG = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
SRC = Path(shardspeed.__file__).parent


class Recorder(EngineComponent):
    """A component that records the hook points it is called at and adds `recorded` to the
    engine; it replaces the engine's `save_16bit_model`."""

    surface = ("recorded",)

    def __init__(self, engine: ShardSpeedEngine) -> None:
        self.recorded: list[str] = []

    def after_backward(self, engine: ShardSpeedEngine, loss: torch.Tensor) -> None:
        self.recorded.append("after_backward")

    def after_step(self, engine: ShardSpeedEngine) -> None:
        self.recorded.append(f"after_step {engine.global_steps}")

    def after_load(self, engine: ShardSpeedEngine) -> None:
        self.recorded.append("after_load")

    def refusal(self, call: str) -> Exception | None:
        return RuntimeError("recorded engines do not save") if call == "save_16bit_model" else None


def _engine(config: dict) -> ShardSpeedEngine:
    engine, *_ = shardspeed.initialize(model=nn.Linear(4, 4), config=config)
    return engine


def test_components_observe_fixed_points_and_answer_on_the_engine(tmp_path: Path) -> None:
    base, *_ = shardspeed.initialize(
        model=nn.Linear(4, 4), config={**CONFIG, "gradient_accumulation_steps": 2}
    )
    engine = ShardSpeedEngine(
        nn.Linear(4, 4), base.run_config, base.topology, components=[Recorder]
    )
    for _ in range(4):
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    engine.load_checkpoint(str(tmp_path), tag="t")
    assert engine.recorded == [
        "after_backward",
        "after_backward",
        "after_step 1",
        "after_backward",
        "after_backward",
        "after_step 2",
        "after_load",
    ]
    with pytest.raises(RuntimeError, match="do not save"):
        engine.save_16bit_model(str(tmp_path))
    engine.destroy()


def test_accessors_read_the_config_topology_and_optimizer() -> None:
    engine = _engine({**CONFIG, "gradient_clipping": 0.5})
    assert engine.train_batch_size() == 2 and engine.train_micro_batch_size_per_gpu() == 2
    assert engine.gradient_accumulation_steps() == 1 and engine.gradient_clipping() == 0.5
    assert engine.zero_optimization_stage() == 0 and not engine.fp16_enabled()
    assert not engine.bfloat16_enabled() and not engine.zero_gather_16bit_weights_on_model_save()
    assert (engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 1, 1)
    assert engine.mp_world_size == 1 and engine.local_rank == 0 and engine.loss_scale == 1.0
    assert engine.get_lr() == [0.1] and engine.get_mom() == [0]
    assert ShardSpeedEngine.train_batch_size.__doc__ == (
        "DeepSpeed's `train_batch_size`: `run_config.train_batch_size`."
    )
    frozen = _engine({"train_batch_size": 2})  # no optimizer: what needs one answers its default
    assert frozen.loss_scale == 1.0 and frozen.get_global_grad_norm() is None
    assert frozen.get_lr() is None and frozen.memory_breakdown()["parameters"] == 80


def test_deepspeed_class_names_are_views_of_the_engine() -> None:
    plain = _engine(CONFIG)
    hybrid = _engine({**CONFIG, "hybrid_engine": {"enabled": True}})
    pipelined, *_ = shardspeed.initialize(
        model=PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, loss_fn=nn.MSELoss()),
        config=CONFIG,
    )
    assert isinstance(hybrid, HybridEngine) and isinstance(hybrid, DeepSpeedHybridEngine)
    assert isinstance(pipelined, PipelineEngine) and not isinstance(pipelined, HybridEngine)
    assert not isinstance(plain, PipelineEngine) and not isinstance(plain, HybridEngine)
    assert all(isinstance(e, shardspeed.DeepSpeedEngine) for e in (plain, hybrid, pipelined))
    assert pipelined.is_first_stage() and pipelined.is_last_stage() and pipelined.stage_id == 0
    with pytest.raises(PipelineError, match="train_batch"):
        pipelined.step()
    data = iter([(torch.ones(2, 4), torch.zeros(2, 4))])
    assert pipelined.train_batch(data).item() > 0 and pipelined.global_steps == 1
    assert hybrid.generation_stats["copies_built"] == 0
    with pytest.raises(TypeError, match="initialize"):
        PipelineEngine()


def test_deepspeed_engine_paths_under_the_alias() -> None:
    script = (
        "import shardspeed.compat\n"
        "shardspeed.compat.install()\n"
        "from deepspeed.runtime.engine import DeepSpeedEngine\n"
        "from deepspeed.runtime.pipe.engine import PipelineEngine\n"
        "from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine\n"
        "import shardspeed.inference.hybrid as h, shardspeed.pipe.engine as p\n"
        "assert DeepSpeedHybridEngine is h.HybridEngine and PipelineEngine is p.PipelineEngine\n"
        "assert DeepSpeedEngine is shardspeed.runtime.engine.ShardSpeedEngine\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _room_imports(room: str) -> set[str]:
    """The rooms that `room`'s modules import, in-function imports included."""
    found = set()
    for path in (SRC / room).rglob("*.py"):
        package = ["shardspeed", *path.relative_to(SRC).parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                names = [".".join([*base, *([node.module] if node.module else [])])]
                names += [f"{names[0]}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found |= {n.split(".")[1] for n in names if n.startswith("shardspeed.")}
    return found - {room}


def test_runtime_pipe_and_inference_form_no_import_cycle() -> None:
    rooms = ("runtime", "pipe", "inference")
    edges = {room: _room_imports(room) & set(rooms) for room in rooms}
    assert "runtime" not in edges["pipe"] and "runtime" not in edges["inference"], edges
    assert not ("pipe" in edges["inference"] and "inference" in edges["pipe"]), edges
