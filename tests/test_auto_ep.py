"""The `expert_parallel` section (DeepSpeed's AutoEP) on real transformers MoE models built from
configs: every family trains at `autoep_size` 2 on 2 ranks to the parameters of one process
without expert parallelism, on the same global batches.

Tolerance: 1e-5 relative on the weights and the losses after 3 AdamW steps, fp32. Only summation
order differs: the experts run on other batches of rows (the rows every rank sent to each expert),
and each token's experts are added in expert order as the model's own loop adds them. Attention
key biases (Qwen2-MoE) are left out: their true gradient is zero, so AdamW amplifies rounding.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import shardspeed
from moe_families import FAMILIES, MICRO, SEQ, build, global_batch, reference, reference_norms
from shardspeed.checkpoint.sixteen_bit import consolidated_state_dict

STEPS, LR = 3, 1e-2


def ep_config(autoep: int, stage: int, zero: dict | None = None, **section) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, **(zero or {})},
        "gradient_clipping": 0.0,
        "expert_parallel": {"enabled": True, "autoep_size": autoep, **section},
    }


def train(
    family: str,
    autoep: int,
    stage: int,
    section: dict | None = None,
    zero: dict | None = None,
    autotp: int = 0,
    make: Callable[[str], torch.nn.Module] | None = None,
) -> dict:
    """STEPS steps of `family` under the engine; each rank's losses and the whole weights.
    `autotp`: AutoTP's size (tensor-parallel peers take the same micro-batch); `make`: the
    model's builder (default `build`)."""
    model = (make or build)(family)
    config = ep_config(autoep, stage, zero, **(section or {}))
    if autotp:
        config["tensor_parallel"] = {"autotp_size": autotp}
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank, replicas = engine.topology.dp_rank, engine.dp_world_size
    losses, norms = [], []
    for step in range(STEPS):
        ids = global_batch(step, replicas)[rank * MICRO : (rank + 1) * MICRO]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    local = {
        n: tuple(p.ds_shape if stage == 3 else p.shape)
        for n, p in model.named_parameters()
        if "experts." in n
    }
    plan = engine.optimizer.plan
    expert_shards = {plan.layout.shards[r] for r, place in enumerate(plan.region_place) if place}
    moved = [m for m in engine.experts.routed.values() if getattr(m, "slot_of", None)]
    return {
        "losses": losses,
        "norms": norms,
        "moved": any(m.slot_of() is not None for m in moved),
        "weights": consolidated_state_dict(engine),
        "local": local,
        "expert_shards": sorted(expert_shards),
    }


def assert_like_one_process(
    results: list[dict],
    family: str,
    replicas: int = 0,
    weights_tol: float = 1e-5,
    make: Callable[[str], torch.nn.Module] | None = None,
) -> None:
    """`replicas`: the data-parallel size, when not every rank takes its own micro-batch."""
    replicas = replicas or len(results)
    expected_losses, expected = reference(family, STEPS, replicas, LR, make)
    # Each rank's loss is its micro-batch's mean; equal token counts make their mean the
    # global batch's.
    losses = torch.tensor([r["losses"] for r in results]).mean(0).tolist()
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    # The gradient norm too: AdamW's weights would hide a gradient scaled wrongly.
    expected_norms = reference_norms(family, STEPS, replicas, LR, make)
    for result in results:
        assert result["norms"] == pytest.approx(expected_norms, rel=1e-5)
    for name, want in expected.items():
        if name.endswith("k_proj.bias"):
            # Its true gradient is zero (softmax ignores a shift of every score of a query):
            # AdamW turns rounding noise into full-size steps, in either run.
            continue
        got = results[0]["weights"][name]
        err = ((got - want).norm() / want.norm()).item()
        assert err <= weights_tol, f"{family}: {name} relative error {err:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_at_ep2_zero2_equals_one_process(pool2, family):
    results = pool2.run(train, family, 2, 2)
    assert_like_one_process(results, family)
    # Each rank holds 2 of the 4 experts of every fused tensor, under the model's own names.
    for name, shape in results[0]["local"].items():
        if "shared" not in name:
            assert shape[0] == 2, (name, shape)


# -- composition ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1])
def test_ep2_at_zero_0_and_1_equals_one_process(pool2, stage):
    assert_like_one_process(pool2.run(train, "deepseek_v3", 2, stage), "deepseek_v3")


@pytest.mark.parametrize("stage", [1, 2])
def test_ep2_by_dp2_on_4_ranks_equals_one_process(pool4, stage):
    # Expert groups {0, 1} and {2, 3}; ranks 0 and 2 hold experts 0-1 and average them.
    assert_like_one_process(pool4.run(train, "qwen2_moe", 2, stage), "qwen2_moe")


def test_ep4_holds_one_expert_per_rank(pool4):
    results = pool4.run(train, "mixtral", 4, 2)
    assert_like_one_process(results, "mixtral")
    assert {shape[0] for shape in results[0]["local"].values()} == {1}


