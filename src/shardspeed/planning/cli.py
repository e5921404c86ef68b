"""`shardspeed plan MODEL CONFIG --nodes N --gpus-per-node G [--gpu KIND] [--rank R] [--json]`."""

from __future__ import annotations

import argparse
import json
import sys

from ..autotuning.planner import format_bytes
from ..autotuning.systems import GPUS, SYSTEMS, Cluster
from .dry_run import DryRun, dry_run
from .models import PRESETS


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="shardspeed plan",
        description="Run initialize and a training step as chosen ranks of a cluster on torch's "
        "fake process group with meta tensors; report memory per rank, collectives and step time.",
    )
    parser.add_argument(
        "model", help=f"a config.json (or its directory), or one of {', '.join(PRESETS)}"
    )
    parser.add_argument("config", help="the DeepSpeed config (JSON file)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True)
    parser.add_argument("--gpu", default="H100-SXM", choices=sorted(GPUS))
    parser.add_argument("--system", choices=sorted(SYSTEMS), help="whose link bandwidths to use "
                        "(default: the usual system of --gpu)")  # fmt: skip
    parser.add_argument("--link", action="append", default=[], metavar="NAME=VALUE",
                        help="override one of the system's figures (bytes/s or seconds), e.g. "
                        "inter_node_bw=25e9")  # fmt: skip
    parser.add_argument("--rank", type=int, action="append", help="rank to run (repeat for more; "
                        "default 0)")  # fmt: skip
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="switch on the model's gradient checkpointing, as a script would")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _overrides(items: list[str]) -> tuple[tuple[str, float], ...]:
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        try:
            pairs.append((name, float(value)))
        except ValueError:
            sep = ""
        if not sep:
            raise SystemExit(f"--link {item!r}: write NAME=NUMBER, e.g. inter_node_bw=25e9")
    return tuple(pairs)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu, args.system,
                          _overrides(args.link))  # fmt: skip
    except ValueError as error:
        raise SystemExit(f"shardspeed plan: {error}") from None
    result = dry_run(
        args.model,
        args.config,
        cluster,
        ranks=args.rank or [0],
        seq_len=args.seq_len,
        activation_checkpointing=args.activation_checkpointing,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(report(result))
    return 1 if result.over_memory() else 0


def report(result: DryRun) -> str:
    """The plan as text: the layout, then per rank its memory, collectives and step time."""
    cluster, layout = result.cluster, result.layout
    lines = [
        f"{cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu} ({cluster.world_size} ranks), "
        f"{result.parameters / 1e9:.2f}B parameters",
        "layout: " + ", ".join(f"{key} {value}" for key, value in layout.items()),
    ]
    limit = cluster.gpu_kind.memory_bytes
    for plan in result.ranks:
        lines.append(f"rank {plan.rank} {plan.coordinates}")
        for kind, where in plan.memory.items():
            places = ", ".join(f"{place} {format_bytes(n)}" for place, n in where.items() if n)
            lines.append(f"  {kind:17} {format_bytes(sum(where.values())):>11}  {places}")
        device = plan.bytes_at("device")
        verdict = "fits" if device <= limit else f"OVER by {format_bytes(device - limit)}"
        lines.append(f"  device total {format_bytes(device)} of {format_bytes(limit)}: {verdict}")
        lines.append("  collectives per step:")
        for c in plan.collectives:
            lines.append(
                f"    {c.kind:15} group {c.group_size:5} {c.link:10} {c.count:7} calls "
                f"{format_bytes(c.bytes):>11}"
            )
        t = result.step_time(plan)
        parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.as_dict().items())
        lines.append(f"  step time: {parts}")
    worst = max(result.step_time(plan).total for plan in result.ranks)
    lines.append(f"tokens/s (whole job): {result.tokens_per_step / worst:,.0f}")
    for rank, over in result.over_memory():
        lines.append(
            f"rank {rank} does not fit: {format_bytes(over)} over the {cluster.gpu}'s memory"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
