"""An unmodified DeepSpeed-tutorial-style script, run through the launcher on 2 processes.

The script says `import deepspeed`; `shardspeed --compat` makes that resolve to shardspeed for those
processes. Both ranks must train to identical weights, with the loss going down.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from shardspeed.comm import free_port

SCRIPT = textwrap.dedent(
    """
    import argparse
    import json

    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.ops.adam import FusedAdam
    from torch import nn

    parser = argparse.ArgumentParser(description="tutorial")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the launcher")
    parser.add_argument("--out", type=str, required=True)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 2))
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 10, generator=gen)
    trainset = [(x, int(x.sum() > 0)) for x in inputs]
    optimizer = FusedAdam(net.parameters(), lr=0.01)

    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, optimizer=optimizer, training_data=trainset
    )
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(3):
        for step, (xs, labels) in enumerate(trainloader):
            outputs = model_engine(xs.to(model_engine.device))
            loss = criterion(outputs, labels.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    result = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "local_rank": args.local_rank,
        "module": deepspeed.__name__,
        "steps": model_engine.global_steps,
        "first": sum(losses[:4]) / 4,
        "last": sum(losses[-4:]) / 4,
        "checksum": sum(p.double().sum().item() for p in net.parameters()),
    }
    with open(f"{args.out}/rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    """
)


def test_unmodified_tutorial_script_on_two_processes(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "steps_per_print": 4}))
    command = [
        sys.executable,
        "-m",
        "shardspeed.launcher.runner",
        "--compat",
        "--num_procs",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        "--deepspeed_config",
        str(config),
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(ranks):
        assert result["rank"] == rank and result["world"] == 2 and result["local_rank"] == rank
        assert result["module"] == "shardspeed"
        assert result["steps"] == 12  # 64 samples / (8 x 2 ranks) = 4 steps per epoch, 3 epochs
        assert result["last"] < result["first"]
    assert ranks[0]["checksum"] == ranks[1]["checksum"]
    assert "step=4, skipped=0" in done.stdout + done.stderr