@pytest.mark.parametrize(
    ("family", "autoep", "stage"),
    [("qwen3_moe", 2, 3), ("qwen2_moe", 4, 1)],
)
def test_ep_with_autotp2_on_4_ranks_equals_one_process(pool4, family, autoep, stage):
    """DeepSpeed's folding: attention split over tensor-parallel pairs {0, 1} and {2, 3} (data
    replicas), experts spread over runs of the data x tensor ranks ({0, 1}, {2, 3} at EP 2;
    all four at EP 4), each tensor-parallel peer dispatching half of its replica's tokens.
    Qwen3-MoE's per-head q/k norms stay whole, their gradients summed over the pair.

    Losses and gradient norms to 1e-5 as everywhere; weights to 3e-5: the row-parallel
    projections add their halves in another order too, and AdamW's normalised first steps turn
    that rounding into weight differences where a gradient is near zero (Qwen2's q/k biases:
    1.2e-5 seen)."""
    section = {"validate_folding_routing": True}  # the peers agree: the check passes
    results = pool4.run(train, family, autoep, stage, section, autotp=2)
    assert_like_one_process(results, family, replicas=2, weights_tol=3e-5)
    for name, shape in results[0]["local"].items():
        if "shared" not in name:
            assert shape[0] == 4 // autoep, (name, shape)


# -- checkpoints ----------------------------------------------------------------------------------


def train_from(
    family: str,
    autoep: int | None,
    micro: int,
    first: int,
    last: int,
    load: str | None,
    save: str | None,
    stage: int = 2,
    tag: str | None = None,
) -> dict:
    """Steps first .. last - 1 of the global batches (4 sequences each, `micro` per rank), after
    loading `load`, saving into `save` at the end; `autoep` None: no expert parallelism."""
    model = build(family)
    config = ep_config(autoep or 1, stage)
    config["train_micro_batch_size_per_gpu"] = micro
    if autoep is None:
        del config["expert_parallel"]
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if load is not None:
        engine.load_checkpoint(load, tag=tag)
    rank = engine.global_rank
    for step in range(first, last):
        ids = global_batch(step, 4 // MICRO)[rank * micro : (rank + 1) * micro]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    if save is not None:
        engine.save_checkpoint(save)
    return {"weights": consolidated_state_dict(engine), "steps": engine.global_steps}


def assert_same_weights(got: dict, want: dict, tol: float) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        if name.endswith("k_proj.bias"):
            continue
        err = ((got[name] - value).norm() / value.norm()).item()
        assert err <= tol, f"{name}: relative error {err:.2e}"


def test_a_checkpoint_at_ep2_resumes_at_ep4_and_without_ep(pool2, pool4, tmp_path):
    """Saved at EP 2 (ZeRO 2, 2 ranks) after 2 steps: resumed at EP 4 on 4 ranks at ZeRO 3 and
    on one process without expert parallelism, the third step ends where the uninterrupted run
    does (the same 4 sequences per step whatever the world: 2 x 2, 4 x 1, 1 x 4)."""
    family, saved = "qwen3_moe", str(tmp_path / "ckpt")
    uninterrupted = pool2.run(train_from, family, 2, MICRO, 0, 3, None, None)[0]["weights"]
    pool2.run(train_from, family, 2, MICRO, 0, 2, None, saved)
    at_ep4 = pool4.run(train_from, family, 4, 1, 2, 3, saved, None, 3)[0]
    assert at_ep4["steps"] == 3
    assert_same_weights(at_ep4["weights"], uninterrupted, 1e-5)
    from shardspeed.testing import RankPool

    with RankPool(1) as one:
        plain = one.run(train_from, family, None, 4, 2, 3, saved, None)[0]
    assert_same_weights(plain["weights"], uninterrupted, 1e-5)


def two_steps_at_ep2(family: str) -> tuple[torch.nn.Module, object, torch.Tensor]:
    """`family` after 2 steps at EP 2, ZeRO 2, on one batch: the model, its engine, the batch."""
    model = build(family)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ep_config(2, 2)
    )
    ids = global_batch(0, 1)
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    return model, engine, ids


def export_and_reload(family: str, directory: str) -> dict:
    """save_16bit_model at EP 2, written beside the model's config: what from_pretrained loads
    into the plain model, and the engine's logits on a batch."""
    model, engine, ids = two_steps_at_ep2(family)
    engine.save_16bit_model(directory, "model.safetensors")
    if engine.global_rank == 0:
        model.config.save_pretrained(directory)
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    return {"logits": logits}


def test_the_exported_model_loads_with_from_pretrained(pool2, tmp_path):
    from transformers import AutoModelForCausalLM

    results = pool2.run(export_and_reload, "gpt_oss", str(tmp_path))
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path)).float()
    with torch.no_grad():
        logits = plain(input_ids=global_batch(0, 1)).logits
    assert torch.allclose(logits, results[0]["logits"], rtol=1e-5, atol=1e-5)


