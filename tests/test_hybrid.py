"""The hybrid engine (`hybrid_engine.enabled`): at ZeRO-3 on 2 ranks it generates exactly what the
unsharded model of the same weights generates (greedy), between training steps, and training then
goes on to exactly the parameters of a run that never generated; with inference tensor parallelism
2 as well."""

from __future__ import annotations

import pytest
import torch

import hybrid_model as hm


def _same_training(with_gen: list[dict], without: list[dict]) -> None:
    for a, b in zip(with_gen, without):
        assert a["params"].keys() == b["params"].keys()
        for name in a["params"]:
            assert torch.equal(a["params"][name], b["params"][name]), name


@pytest.mark.parametrize(
    ("kind", "inference_tp"),
    [("gpt", 1), ("gpt2", 1), ("gpt2", 2)],
    ids=["gpt", "hf-gpt2", "hf-gpt2-tp2"],
)
def test_zero3_generates_like_the_unsharded_model_and_trains_on(pool2, kind, inference_tp):
    results = pool2.run(hm.train, True, 3, inference_tp, kind)
    for result in results:
        assert len(result["generated"]) == hm.STEPS + 1
        assert result["generated"] == result["expected"]
        # One copy per weight version: the copy is rebuilt after every step, never per token.
        assert result["stats"]["copies_built"] == hm.STEPS + 1
    assert results[0]["generated"] != results[1]["generated"]  # each rank its own prompts
    _same_training(results, pool2.run(hm.train, False, 3, 1, kind))


def test_without_zero3_the_model_generates_itself(pool2):
    results = pool2.run(hm.train, True, 1)
    for result in results:
        assert result["generated"] == result["expected"]
        assert result["stats"]["copies_built"] == 0
    _same_training(results, pool2.run(hm.train, False, 1))


def test_unpinned_copy_is_dropped_after_each_generation(pool2):
    results = pool2.run(hm.train, True, 3, 1, pin_parameters=False, release_inference_cache=True)
    for result in results:
        assert result["generated"] == result["expected"]
        assert result["stats"]["copies_built"] == hm.STEPS + 1
