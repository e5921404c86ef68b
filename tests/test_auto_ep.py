"""The `expert_parallel` section (DeepSpeed's AutoEP) on real transformers MoE models built from
configs: every family trains at `autoep_size` 2 on 2 ranks to the parameters of one process
without expert parallelism, on the same global batches.

Tolerance: 1e-5 relative on the weights and the losses after 3 AdamW steps, fp32. Only summation
order differs: the experts run on other batches of rows (the rows every rank sent to each expert),
and each token's experts are added in expert order as the model's own loop adds them. Attention
key biases (Qwen2-MoE) are left out: their true gradient is zero, so AdamW amplifies rounding.
"""

from __future__ import annotations

import pytest
import torch

import shardspeed
from moe_families import FAMILIES, MICRO, build, global_batch, reference
from shardspeed.checkpoint.sixteen_bit import consolidated_state_dict

STEPS, LR = 3, 1e-2


def ep_config(autoep: int, stage: int, **section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "expert_parallel": {"enabled": True, "autoep_size": autoep, **section},
    }


def train(family: str, autoep: int, stage: int, section: dict | None = None) -> dict:
    """STEPS steps of `family` under the engine; each rank's losses and the whole weights."""
    model = build(family)
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ep_config(autoep, stage, **(section or {})),
    )
    rank, world = engine.global_rank, engine.world_size
    losses = []
    for step in range(STEPS):
        ids = global_batch(step, world)[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    local = {n: tuple(p.shape) for n, p in model.named_parameters() if "experts." in n}
    return {"losses": losses, "weights": consolidated_state_dict(engine), "local": local}


def assert_like_one_process(results: list[dict], family: str) -> None:
    expected_losses, expected = reference(family, STEPS, len(results), LR)
    # Each rank's loss is its micro-batch's mean; equal token counts make their mean the
    # global batch's.
    losses = torch.tensor([r["losses"] for r in results]).mean(0).tolist()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for name, want in expected.items():
        if name.endswith("k_proj.bias"):
            # Its true gradient is zero (softmax ignores a shift of every score of a query):
            # AdamW turns rounding noise into full-size steps, in either run.
            continue
        got = results[0]["weights"][name]
        err = ((got - want).norm() / want.norm()).item()
        assert err <= 1e-5, f"{family}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_at_ep2_zero2_equals_one_process(pool2, family):
    results = pool2.run(train, family, 2, 2)
    assert_like_one_process(results, family)
    # Each rank holds 2 of the 4 experts of every fused tensor, under the model's own names.
    for name, shape in results[0]["local"].items():
        if "shared" not in name:
            assert shape[0] == 2, (name, shape)