def module_state_dict(family: str) -> dict:
    """After 2 steps at EP 2, ZeRO 2: the model's own `state_dict()` (every rank calls it, as
    accelerate's get_state_dict does), the engine's consolidated weights, and whether loading
    that whole state dict back keeps each rank's run of experts and the logits."""
    model, engine, ids = two_steps_at_ep2(family)
    state = {n: t.clone() for n, t in model.state_dict().items()}  # detached views, otherwise
    consolidated = consolidated_state_dict(engine)
    local = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
        for p in model.parameters():
            p.zero_()
        model.load_state_dict(state)
        reloaded = engine(input_ids=ids).logits
    return {
        "state": state,
        "consolidated": consolidated,
        "local_kept": all(torch.equal(p, local[n]) for n, p in model.named_parameters()),
        "logits_kept": torch.equal(logits, reloaded),
    }


def test_the_models_state_dict_holds_every_expert_and_loads_back(pool2):
    """Trainer's save_model and accelerate's get_state_dict read `model.state_dict()` at ZeRO
    0-2: it holds the experts whole under the model's names, so from_pretrained loads it."""
    results = pool2.run(module_state_dict, "qwen3_moe")
    for result in results:
        want = result["consolidated"]
        assert result["state"].keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(result["state"][name], tensor), name
        assert result["local_kept"] and result["logits_kept"]
    assert results[0]["state"]["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4


# -- refusals -------------------------------------------------------------------------------------


REFUSED = [  # (family, config changes, section keys, what the message must say)
    ("qwen3_moe", {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}, {}, "ZeRO++'s hierarchical partitioning ('zero_optimization.zero_hpz_partition_size')"),
    ("qwen3_moe", {}, {"autoep_size": 3}, "'expert_parallel.autoep_size' is 3, which does not divide the 2 data-parallel ranks"),
    ("qwen3_moe", {}, {"preset_model": "mixtral"}, "'expert_parallel.preset_model' is 'mixtral', for model types ['mixtral'], but this model's config says 'qwen3_moe'"),
    ("qwen3_moe", {}, {"score_func": "sigmoid"}, "'expert_parallel.score_func' is 'sigmoid', but the model's router uses 'softmax'"),
    ("qwen3_moe", {}, {"top_k": 1}, "'expert_parallel.top_k' is 1, but the model's router uses 2"),
    ("deepseek_v3", {}, {"routed_scaling_factor": 1.0}, "'expert_parallel.route_scale' is 1.0, but the model's router uses 2.5"),
    ("deepseek_v3", {}, {"num_expert_groups": 4, "num_limited_groups": 1}, "'expert_parallel.num_expert_groups' is 4, but the model's router uses 2"),
    ("mixtral", {}, {"route_norm": False}, "'expert_parallel.route_norm' is False, but the model's router uses True"),
    ("qwen3_moe", {}, {"router_pattern": "router"}, "'expert_parallel.router_pattern' names the router 'router', which 'model.layers.0.mlp' does not have"),
    ("qwen3_moe", {}, {"expert_w1": "w1"}, "'expert_parallel.expert_w1' is 'w1', which 'model.layers.0.mlp.experts' does not hold"),
    ("qwen3_moe", {}, {"moe_layer_pattern": r"model\.layers\.\d+"}, "'expert_parallel.moe_layer_pattern' matches 'model.layers.0', which has no 'experts' child"),
    ("qwen3_moe", {}, {"num_experts_attr": "expert_count"}, "'expert_parallel.num_experts_attr' is 'expert_count', which the model's config does not have"),
    ("qwen2_moe", {}, {"has_shared_experts": False}, "'expert_parallel.has_shared_experts' is false, but 'model.layers.0.mlp' has shared experts"),
    ("qwen3_moe", {}, {"validate_folding_routing": True}, "'expert_parallel.validate_folding_routing' checks that tensor-parallel peers route alike, and this run has no AutoTP"),
    ("qwen3_moe", {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, {"rebalance_interval": 5}, "'expert_parallel.rebalance_interval' moves experts with their optimizer states"),
    ("qwen3_moe", {}, {"hot_expert_replicas": 4}, "'expert_parallel.hot_expert_replicas' is 4; the blocks have 4 experts, so it must be below 4"),
]  # fmt: skip


def refusals() -> list[str]:
    messages = []
    for family, changes, section, _ in REFUSED:
        config = {**ep_config(2, 2, **section), **changes}
        model = build(family)
        try:
            shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        except shardspeed.ConfigError as error:
            messages.append(str(error))
        else:
            messages.append("accepted")
    return messages


def test_what_expert_parallelism_cannot_honour_is_refused_by_name(pool2):
    for (family, changes, section, expected), message in zip(REFUSED, pool2.run(refusals)[0]):
        assert expected in message, (family, changes, section, message)


def peers_with_other_tokens() -> str:
    """AutoTP 2 on 2 ranks with validate_folding_routing, each peer given other tokens."""
    model = build("qwen3_moe")
    config = {
        **ep_config(2, 2, validate_folding_routing=True),
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    ids = global_batch(0, 2)[engine.global_rank * MICRO : (engine.global_rank + 1) * MICRO]
    try:
        engine(input_ids=ids, labels=ids)
    except RuntimeError as error:
        return str(error)
    return "accepted"


def test_validate_folding_routing_catches_peers_that_route_differently(pool2):
    for message in pool2.run(peers_with_other_tokens):
        assert "'expert_parallel.validate_folding_routing': tensor-parallel peers routed" in message


def autotp_refusal(family: str) -> str:
    model = build(family)
    config = {**ep_config(2, 2), "tensor_parallel": {"autotp_size": 2}}
    try:
        shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except ValueError as error:
        return str(error)
    return "accepted"


@pytest.mark.parametrize(("family", "named"), [("olmoe", "q_norm.weight"), ("gpt_oss", "sinks")])
def test_attention_whose_weights_span_its_heads_is_refused_under_autotp(pool2, family, named):
    """OLMoE's q/k norms normalise over all heads at once, GPT-OSS's sinks hold one value per
    head: neither can run on half of the heads."""
    message = pool2.run(autotp_refusal, family)[0]
    assert named in message and "span its heads" in message, message


def test_keys_shardspeed_does_not_offer_are_refused_by_the_config():
    from shardspeed.config import load_config

    for key, value in (("expert_tensor_parallel_size", 2),):
        section = {"enabled": True, "autoep_size": 2, key: value}
        with pytest.raises(
            shardspeed.ConfigError, match=rf"'expert_parallel\.{key}' is not supported"
        ):
            load_config({"train_batch_size": 2, "expert_parallel": section}, 1)
    with pytest.raises(shardspeed.ConfigError, match=r"'expert_parallel\.combine_impl'"):
        load_config({"train_batch_size": 2, "expert_parallel": {"combine_impl": "legacy_bmm"}}, 1)


def unknown_router_with_balancing() -> str:
    model = build("qwen3_moe")
    model.config.model_type = "my_moe"  # no preset: the blocks are found from the structure
    config = ep_config(2, 2, load_balance_coeff=0.01)
    try:
        shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    except shardspeed.ConfigError as error:
        return str(error)
    return "accepted"


def test_balancing_a_router_shardspeed_cannot_bias_is_refused(pool2):
    message = pool2.run(unknown_router_with_balancing)[0]
    assert "'expert_parallel.load_balance_coeff': auxiliary-loss-free balancing is offered for" in (
        message
    )
    assert "not for my_moe's: remove the key" in message


def dense_model_with_the_section() -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                    intermediate_size=48, max_position_embeddings=64)
    )  # fmt: skip
    try:
        shardspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ep_config(2, 2)
        )
    except shardspeed.ConfigError as error:
        return str(error)
    return "accepted"


