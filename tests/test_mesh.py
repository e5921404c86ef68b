"""The parallel mesh (`comm.Topology`): every group it hands out, at world sizes 1, 2 and 4.

Each case asks the live ranks for the global ranks of every group the mesh gives them and checks
them against the layout worked out here by hand: tensor-parallel ranks are neighbours, experts are
carved out of each data-parallel group (DeepSpeed's two layouts), a tied weight's group holds the
ranks at its stages, one per replica, sequence ranks are neighbours (DeepSpeed's data x sequence
mesh) and the sequence-data group holds both axes. A group asked for twice is the same group, not a new one.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardspeed.comm import Topology
from shardspeed.comm import groups as ds_groups
from shardspeed.comm.topology import PipeDataParallelTopology
from shardspeed.testing import RankPool


@pytest.fixture(scope="module")
def pool1():
    with RankPool(1) as pool:
        yield pool


def _pool(request: pytest.FixtureRequest, world: int) -> RankPool:
    return request.getfixturevalue(f"pool{world}")


def _ranks(group: object) -> list[int]:
    """A group's global ranks (None is the default group: every rank)."""
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _holding(rank_lists: list[list[int]], rank: int) -> list[int]:
    """The list that holds `rank`."""
    return next(ranks for ranks in rank_lists if rank in ranks)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- what the ranks report ------------------------------------------------------------------------


def _world_and_tensor_groups(tensor: int) -> dict:
    mesh = Topology.build(tensor_parallel=tensor)
    experts = {}
    for ep in _divisors(mesh.dp_world_size):
        for data_before_expert in (False, True):
            made = mesh.expert_groups(ep, data_before_expert)
            again = mesh.expert_groups(ep, data_before_expert)
            experts[(ep, data_before_expert)] = {
                "expert": _ranks(made.ep_group),
                "expert_data": _ranks(made.expert_data_group),
                "ranks": (made.ep_rank, made.expert_data_rank, made.expert_data_size),
                "handed_out_again": again.ep_group is made.ep_group
                and again.expert_data_group is made.expert_data_group,
            }
    runs = {}
    for size in _divisors(mesh.dp_world_size):
        group, index = mesh.data_parallel_runs(size)
        runs[size] = (_ranks(group), index, mesh.data_parallel_runs(size)[0] is group)
    sequence = mesh.get_sequence_parallel_group()
    return {
        "rank": mesh.rank,
        "same_mesh": Topology.build(tensor_parallel=tensor) is mesh,
        "world_is_data_only": Topology.world() is Topology.build(),
        "data": (_ranks(mesh.dp_group), mesh.dp_rank, mesh.dp_world_size),
        "tensor": (_ranks(mesh.tp_group), mesh.tp_rank) if tensor > 1 else None,
        "model": _ranks(mesh.mp_group) if tensor > 1 else None,
        "sizes": (mesh.num_stages, mesh.tp_world_size),
        "sequence": (
            _ranks(sequence),
            mesh.get_sequence_parallel_rank(),
            mesh.get_sequence_parallel_world_size(),
            mesh.get_sequence_parallel_group() is sequence,
        ),
        "sequence_data": (
            _ranks(mesh.get_sequence_data_parallel_group()),
            mesh.get_sequence_data_parallel_rank(),
            mesh.get_sequence_data_parallel_world_size(),
        ),
        "experts": experts,
        "runs": runs,
    }


