"""Hugging Face MoE models with DeepSpeed's `expert_parallel` section (AutoEP): a Qwen3-MoE-like
model of 16 experts on 2 and 4 CPU ranks. shardspeed's expert parallelism (EP 2 and EP 4, ZeRO 2)
against ZeRO 3 without expert parallelism (what DeepSpeed users do today, the MoE block a ZeRO-3
leaf module) and against DeepSpeed 0.19.8's AutoEP: tokens/s, expert bytes per rank, all-to-all
bytes per step against the formula, losses. Then the balancing options on routers pulled towards
2 of the 16 experts (both on rank 0): the busiest expert's load and the busiest rank's computed
rows over the mean, without options, with `load_balance_coeff`, with `hot_expert_replicas` and
with `rebalance_interval`;
and EP 4 folded with AutoTP 2 on 4 ranks.

    .venv/bin/python benchmarks/bench_moe_hf.py [--quick] [--write]
    DS_ACCELERATOR=cpu /work/dsvenv/bin/python benchmarks/bench_moe_hf.py --modes \\
        deepspeed_ep2_ws2 deepspeed_ep4_ws4 --merge /tmp/shardspeed-bench/moe_hf.json --write
      (DeepSpeed's rows, in a venv with deepspeed==0.19.8 and transformers==5.15.1)
"""

from __future__ import annotations

import harness as h
import render

EXPERTS, TOP_K, HIDDEN, FFN, LAYERS, SEQ = 16, 2, 256, 256, 4, 256
# mode -> (library, expert-parallel size (0: none), ZeRO stage, options); world size in SCENARIO.
# Options: "skew" (routers pulled towards experts 0 and 1), "section" (more expert_parallel
# keys), "autotp" (tensor_parallel.autotp_size).
MODES = {
    "ours_ep2_ws2": ("ours", 2, 2, {}),
    "ours_z3_ws2": ("ours", 0, 3, {}),
    "deepspeed_ep2_ws2": ("deepspeed", 2, 2, {}),
    "deepspeed_z3_ws2": ("deepspeed", 0, 3, {}),
    "ours_ep4_ws4": ("ours", 4, 2, {}),
    "ours_ep2_ws4": ("ours", 2, 2, {}),
    "ours_z3_ws4": ("ours", 0, 3, {}),
    "deepspeed_ep4_ws4": ("deepspeed", 4, 2, {}),
    "ours_ep4_tp2_ws4": ("ours", 4, 2, {"autotp": 2}),
    "ours_ep2_skew_ws2": ("ours", 2, 2, {"skew": True}),
    "ours_ep2_skew_bias_ws2": (
        "ours",
        2,
        2,
        {"skew": True, "section": {"load_balance_coeff": 0.05}},
    ),
    "ours_ep2_skew_hot_ws2": ("ours", 2, 2, {"skew": True, "section": {"hot_expert_replicas": 2}}),
    "ours_ep2_skew_move_ws2": ("ours", 2, 2, {"skew": True, "section": {"rebalance_interval": 2}}),
}
BALANCE_MODES = (
    "ours_ep2_skew_ws2",
    "ours_ep2_skew_bias_ws2",
    "ours_ep2_skew_hot_ws2",
    "ours_ep2_skew_move_ws2",
)
SCENARIO = h.Scenario(
    name="moe_hf",
    section="## Hugging Face MoE models: the expert_parallel section (AutoEP)",
    modes={m: int(m[-1]) for m in MODES},
    warmup=2,
    steps=6,
    rounds=2,
    micro_batch=2,
    quick={"warmup": 1, "steps": 1, "rounds": 1},
    comparisons=[
        ("ours_ep2_ws2", "deepspeed_ep2_ws2", 1.0, "EP 2 vs DeepSpeed AutoEP 2 (2 ranks)"),
        ("ours_ep4_ws4", "deepspeed_ep4_ws4", 1.0, "EP 4 vs DeepSpeed AutoEP 4 (4 ranks)"),
        ("ours_ep2_ws2", "ours_z3_ws2", 1.3, "EP 2 vs ZeRO 3 without EP (2 ranks)"),
        ("ours_ep4_ws4", "ours_z3_ws4", 1.3, "EP 4 vs ZeRO 3 without EP (4 ranks)"),
        ("ours_ep2_ws2", "deepspeed_z3_ws2", None, "EP 2 vs DeepSpeed ZeRO 3, leaf modules"),
        ("ours_ep4_tp2_ws4", "ours_ep4_ws4", None, "EP 4 with AutoTP 2 vs EP 4 alone (4 ranks)"),
        ("ours_ep2_skew_hot_ws2", "ours_ep2_skew_ws2", None, "hot-expert copies vs none, skewed"),
        ("ours_ep2_skew_move_ws2", "ours_ep2_skew_ws2", None, "moving experts vs none, skewed"),
    ],
    timeout=900,
)


def model():
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=h.VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=SEQ,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=FFN,
        intermediate_size=4 * FFN, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(h.MODEL_SEED)
    built = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, p in built.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.02)
    return built


def skew(net, batch) -> None:
    """Pull every router towards experts 0 and 1: their rows get a large part along the mean
    input the router sees (what every token has most of)."""
    import torch

    seen = []
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
        for layer in net.model.layers
    ]
    with torch.no_grad():
        net(input_ids=batch)
        for hook in hooks:
            hook.remove()
        for layer, inputs in zip(net.model.layers, seen):
            direction = inputs.reshape(-1, inputs.shape[-1]).mean(0)
            layer.mlp.gate.weight[:2] += 3 * direction / direction.norm()


