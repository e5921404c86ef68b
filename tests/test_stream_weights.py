"""`engine.stream_weights`: the current weights, whole, a bucket at a time, for a trainer that
pushes them to a generator after each step. On 2 gloo ranks: after training, the streamed
tensors equal the consolidated state dict exactly at ZeRO 2 and 3 and with tensor parallelism; at
ZeRO 3 the extra memory gathered while streaming stays within the largest item, and each item
within the bucket unless one gather unit alone is larger; a dtype casts.
"""

from __future__ import annotations

import torch

import shardspeed
import tp_model as tm
from test_zero3_units import Stack

LEAF_BYTES = 8 * 8 * 4 + 8 * 4  # one block of Stack: weight and bias, fp32


def _trained_stack(stage: int) -> shardspeed.runtime.engine.ShardSpeedEngine:
    model = Stack()
    engine, *_ = shardspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        },
    )
    for step in range(2):
        ids = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(ids).float().pow(2).mean())
        engine.step()
    return engine


def _streamed(stage: int, bucket_bytes: int | None) -> dict:
    engine = _trained_stack(stage)
    whole = engine.consolidated_state_dict()
    sharded = engine.optimizer.sharded_params
    baseline = sharded.live_elements() if sharded is not None else 0
    if sharded is not None:
        sharded.peak_live_elements = baseline
    items, equal = [], True
    for item in engine.stream_weights(bucket_bytes):
        items.append(sum(t.numel() * t.element_size() for _, t in item))
        equal &= all(torch.equal(t, whole[name]) for name, t in item)
    names = [n for item in engine.stream_weights(None, torch.bfloat16) for n, _ in item]
    casts = {t.dtype for item in engine.stream_weights(None, torch.bfloat16) for _, t in item}
    return {
        "equal": equal,
        "names": sorted(names) == sorted(n for n, _ in engine.module.named_parameters()),
        "casts": casts == {torch.bfloat16},
        "items": items,
        "extra_peak_bytes": (sharded.peak_live_elements - baseline) * 4 if sharded else None,
    }


def test_streamed_weights_equal_the_consolidated_state_dict(pool2) -> None:
    for stage in (2, 3):
        for run in pool2.run(_streamed, stage, None):
            assert run["equal"] and run["names"] and run["casts"], (stage, run)
    # ZeRO 3 gathers Stack by unit: the four blocks (288 bytes each), then the root's embedding
    # and head together (1088). One unit per item without a bucket; two blocks per item with a
    # bucket of two; the root's unit, larger than the bucket, alone. The memory gathered while
    # streaming beyond what was whole before never exceeds the largest item.
    for bucket, sizes in ((None, [288] * 4 + [1088]), (2 * LEAF_BYTES, [576, 576, 1088])):
        for run in pool2.run(_streamed, 3, bucket):
            assert run["equal"] and run["names"], run
            assert run["items"] == sizes, (bucket, run)
            assert run["extra_peak_bytes"] == 1088, run


def _tensor_parallel_stream() -> bool:
    model = tm.GPT()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    autotp = {"autotp_size": 2, "partition_config": {"layer_specs": tm.LAYER_SPECS}}
    engine, *_ = shardspeed.initialize(model=model, config=tm.config(1, tensor_parallel=autotp))
    streamed = {n: t for item in engine.stream_weights(1 << 16) for n, t in item}
    return streamed.keys() == whole.keys() and all(
        torch.equal(streamed[n], whole[n]) for n in whole
    )


def test_streamed_weights_join_tensor_parallel_pieces(pool2) -> None:
    assert pool2.run(_tensor_parallel_stream) == [True, True]


def _gather_replaced_layer_params() -> list[bool]:
    """DeepSpeed's GatherReplacedLayerParams over automatic tensor parallelism's split layers:
    whole inside, each rank's piece again after, a change made inside kept, the piece's storage
    (a view into the engine's flat buffer) the same."""
    from shardspeed.compat.deepspeed.module_inject.layers import GatherReplacedLayerParams

    model = tm.GPT()
    whole = {n: p.detach().clone() for n, p in model.named_parameters()}
    autotp = {"autotp_size": 2, "partition_config": {"layer_specs": tm.LAYER_SPECS}}
    engine, *_ = shardspeed.initialize(model=model, config=tm.config(1, tensor_parallel=autotp))
    split = {
        n: p for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)
    }
    storage = {n: p.data_ptr() for n, p in split.items()}
    with GatherReplacedLayerParams(list(model.parameters()), model):
        inside = all(torch.equal(p, whole[n]) for n, p in split.items())
        for p in split.values():
            p.data.add_(1.0)
    streamed = {n: t for item in engine.stream_weights() for n, t in item}
    return [
        bool(split),
        inside,
        all(p.data_ptr() == storage[n] for n, p in split.items()),
        all(torch.equal(streamed[n], whole[n] + 1.0) for n in split),
    ]


def test_gather_replaced_layer_params(pool2) -> None:
    assert pool2.run(_gather_replaced_layer_params) == [[True] * 4] * 2