def _pipeline_groups(stages: int) -> dict:
    world = dist.get_world_size()
    mesh = Topology.from_mesh(PipeDataParallelTopology(num_pp=stages, num_dp=world // stages))
    tie, source = mesh.tie_group(list(range(stages)))
    return {
        "rank": mesh.rank,
        "stage": mesh.stage,
        "data": _ranks(mesh.dp_group),
        "pipe": _ranks(mesh.pipe_group),
        "model": _ranks(mesh.mp_group),
        "tie": (_ranks(tie), source, mesh.tie_group(list(range(stages)))[0] is tie),
        "last_stage_only": mesh.tie_group([stages - 1])[1],
    }


def _sequence_groups(sequence: int) -> dict:
    mesh = Topology.build(sequence_parallel=sequence)
    ds_groups.use_topology(mesh)
    try:
        answers = {
            "sequence": (
                _ranks(ds_groups._get_sequence_parallel_group()),
                ds_groups._get_sequence_parallel_rank(),
                ds_groups._get_sequence_parallel_world_size(),
            ),
            "sequence_data": (
                _ranks(ds_groups._get_sequence_data_parallel_group()),
                ds_groups._get_sequence_data_parallel_rank(),
                ds_groups._get_sequence_data_parallel_world_size(),
            ),
            "data": (
                _ranks(ds_groups._get_data_parallel_group()),
                ds_groups._get_data_parallel_rank(),
                ds_groups._get_data_parallel_world_size(),
            ),
            "broadcast_source": ds_groups._get_broadcast_src_rank(),
        }
    finally:
        ds_groups.use_topology(Topology.world())
    return {
        **answers,
        "same_mesh": Topology.build(sequence_parallel=sequence) is mesh,
        "group_handed_out_again": mesh.get_sequence_parallel_group()
        is mesh.get_sequence_parallel_group(),
        "rank_in_groups": (
            dist.get_rank(mesh.get_sequence_parallel_group()),
            dist.get_rank(mesh.get_sequence_data_parallel_group()),
        ),
    }


def _inference_tensor_parallel_group(tp_size: int) -> list[int]:
    from shardspeed.inference.config import load_inference_config
    from shardspeed.inference.engine import _tensor_parallel_group

    config = load_inference_config({"tensor_parallel": {"tp_size": tp_size}})
    group, size, rank = _tensor_parallel_group(config)
    again, *_ = _tensor_parallel_group(config)
    assert again is group and size == tp_size and rank == dist.get_rank() % tp_size
    return _ranks(group)


def _deepspeed_groups_before_initialize() -> dict:
    return {
        "dp": ds_groups._get_data_parallel_group_ranks(),
        "sp": dist.get_world_size(ds_groups._get_sequence_parallel_group()),
        "sdp": ds_groups._get_sequence_data_parallel_world_size(),
    }


def _refusals() -> list[str]:
    messages = []
    world = dist.get_world_size()
    for ask in (
        lambda: Topology.build(tensor_parallel=world + 1),
        lambda: Topology.build(sequence_parallel=world + 1),
        lambda: Topology.build(tensor_parallel=2, sequence_parallel=2),
        lambda: Topology.world().expert_groups(world + 1),
        lambda: Topology.world().data_parallel_runs(world + 1),
        lambda: Topology.world().tie_group([0, 1]),
    ):
        with pytest.raises(ValueError) as caught:
            ask()
        messages.append(str(caught.value))
    return messages


# -- the tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
def test_data_tensor_expert_sequence_and_run_groups(request, world):
    pool = _pool(request, world)
    for tensor in _divisors(world):
        data_size = world // tensor
        for rank, seen in enumerate(pool.run(_world_and_tensor_groups, tensor)):
            assert seen["rank"] == rank and seen["same_mesh"] and seen["world_is_data_only"]
            # tensor-parallel ranks are neighbours; the data-parallel group strides over them
            data_ranks = [rank % tensor + k * tensor for k in range(data_size)]
            data_rank = rank // tensor
            assert seen["data"] == (data_ranks, data_rank, data_size)
            assert seen["sizes"] == (1, tensor)
            if tensor > 1:
                neighbours = list(range(rank - rank % tensor, rank - rank % tensor + tensor))
                assert seen["tensor"] == (neighbours, rank % tensor)
                assert seen["model"] == neighbours  # one stage: a replica is its tensor group
            assert seen["sequence"] == ([rank], 0, 1, True)
            assert seen["sequence_data"] == seen["data"]
            for ep in _divisors(data_size):
                replicas = data_size // ep
                runs = [data_ranks[i : i + ep] for i in range(0, data_size, ep)]
                strides = [data_ranks[j::replicas] for j in range(replicas)]
                expected = {
                    False: (_holding(runs, rank), data_rank % ep),
                    True: (_holding(strides, rank), data_rank // replicas),
                }
                for before, (expert, ep_rank) in expected.items():
                    got = seen["experts"][(ep, before)]
                    assert got["expert"] == expert and got["ranks"][0] == ep_rank
                    assert sorted(set(got["expert_data"]) & set(expert)) == [rank]
                    assert len(got["expert_data"]) == got["ranks"][2] == replicas
                    assert got["expert_data"][got["ranks"][1]] == rank
                    assert got["handed_out_again"]
                # the default layout: expert-data ranks stride over the expert runs
                assert seen["experts"][(ep, False)]["expert_data"] == _holding(
                    [data_ranks[j::ep] for j in range(ep)], rank
                )
            for size, (run, index, again) in seen["runs"].items():
                start = data_rank - data_rank % size
                assert run == data_ranks[start : start + size] and index == data_rank % size
                assert again


@pytest.mark.parametrize("world", [2, 4])
def test_pipeline_and_tie_groups(request, world):
    stages = 2
    replicas = world // stages
    for rank, seen in enumerate(_pool(request, world).run(_pipeline_groups, stages)):
        stage, replica = divmod(rank, replicas)
        pipeline = [s * replicas + replica for s in range(stages)]
        assert seen["stage"] == stage
        assert seen["data"] == [stage * replicas + d for d in range(replicas)]
        assert seen["pipe"] == pipeline
        assert seen["model"] == pipeline  # no tensor axis: a replica is its pipeline
        assert seen["tie"] == (pipeline, pipeline[0], True)
        assert seen["last_stage_only"] == pipeline[-1]


@pytest.mark.parametrize(("world", "sequence"), [(2, 2), (4, 2), (4, 4)])
def test_sequence_and_sequence_data_groups(request, world, sequence):
    data = world // sequence
    for rank, seen in enumerate(_pool(request, world).run(_sequence_groups, sequence)):
        replica, sp_rank = divmod(rank, sequence)
        # DeepSpeed's (data, sequence) mesh: a sequence group is a run of consecutive ranks, a
        # data-parallel group the ranks at one place in every run, and ZeRO's group all of them.
        run = list(range(replica * sequence, (replica + 1) * sequence))
        assert seen["sequence"] == (run, sp_rank, sequence)
        assert seen["sequence_data"] == (list(range(world)), rank, world)
        assert seen["data"] == ([sp_rank + k * sequence for k in range(data)], replica, data)
        assert seen["broadcast_source"] == 0
        assert seen["same_mesh"] and seen["group_handed_out_again"]
        assert seen["rank_in_groups"] == (sp_rank, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_inference_tensor_parallel_groups_come_from_the_world_mesh(request, world):
    for rank, group in enumerate(_pool(request, world).run(_inference_tensor_parallel_group, 2)):
        assert group == [rank - rank % 2, rank - rank % 2 + 1]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_deepspeed_groups_answer_from_the_world_mesh_before_initialize(request, world):
    for seen in _pool(request, world).run(_deepspeed_groups_before_initialize):
        assert seen == {"dp": list(range(world)), "sp": 1, "sdp": world}


def test_sizes_that_do_not_fit_are_refused(pool2):
    tensor, sequence, both, experts, runs, tie = pool2.run(_refusals)[0]
    assert "tensor_parallel.autotp_size 3 must divide the world size 2" in tensor
    assert "sequence_parallel_size 3 must divide the world size 2" in sequence
    assert "sequence_parallel_size and tensor_parallel.autotp_size do not combine" in both
    assert "ep_size 3 must divide the data-parallel size 2" in experts
    assert "3 must divide the data-parallel size 2" in runs
    assert "tied pipeline weights need a mesh with a 'pipe' axis" in tie