def worker(mode: str, args) -> dict:
    rank, world = h.setup(args.threads)
    lib, ep, stage, options = MODES[mode]
    net = model()
    if options.get("skew"):
        skew(net, h.random_batches(0, 1, args.micro_batch, SEQ)[0][0])
    cfg = h.config(args.micro_batch, stage)
    if options.get("autotp"):
        cfg["tensor_parallel"] = {"autotp_size": options["autotp"]}
    if ep:
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe"}
        cfg["expert_parallel"].update(options.get("section", {}))
    else:
        leaf = h.library(lib).utils.set_z3_leaf_modules
        leaf(net, [type(net.model.layers[0].mlp)])  # one gather per MoE block, as users set it
    total_expert_bytes = sum(p.numel() * 4 for n, p in net.named_parameters() if ".experts." in n)
    forward, backward, update, engine = h.trainer(lib, net, cfg)
    # Tensor-parallel peers take the same batches.
    replica = rank // options.get("autotp", 1)
    batches = h.random_batches(replica, args.warmup + args.steps, args.micro_batch, SEQ)

    def step(x, y):
        loss = forward(input_ids=x, labels=y).loss
        backward(loss)
        update()
        return loss.detach()

    counted = lib == "ours"
    if counted:
        from shardspeed import comm

        comm.reset_comm_volume()
    replicas = world // options.get("autotp", 1)
    result = h.timed(step, batches, args.warmup, args.steps, replicas * args.micro_batch * SEQ)
    if mode in BALANCE_MODES:  # the last step's routing, every block
        load = engine.expert_load(over_data_parallel=True)
        result["expert_imbalance"] = max(float(b["imbalance"]) for b in load.values())
        result["rows_computed"] = sum(int(b["rows_computed"]) for b in load.values())
    # Held per rank at rest: 1/EP of the experts, or under ZeRO 3 a 1/world shard of them.
    result["expert_bytes"] = total_expert_bytes / (ep or world)
    volume = comm.comm_volume() if counted else {}
    a2a = volume.get("all_to_all", {"bytes": 0, "calls": 0})
    steps = args.warmup + args.steps
    result["all_to_all_bytes_per_step"] = a2a["bytes"] / steps
    result["all_to_all_calls_per_step"] = a2a["calls"] / steps
    return result | {"micro": args.micro_batch}


def formula_bytes(micro: int) -> float:
    """All-to-all payload per rank and step: rows out and back in forward, the same in backward
    (4 x T x k x H x 4 bytes, about (ep-1)/ep of it crossing ranks; the payload counts all), plus
    the counts (E int64) per block forward (and recomputed nowhere). Rank 0's count is what it
    receives: more than the formula when routing favours its experts (the skewed modes)."""
    tokens = micro * SEQ
    return LAYERS * (4 * tokens * TOP_K * HIDDEN * 4 + EXPERTS * 8)


def cost_table(results: dict) -> str:
    rows = []
    for mode, (lib, ep, stage, _) in MODES.items():
        runs = render.runs(results, mode)
        if not runs:
            reason = render.failure(results, mode) if mode in results.get("failed", {}) else ""
            rows.append([mode, lib, str(ep or "-"), str(stage), "-", "-", "-", "-", reason])
            continue
        first = runs[0]
        tps = h.median(run["tokens_per_s"] for run in runs)
        a2a = first["ranks"][0]["all_to_all_bytes_per_step"]
        # Tensor-parallel peers each send their share of the rows.
        autotp = MODES[mode][3].get("autotp", 1)
        expected = formula_bytes(first["micro"]) / autotp if ep and lib == "ours" else None
        rows.append(
            [
                mode,
                lib,
                str(ep or "-"),
                str(stage),
                f"{tps:.0f}",
                render.fmt(first["ranks"][0]["expert_bytes"] / render.MIB, ".2f"),
                render.fmt(a2a / render.MIB, ".2f") if lib == "ours" else "-",
                render.fmt(expected / render.MIB, ".2f") if expected else "-",
                f"{first['last_loss']:.4f}",
            ]
        )
    header = (
        "mode | library | EP | ZeRO | tokens/s | expert MiB on rank 0 | all-to-all MiB / step | "
        "formula MiB / step | last loss"
    )
    return render.table(header, rows, "lllrrrrrr")


def balance_table(results: dict) -> str:
    rows = []
    for mode in BALANCE_MODES:
        runs = render.runs(results, mode)
        if not runs:
            rows.append([mode, "-", "-", "-"])
            continue
        ranks = runs[0]["ranks"]
        computed = [r["rows_computed"] for r in ranks]
        rows.append(
            [
                mode,
                f"{h.median(run['tokens_per_s'] for run in runs):.0f}",
                f"{ranks[0]['expert_imbalance']:.2f}",
                f"{max(computed) / (sum(computed) / len(computed)):.2f}",
            ]
        )
    header = "mode | tokens/s | busiest expert's load / mean | busiest rank's rows / mean"
    return render.table(header, rows, "lrrr")


def tables(results: dict) -> dict:
    return {
        "ratios": render.ratio_table(results, SCENARIO.comparisons),
        "cost": cost_table(results),
        "balance": balance_table(results),
        "run": render.run_line(results),
    }


if __name__ == "__main__":
    h.main(SCENARIO, worker, tables, "bench_moe_hf.py")