def test_a_model_without_moe_blocks_is_refused_naming_what_to_set(pool2):
    message = pool2.run(dense_model_with_the_section)[0]
    assert "'expert_parallel' is enabled, but LlamaForCausalLM has no MoE block" in message
    assert "'expert_parallel.preset_model'" in message and "moe_layer_pattern" in message


def test_ep2_with_cpu_optimizer_offload_equals_one_process(pool2):
    offload = {"offload_optimizer": {"device": "cpu"}}
    assert_like_one_process(pool2.run(train, "olmoe", 2, 2, None, offload), "olmoe")


def routing_report(family: str) -> dict:
    model = build(family)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ep_config(2, 2)
    )
    ids = global_batch(0, 2)[engine.global_rank * MICRO : (engine.global_rank + 1) * MICRO]
    engine(input_ids=ids, labels=ids)
    mine = {n: load["exp_counts"].tolist() for n, load in engine.expert_load().items()}
    summed = engine.expert_load(over_data_parallel=True)
    return {"mine": mine, "summed": {n: v["exp_counts"].tolist() for n, v in summed.items()}}


def test_expert_load_reports_each_blocks_routing(pool2):
    results = pool2.run(routing_report, "qwen3_moe")
    names = sorted(results[0]["mine"])
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for name in names:
        mine = [r["mine"][name] for r in results]
        # Every (token, choice) pair of the rank's micro-batch is counted once: tokens x top 2.
        assert all(sum(counts) == MICRO * SEQ * 2 for counts in mine)
        total = [a + b for a, b in zip(*mine)]
        assert all(r["summed"][name] == total for r in results)


def streamed_and_consolidated(family: str) -> dict:
    model = build(family)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ep_config(2, 2)
    )
    streamed = {name: t.clone() for item in engine.stream_weights() for name, t in item}
    assert len(streamed) == len(list(model.parameters()))
    return {"streamed": streamed, "whole": consolidated_state_dict(engine)}


def test_stream_weights_gives_the_experts_whole(pool2):
    for result in pool2.run(streamed_and_consolidated, "deepseek_v3"):
        assert set(result["streamed"]) <= set(result["whole"])  # parameters; buffers aside
        for name, tensor in result["streamed"].items():
            assert torch.equal(tensor, result["whole"][name]), name
        assert result["streamed"]["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 4


# -- ZeRO stage 3 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_ep2_at_zero3_equals_one_process(pool2, family):
    results = pool2.run(train, family, 2, 3)
    assert_like_one_process(results, family)


def test_ep2_by_dp2_at_zero3_partitions_experts_over_the_expert_data_group(pool4):
    # Each expert piece (2 of 4 experts) is a ZeRO-3 unit of its own, sharded over the 2 ranks
    # holding the same experts and gathered over them only.
    results = pool4.run(train, "gpt_oss", 2, 3)
    assert_like_one_process(results, "gpt_oss")
    assert all(r["expert_shards"] == [2] for r in results)
    assert {shape[0] for r in results for shape in r["local"].values()} == {2}


def router_outputs(family: str) -> dict:
    """The engine's (EP 2) and the plain model's router logits and auxiliary loss on this rank's
    micro-batch."""
    plain, model = build(family), build(family)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ep_config(2, 2)
    )
    ids = global_batch(0, 2)[engine.global_rank * MICRO : (engine.global_rank + 1) * MICRO]
    ours = engine(input_ids=ids, labels=ids, output_router_logits=True)
    theirs = plain(input_ids=ids, labels=ids, output_router_logits=True)
    return {
        # The first block's router sees the same input bit for bit; later ones see the blocks
        # before them, whose experts summed in another order (about 1e-7).
        "first": torch.equal(ours.router_logits[0], theirs.router_logits[0]),
        "logits": [
            torch.allclose(a, b, rtol=1e-5, atol=1e-6)
            for a, b in zip(ours.router_logits, theirs.router_logits)
        ],
        "aux": (ours.aux_loss.item(), theirs.aux_loss.item()),
        "loss": (ours.loss.item(), theirs.loss.item()),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_logits_and_the_auxiliary_loss_come_back_as_the_model_returns_them(pool2, family):
    for result in pool2.run(router_outputs, family):
        assert result["first"] and len(result["logits"]) == 2 and all(result["logits"])
        assert result["aux"][0] == pytest.approx(result["aux"][1], rel=1e-6)
        assert result["loss"][0] == pytest.approx(result["loss"][1], rel=1e-5)


# -- load balancing -------------------------------------------------------------------------------


def collapsed(family: str) -> torch.nn.Module:
    """`family`'s model with 8 experts whose routers all favour experts 0 and 1: their rows
    get a large part along the mean input of the router (what every token has most of)."""
    model = build(family, experts=8)
    inputs = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        ids = global_batch(0, 4)
        model(input_ids=ids)
        for hook in hooks:
            hook.remove()
        for layer, seen in zip(model.model.layers, inputs):
            router = layer.mlp.router if hasattr(layer.mlp, "router") else layer.mlp.gate
            direction = seen.reshape(-1, seen.shape[-1]).mean(0)
            router.weight[:2] += 3 * direction / direction.norm()
    return model


def balanced_training(family: str, coeff: float | None, steps: int) -> dict:
    """`steps` steps at lr 0 (the weights never move: only the routing bias does) on the
    collapsed model; every step's busiest-expert load over the mean (block 0, all ranks), and
    whether the gate values the router returns are its unbiased ones for the experts chosen."""
    model = collapsed(family)
    config = ep_config(2, 2, **({"load_balance_coeff": coeff} if coeff else {}))
    config["optimizer"]["params"]["lr"] = 0.0
    config["train_micro_batch_size_per_gpu"] = 4 * MICRO
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank, imbalance = engine.global_rank, []
    # One batch every step: without the bias the routing, and so the load, never changes.
    ids = global_batch(0, 8)[rank * 4 * MICRO : (rank + 1) * 4 * MICRO]
    for _ in range(steps):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        load = engine.expert_load(over_data_parallel=True)["model.layers.0.mlp.experts"]
        imbalance.append(float(load["imbalance"]))
    layer = model.model.layers[0].mlp
    router = layer.router if hasattr(layer, "router") else layer.gate
    hidden = torch.randn(16, 32)
    logits, weights, chosen = router(hidden)
    if family == "gpt_oss":
        unbiased = torch.softmax(logits.gather(-1, chosen), dim=-1)
    else:
        probabilities = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
        unbiased = probabilities / probabilities.sum(-1, keepdim=True)
    return {"imbalance": imbalance, "gates_unbiased": torch.allclose(weights.float(), unbiased)}


@pytest.mark.parametrize(
    ("family", "coeff", "bound"),
    # The bias adds to what the router ranks: probabilities (Qwen3-MoE) or logits (GPT-OSS),
    # whose scales differ, and so do the coefficients.
    [("qwen3_moe", 0.02, 1.5), ("gpt_oss", 0.2, 1.2)],
)
def test_the_routing_bias_evens_out_a_collapsed_router(pool2, family, coeff, bound):
    """8 experts, top 2, routers pulled towards experts 0 and 1, the same batch every step and
    the weights frozen (lr 0), so that only the bias acts: without it the busiest expert's load
    over the mean stays 2.19 (Qwen3-MoE) / 2.34 (GPT-OSS); with it, every one of the last 10 of
    30 steps is at most `bound` (measured 1.44-1.47 and 1.12-1.19). The gate values stay the
    router's unbiased ones for the experts chosen."""
    steps = 30
    plain = pool2.run(balanced_training, family, None, steps)[0]["imbalance"]
    assert max(plain) == min(plain) > 2.0
    result = pool2.run(balanced_training, family, coeff, steps)[0]
    assert result["imbalance"][0] == plain[0]
    assert max(result["imbalance"][-10:]) <= bound, result["imbalance"]
    assert result["gates_unbiased"]


def rows_per_rank(section: dict, steps: int) -> list[list[int]]:
    """`steps` steps at lr 0 on the collapsed Qwen3-MoE at EP 2 with the `section` keys; each
    step's rows this rank's experts (and hot copies) computed, per block."""
    model = collapsed("qwen3_moe")
    config = ep_config(2, 2, **section)
    config["optimizer"]["params"]["lr"] = 0.0
    config["train_micro_batch_size_per_gpu"] = 4 * MICRO
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank, rows = engine.global_rank, []
    for _ in range(steps):
        ids = global_batch(0, 8)[rank * 4 * MICRO : (rank + 1) * 4 * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        rows.append([int(load["rows_computed"]) for load in engine.expert_load().values()])
    return rows


def test_hot_expert_replicas_train_as_one_process(pool2):
    """The 2 hottest experts copied to both ranks from the second step on: the same losses,
    gradient norms and weights as one process (1e-5). (One copy: the EP 4 test below.)"""
    results = pool2.run(train, "qwen3_moe", 2, 2, {"hot_expert_replicas": 2})
    assert_like_one_process(results, "qwen3_moe")


def test_hot_expert_replicas_at_ep4_with_zero3(pool4):
    results = pool4.run(train, "gpt_oss", 4, 3, {"hot_expert_replicas": 1})
    assert_like_one_process(results, "gpt_oss")


def busiest_over_mean(results: list, step: int) -> list[float]:
    """Per block, the busiest rank's rows over the mean at `step` (`rows_per_rank`'s)."""
    per_block = zip(*(r[step] for r in results))
    return [max(rows) / (sum(rows) / len(rows)) for rows in per_block]


def test_hot_expert_replicas_lower_the_busiest_ranks_rows(pool2):
    """Routers pulled towards experts 0 and 1, both held by rank 0: without copies rank 0
    computes most rows; with the 2 hottest copied to both ranks (from the second step on,
    chosen from the first step's load), each rank computes its own tokens' rows for them: the
    busiest rank's rows over the mean fall from at least 1.3 to at most 1.1."""
    plain = pool2.run(rows_per_rank, {}, 3)
    copied = pool2.run(rows_per_rank, {"hot_expert_replicas": 2}, 3)

    assert busiest_over_mean(copied, 0) == busiest_over_mean(plain, 0)  # no copies yet
    # Measured: 1.35 / 1.38 (blocks 0 / 1) without copies at every step; 1.09 / 1.02 with them.
    assert min(busiest_over_mean(plain, 2)) >= 1.3
    assert max(busiest_over_mean(copied, 2)) <= 1.1


@pytest.mark.parametrize("stage", [2])  # stage 1's masters and states move the same way
def test_moving_experts_trains_as_one_process(pool2, stage):
    """Routers pulled towards experts 0 and 1 (both on rank 0): after every step the experts
    move between the two ranks with their weights, masters and Adam states. Losses, gradient
    norms and weights equal one process (1e-5), and the experts did move."""
    section = {"rebalance_interval": 1}
    results = pool2.run(train, "qwen3_moe", 2, stage, section, make=collapsed)
    assert all(r["moved"] for r in results)
    assert_like_one_process(results, "qwen3_moe", make=collapsed)


def test_moving_experts_with_copies_at_ep2_by_dp2(pool4):
    section = {"rebalance_interval": 2, "hot_expert_replicas": 1}
    results = pool4.run(train, "mixtral", 2, 2, section, make=collapsed)
    assert all(r["moved"] for r in results)
    assert_like_one_process(results, "mixtral", make=collapsed)


def test_moving_experts_lowers_the_busiest_ranks_rows(pool2):
    """The collapsed model's hot experts 0 and 1 start on rank 0; after the first step's move
    each rank holds one: the busiest rank's rows over the mean fall from at least 1.3 to at
    most 1.1 (measured: 1.35 / 1.38 to 1.01 / 1.04 for blocks 0 / 1)."""
    plain = pool2.run(rows_per_rank, {}, 3)
    moved = pool2.run(rows_per_rank, {"rebalance_interval": 1}, 3)
    assert busiest_over_mean(moved, 0) == busiest_over_mean(plain, 0)
    assert min(busiest_over_mean(plain, 2)) >= 1.3
    assert max(busiest_over_mean(moved, 2)) <= 1.1


def moved_then_saved(tmp: str) -> dict:
    """2 steps of the collapsed Qwen3-MoE at EP 2 moving its experts after each, then a save;
    the model's own state dict and the consolidated weights at that point."""
    model = collapsed("qwen3_moe")
    config = ep_config(2, 2, rebalance_interval=1)
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    rank = engine.global_rank
    for step in range(2):
        ids = global_batch(step, 2)[rank * MICRO : (rank + 1) * MICRO]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    moved = any(m.slot_of() is not None for m in engine.experts.routed.values())
    state = {n: t.clone() for n, t in model.state_dict().items()}
    engine.save_checkpoint(tmp)
    still = any(m.slot_of() is not None for m in engine.experts.routed.values())
    return {"moved": moved and still, "state": state, "weights": consolidated_state_dict(engine)}


def resumed_in_one_process(tmp: str) -> dict:
    model = collapsed("qwen3_moe")
    config = ep_config(1, 2)
    del config["expert_parallel"]
    config["train_micro_batch_size_per_gpu"] = 2 * MICRO
    engine, *_ = shardspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    engine.load_checkpoint(tmp)
    ids = global_batch(2, 2)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return consolidated_state_dict(engine)


def test_moved_experts_save_in_their_own_order_and_resume_without_ep(pool2, tmp_path):
    """After moves, the model's state dict and the consolidated weights hold the experts in
    their own order (equal to one process after 2 steps), the checkpoint resumes on one process
    without EP to the uninterrupted run's third step (1e-5), and the experts stay moved."""
    results = pool2.run(moved_then_saved, str(tmp_path / "ckpt"))
    _, after_two = reference("qwen3_moe", 2, 2, LR, collapsed)
    for result in results:
        assert result["moved"]
        assert_same_weights(result["weights"], after_two, 1e-5)
        for name, tensor in result["weights"].items():
            assert torch.equal(result["state"][name], tensor), name
    from shardspeed.testing import RankPool

    with RankPool(1) as one:
        resumed = one.run(resumed_in_one_process, str(tmp_path / "ckpt"))[0]
    _, after_three = reference("qwen3_moe", 3, 2, LR, collapsed)
    assert_same_weights(resumed, after_three, 1e-5)


def biased_router_at_zero(family: str) -> bool:
    """With load_balance_coeff set and no step taken (a zero bias), the engine's first block
    routes exactly as the plain model's."""
    plain, model = build(family), build(family)
    config = ep_config(2, 2, load_balance_coeff=0.01)
    shardspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    layer, plain_layer = model.model.layers[-1].mlp, plain.model.layers[-1].mlp
    name = "router" if hasattr(layer, "router") else "gate"
    hidden = torch.randn(32, 32)
    ours, theirs = getattr(layer, name)(hidden), getattr(plain_layer, name)(hidden)
    return all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v3"])
def test_a_zero_routing_bias_routes_as_the_model(pool2, family):
    assert pool2.run(biased_router_at_zero, family) == [True, True]


# -- DeepSpeed's AutoEP checkpoints ---------------------------------------------------------------

AUTOEP_FIXTURE = Path(__file__).with_name("data") / "deepspeed_autoep"


@pytest.mark.parametrize(("tag", "stage"), [("autoep_zero2", 2), ("autoep_zero3", 3)])
def test_a_deepspeed_autoep_checkpoint_resumes_at_ep2_and_without_ep(pool2, tmp_path, tag, stage):
    """DeepSpeed 0.19.8's AutoEP checkpoints of the tiny Qwen3-MoE after 2 steps at autoep_size
    2, ZeRO 2 (per-expert files) and ZeRO 3 (partition-native expert files)
    (tests/data/make_deepspeed_autoep.py): resumed for a third step at EP 2 (at the stage it was
    written at) and on one process without EP, the weights are those of one process trained 3
    steps on the same batches (1e-5 relative: DeepSpeed's run and the reference differ by
    summation order)."""
    copy = tmp_path / "ds"
    shutil.copytree(AUTOEP_FIXTURE, copy)
    _, expected = reference("qwen3_moe", 3, 2, LR)
    at_ep2 = pool2.run(train_from, "qwen3_moe", 2, MICRO, 2, 3, str(copy), None, stage, tag)[0]
    assert at_ep2["steps"] == 3
    assert_same_weights(at_ep2["weights"], expected, 1e-5)
    from shardspeed.testing import RankPool

    with RankPool(1) as one:
        plain = one.run(train_from, "qwen3_moe", None, 4, 2, 3, str(copy), None, 2, tag)[0]
    assert_same_weights(plain["weights"], expected, 1e-5)


@pytest.mark.parametrize("tag", ["autoep_zero2", "autoep_zero3"])
def test_zero_to_fp32_reads_deepspeed_autoep_checkpoints(tag):
    """DeepSpeed's own zero_to_fp32 does not handle AutoEP checkpoints; shardspeed's gives the
    plain model's state dict (fused experts under their names), equal to one process's weights
    after the same 2 steps (1e-5), and the plain model loads it strictly."""
    from shardspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(AUTOEP_FIXTURE), tag=tag)
    build("qwen3_moe").load_state_dict(state, strict=True)
    _, expected = reference("qwen3_moe", 2, 2, LR)
    assert_same_weights(state, expected, 1e-5)


# -- with Ulysses sequence parallelism ------------------------------------------------------------


def ulysses_with_experts(stage: int, autoep: int = 2) -> dict:
    """ALST's calls on a Qwen3-MoE model (register_with_transformers, initialize with its mpu,
    the tutorial's loss) with the expert_parallel section: 2 ranks split each sequence, each
    pair takes its own micro-batch (data parallelism on 4 ranks), and the experts spread over
    `autoep` of the data x sequence ranks. Each step's gradient norm and the final weights."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from shardspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, shard_batch

    model = build("qwen3_moe")
    model.train()
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, MICRO)
    try:
        engine, *_ = shardspeed.initialize(
            model=model,
            model_parameters=model.parameters(),
            config=ep_config(autoep, stage),
            mpu=mpu,
        )
        group, rank = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank()
        replica, replicas = engine.topology.dp_rank, engine.dp_world_size
        norms = []
        for step in range(STEPS):
            # The ranks of a sequence group hold the same sequences.
            ids = global_batch(step, replicas)[replica * MICRO : (replica + 1) * MICRO]
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            piece = shard_batch(
                {"input_ids": ids, "labels": ids, "position_ids": positions}, rank, 2
            )
            outputs = engine(
                input_ids=piece["input_ids"],
                position_ids=piece["position_ids"],
                labels=piece["shift_labels"],
                shift_labels=piece["shift_labels"],
            )
            # The tutorial's token-weighted mean over the sequence group. As a sum (all_reduce):
            # torch's differentiable all_gather scatters by global rank in its backward and
            # fails in a group without rank 0.
            good = (piece["shift_labels"] != -100).sum()
            total = good.clone()
            torch.distributed.all_reduce(total, group=group)
            weighted = outputs.loss * good
            loss = torch.distributed.nn.functional.all_reduce(weighted, group=group) / total
            engine.backward(loss)
            engine.step()
            norms.append(float(engine.get_global_grad_norm()))
        weights = consolidated_state_dict(engine)
    finally:
        del ALL_ATTENTION_FUNCTIONS["sdpa"]  # transformers' own again, for the pool's next test
    return {"norms": norms, "weights": weights}


@pytest.mark.parametrize(("autoep", "stage"), [(4, 3)])  # EP 2 over one pair: the 2-rank test
def test_ep_with_ulysses_sp2_by_dp2_on_4_ranks(pool4, autoep, stage):
    """Sequence pairs {0, 1} and {2, 3}, each with its own micro-batch; experts over runs of the
    data x sequence ranks (EP 2: the pairs; EP 4: all four). Weights and every step's gradient
    norm equal one process training the 2 whole micro-batches (1e-5)."""
    _, expected = reference("qwen3_moe", STEPS, 2, LR)
    results = pool4.run(ulysses_with_experts, stage, autoep)
    assert_same_weights(results[0]["weights"], expected, 1e-5)
    expected_norms = reference_norms("qwen3_moe", STEPS, 2, LR)
    for result in results:
        assert result["norms"] == pytest.approx(expected_norms, rel=1e-5)


@pytest.mark.parametrize("stage", [2, 3])
def test_ep2_with_ulysses_sp2_equals_whole_sequences_in_one_process(pool2, stage):
    """Experts spread over the two sequence ranks (which hold different tokens for the MLPs):
    the weights after 3 steps equal one process training whole sequences (1e-5 relative), and
    each step's gradient norm (1e-5)."""
    _, expected = reference("qwen3_moe", STEPS, 1, LR)
    results = pool2.run(ulysses_with_experts, stage)
    assert_same_weights(results[0]["weights"], expected, 1e-5)
    expected_norms = reference_norms("qwen3_moe", STEPS, 1, LR)
    for result in results:
        assert result["norms"] == pytest.approx(expected_norms, rel=1e-5)
