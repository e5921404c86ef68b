"""Pipeline schedules: built lists pass the checker, and the checker catches planted faults."""

from __future__ import annotations

import pytest
import torch

from shardspeed.comm.topology import (
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
    _prime_factors,
)
from shardspeed.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    ForwardPass,
    InferenceSchedule,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
    TrainSchedule,
    bubble_fraction,
    check_schedule,
    format_schedule,
    inference_schedule,
    is_communication,
    max_in_flight,
    train_schedule,
)

F, B, L = ForwardPass, BackwardPass, LoadMicroBatch
SA, RA, SG, RG = SendActivation, RecvActivation, SendGrad, RecvGrad
END = [ReduceGrads(), OptimizerStep()]


def check_both(lists: list[list[Instruction]], p: int, m: int, v: int = 1, train: bool = True):
    """Without metadata, with it on first use (the cached shapes), and before every activation
    (`dynamic_shape`)."""
    check_schedule(lists, p, m, v, train)
    check_schedule(lists, p, m, v, train, with_meta=True)
    check_schedule(lists, p, m, v, train, with_meta=True, dynamic_shape=True)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", range(1, 6))
def test_plain_schedules_pass_the_checker(kind, stages):
    for m in range(1, 10):
        check_both(train_schedule(kind, stages, m), stages, m)
        check_both(inference_schedule(stages, m), stages, m, train=False)


@pytest.mark.parametrize("stages", range(2, 6))
@pytest.mark.parametrize("chunks", range(2, 5))
def test_interleaved_schedules_pass_the_checker(stages, chunks):
    for m in (stages, 2 * stages, 3 * stages):
        check_both(train_schedule("interleaved_1f1b", stages, m, chunks), stages, m, chunks)
        check_both(inference_schedule(stages, m, chunks), stages, m, chunks, train=False)


def test_one_f_one_b_two_stages_three_micro_batches():
    rank0 = [
        L(0), F(0, 0), SA(0, 0, 1),
        L(1), F(1, 0), SA(1, 0, 1), RG(0, 0, 1),
        B(0, 0),
        L(2), F(2, 0), SA(2, 0, 1), RG(1, 0, 1),
        B(1, 0), RG(2, 0, 1),
        B(2, 0),
        *END,
    ]  # fmt: skip
    rank1 = [
        RA(0, 0, 0), L(0), F(0, 0), B(0, 0),
        SG(0, 0, 0), RA(1, 0, 0), L(1), F(1, 0), B(1, 0),
        SG(1, 0, 0), RA(2, 0, 0), L(2), F(2, 0), B(2, 0),
        SG(2, 0, 0),
        *END,
    ]  # fmt: skip
    assert train_schedule("1f1b", 2, 3) == [rank0, rank1]


def test_single_stage_loads_once_per_micro_batch():
    (only,) = train_schedule("1f1b", 1, 3)
    assert only == [L(0), F(0, 0), B(0, 0), L(1), F(1, 0), B(1, 0), L(2), F(2, 0), B(2, 0), *END]
    assert inference_schedule(1, 2) == [[L(0), F(0, 0), L(1), F(1, 0)]]


def test_activation_memory():
    for p in range(1, 6):
        for m in range(1, 10):
            one_f_one_b = train_schedule("1f1b", p, m)
            assert max_in_flight(one_f_one_b[0]) == min(p, m)
            assert all(max_in_flight(rank) <= p for rank in one_f_one_b)
            assert max_in_flight(train_schedule("gpipe", p, m)[0]) == m


def test_interleaved_order_and_warmup():
    p, m, v = 2, 4, 2
    lists = train_schedule("interleaved_1f1b", p, m, v)
    compute = [[i for i in rank if isinstance(i, (F, B))] for rank in lists]
    # groups of p micro-batches go through chunk 0, then chunk 1; backwards mirror the chunks
    assert compute[0][:6] == [F(0, 0), F(1, 0), F(0, 1), F(1, 1), F(2, 0), B(0, 1)]
    assert [i for i in compute[1] if isinstance(i, B)][:4] == [B(0, 1), B(1, 1), B(0, 0), B(1, 0)]
    for p, v in [(2, 2), (3, 2), (4, 3)]:
        for m in (p, 2 * p, 3 * p):
            for rank, instrs in enumerate(train_schedule("interleaved_1f1b", p, m, v)):
                warmup = min((p - rank - 1) * 2 + (v - 1) * p, m * v)
                first_backward = next(i for i, x in enumerate(instrs) if isinstance(x, B))
                assert sum(isinstance(x, F) for x in instrs[:first_backward]) == min(
                    warmup + 1, m * v
                )
                assert max_in_flight(instrs) == min(warmup + 1, m * v)


def test_checker_catches_a_missing_backward():
    lists = train_schedule("1f1b", 2, 3)
    lists[0].remove(B(1, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: no B\(mb=1,c=0\)"):
        check_schedule(lists, 2, 3)


@pytest.mark.parametrize(
    ("rank", "fault", "message"),
    [
        (1, lambda x: [i for i in x if i != L(2)], r"no Load\(mb=2\)"),
        (0, lambda x: [*x[:2], L(2), *x[2:]], r"Load\(mb=2\): repeats"),
        (0, lambda x: x[:-2], "must end with ReduceGrads, OptimizerStep"),
        (1, lambda x: [*x[1:3], x[0], *x[3:]], r"F\(mb=0,c=0\) comes before #2 RecvAct"),
        (0, lambda x: [SA(0, 0, 1), *x], r"SendAct\(mb=0,c=0,to=1\): repeats"),
        (1, lambda x: [SA(0, 0, 0), *x], "virtual stage 1 has no neighbour 2"),
        (0, lambda x: [*x, SG(0, 0, 1)], "virtual stage 0 has no neighbour -1"),
        (0, lambda x: [F(3, 0), *x], "micro-batch out of range"),
    ],
)
def test_checker_catches_misplaced_steps(rank, fault, message):
    lists = train_schedule("1f1b", 2, 3)
    lists[rank] = fault(lists[rank])
    with pytest.raises(ScheduleError, match=message):
        check_schedule(lists, 2, 3)


def test_checker_catches_sends_out_of_fifo_order():
    # Each send comes after its forward, but the receiver takes micro-batch 0 first.
    rank0 = [L(0), F(0, 0), L(1), F(1, 0), SA(1, 0, 1), SA(0, 0, 1)]
    rank0 += [RG(0, 0, 1), B(0, 0), RG(1, 0, 1), B(1, 0), *END]
    rank1 = [RA(0, 0, 0), L(0), F(0, 0), RA(1, 0, 0), L(1), F(1, 0)]
    rank1 += [B(0, 0), SG(0, 0, 0), B(1, 0), SG(1, 0, 0), *END]
    with pytest.raises(ScheduleError, match=r"messages 0->1 match in order: #4 SendAct\(mb=1"):
        check_schedule([rank0, rank1], 2, 2)


def test_checker_catches_sends_in_separate_batches():
    # Both ranks send before they receive, in batches of their own: NCCL would hang here.
    rank0 = [L(0), F(0, 0), SA(0, 0, 1), L(1), F(1, 0), SA(1, 0, 1), L(2), F(2, 0), SA(2, 0, 1)]
    rank0 += [RG(0, 0, 1), B(0, 0), RG(1, 0, 1), B(1, 0), RG(2, 0, 1), B(2, 0), *END]
    rank1 = [RA(0, 0, 0), L(0), F(0, 0), B(0, 0), SG(0, 0, 0), L(1), RA(1, 0, 0), F(1, 0)]
    rank1 += [B(1, 0), SG(1, 0, 0), L(2), RA(2, 0, 0), F(2, 0), B(2, 0), SG(2, 0, 0), *END]
    message = (
        r"deadlock .*: rank 0 waits on #5 SendAct\(mb=1,c=0,to=1\) "
        r"\(rank 1 is blocked at #4 SendGrad\(mb=0,c=0,to=0\)\); "
        r"rank 1 waits on #4 SendGrad\(mb=0,c=0,to=0\) \(rank 0 is blocked at #5 SendAct"
    )
    with pytest.raises(ScheduleError, match=message):
        check_schedule([rank0, rank1], 2, 3)


def test_checker_models_the_metadata_batches():
    # Rank 0 sends its first activation and receives its first one in the same batch: fine as
    # one batch, but the metadata receive the engine posts before it waits for rank 1, which
    # first needs that activation.
    rank0 = [L(0), F(0, 0), SA(0, 0, 1), RA(0, 1, 1), F(0, 1), SA(0, 1, 1)]
    rank0 += [L(1), F(1, 0), SA(1, 0, 1), RA(1, 1, 1), F(1, 1), SA(1, 1, 1), RG(0, 1, 1)]
    rank0 += [B(0, 1), SG(0, 1, 1), RG(1, 1, 1), B(1, 1), SG(1, 1, 1), RG(0, 0, 1)]
    rank0 += [B(0, 0), RG(1, 0, 1), B(1, 0), *END]
    rank1 = [RA(0, 0, 0), F(0, 0), SA(0, 0, 0), RA(0, 1, 0), L(0), F(0, 1)]
    rank1 += [RA(1, 0, 0), F(1, 0), SA(1, 0, 0), RA(1, 1, 0), L(1), F(1, 1), B(0, 1)]
    rank1 += [SG(0, 1, 0), B(1, 1), SG(1, 1, 0), RG(0, 0, 0), B(0, 0), SG(0, 0, 0)]
    rank1 += [RG(1, 0, 0), B(1, 0), SG(1, 0, 0), *END]
    check_schedule([rank0, rank1], 2, 2, 2)
    with pytest.raises(ScheduleError, match=r"with metadata messages: rank 0 waits on metadata"):
        check_schedule([rank0, rank1], 2, 2, 2, with_meta=True)


def test_checker_rejects_bad_shapes():
    lists = train_schedule("1f1b", 2, 3)
    with pytest.raises(ScheduleError, match="one instruction list per stage"):
        check_schedule(lists, 3, 3)
    with pytest.raises(ScheduleError, match="an inference schedule has no"):
        check_schedule(lists, 2, 3, train=False)
    with pytest.raises(ScheduleError, match="must end with ReduceGrads, OptimizerStep"):
        check_schedule(inference_schedule(2, 3), 2, 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: train_schedule("zb", 2, 4), "choose one of gpipe, 1f1b, interleaved_1f1b"),
        (lambda: train_schedule("gpipe", 2, 4, 2), "one model chunk per rank"),
        (lambda: train_schedule("1f1b", 2, 4, 2), "one model chunk per rank"),
        (lambda: train_schedule("interleaved_1f1b", 2, 5, 2), r"multiple of stages \(2\)"),
        (lambda: train_schedule("interleaved_1f1b", 2, 4, 1), "chunks >= 2"),
        (lambda: train_schedule("interleaved_1f1b", 1, 4, 2), "stages >= 2"),
        (lambda: train_schedule("1f1b", 0, 4), "stages must be an integer >= 1"),
        (lambda: train_schedule("1f1b", 2, 0), "micro_batches must be an integer >= 1"),
        (lambda: inference_schedule(3, 4, 2), r"multiple of stages \(3\)"),
        (lambda: bubble_fraction(2, 0), "micro_batches"),
    ],
)
def test_validation(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(2, 1) == 0.5
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)


def test_printing():
    assert str(F(3, 1)) == "F(mb=3,c=1)"
    assert str(RG(0, 1, 2)) == "RecvGrad(mb=0,c=1,from=2)"
    assert [is_communication(i) for i in (SA(0, 0, 1), RG(0, 0, 1), F(0, 0), L(0))] == [
        True,
        True,
        False,
        False,
    ]
    assert format_schedule(train_schedule("1f1b", 2, 1)) == (
        "rank 0: Load(mb=0) F(mb=0,c=0) [SendAct(mb=0,c=0,to=1) RecvGrad(mb=0,c=0,from=1)]"
        " B(mb=0,c=0) ReduceGrads OptimizerStep\n"
        "rank 1: [RecvAct(mb=0,c=0,from=0)] Load(mb=0) F(mb=0,c=0) B(mb=0,c=0)"
        " [SendGrad(mb=0,c=0,to=0)] ReduceGrads OptimizerStep"
    )


# DeepSpeed's step view (TrainSchedule / InferenceSchedule) -------------------------------------


def _compute(step: list[Instruction]) -> list[Instruction]:
    return [i for i in step if isinstance(i, (F, B))]


@pytest.mark.parametrize("stages", range(1, 6))
def test_step_views_are_the_engine_lists_cut_into_steps(stages):
    for m in range(1, 10):
        train, infer = train_schedule("1f1b", stages, m), inference_schedule(stages, m)
        for r in range(stages):
            steps = list(TrainSchedule(micro_batches=m, stages=stages, stage_id=r))
            assert len(steps) == 2 * (m + stages - 1)
            assert all(len(_compute(step)) <= 1 for step in steps)
            assert steps[-1][-3:] == [ReduceTiedGrads(), *END]
            flat = [i for step in steps for i in step if not isinstance(i, ReduceTiedGrads)]
            assert flat == train[r]
            steps = list(InferenceSchedule(micro_batches=m, stages=stages, stage_id=r))
            assert len(steps) == m + stages - 1
            # DeepSpeed's placement: stage r runs micro-batch k forward in step k + r
            assert [_compute(step) for step in steps] == [
                [F(k - r, 0)] if 0 <= k - r < m else [] for k in range(m + stages - 1)
            ]
            assert [i for step in steps for i in step] == infer[r]


def test_a_message_sits_in_the_same_step_on_both_ranks():
    # so a barrier between steps cannot deadlock, DeepSpeed's promise for its steps
    p, m = 4, 6
    where = {}
    for r in range(p):
        for s, step in enumerate(TrainSchedule(m, p, r)):
            for i in step:
                if is_communication(i):
                    send = isinstance(i, (SA, SG))
                    pair = (r, i.peer) if send else (i.peer, r)
                    kind = "act" if isinstance(i, (SA, RA)) else "grad"
                    where.setdefault((pair, kind, i.micro_batch), set()).add((s, send))
    assert where and all(len(v) == 2 and len({s for s, _ in v}) == 1 for v in where.values())


def test_buffer_ids_never_name_a_slot_still_in_use():
    for p in range(1, 6):
        for m in range(1, 10):
            for view in [TrainSchedule, InferenceSchedule]:
                for r in range(p):
                    sched = view(m, p, r)
                    steps, n = list(sched), sched.num_pipe_buffers()
                    spans = {}
                    for s, step in enumerate(steps):
                        for i in step:
                            if isinstance(i, BufferOpInstruction):
                                assert i.buffer_id == i.micro_batch % n
                                spans[i.micro_batch] = (spans.get(i.micro_batch, (s, s))[0], s)
                    for s in range(len(steps)):
                        live = [mb % n for mb, (a, b) in spans.items() if a <= s <= b]
                        assert len(live) == len(set(live)), (view, p, m, r, s)
    # the first stage keeps what 1F1B keeps in flight, as DeepSpeed's count says
    assert [
        TrainSchedule(8, 4, 0).num_pipe_buffers(),
        TrainSchedule(2, 4, 0).num_pipe_buffers(),
    ] == [
        4,
        2,
    ]


def test_buffer_id_is_presentation_only():
    assert F(0, 0, buffer_id=1) == F(0, 0)
    assert str(L(2, buffer_id=0)) == "Load(mb=2)"
    assert train_schedule("1f1b", 2, 2)[0][0].buffer_id is None


def test_step_view_stage_queries_and_validation():
    sched = TrainSchedule(micro_batches=4, stages=3, stage_id=2)
    assert (sched.stage, sched.num_stages, sched.num_micro_batches) == (2, 3, 4)
    assert (sched.is_first_stage, sched.is_last_stage) == (False, True)
    assert list(sched) == list(sched)  # each iteration starts over
    with pytest.raises(ValueError, match=r"stage_id must be an integer in 0\.\.2"):
        TrainSchedule(micro_batches=4, stages=3, stage_id=3)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        InferenceSchedule(micro_batches=0, stages=3, stage_id=0)


# Topology: DeepSpeed's pipeline grid ----------------------------------------------------------------


def test_prime_factors():
    assert [_prime_factors(n) for n in (1, 2, 12, 29, 49, 360)] == [
        [],
        [2],
        [2, 2, 3],
        [29],
        [7, 7],
        [2, 2, 2, 3, 3, 5],
    ]
    with pytest.raises(ValueError, match="positive integer"):
        _prime_factors(0)


def _grid(axes: list[str], dims: list[int]) -> dict:
    import torch.distributed as dist

    if axes:
        grid = PipelineParallelGrid(topology=ProcessTopology(axes=axes, dims=dims))
    else:
        grid = PipelineParallelGrid()
    rank = dist.get_rank()
    sums = {}
    for name in ("pipe_parallel", "data_parallel", "model_parallel", "slice_parallel"):
        t = torch.tensor([rank])
        dist.all_reduce(t, group=getattr(grid, f"get_{name}_group")())
        sums[name] = int(t)
    return {
        "dims": (grid.pipe_parallel_size, grid.data_parallel_size, grid.model_parallel_size),
        "stage": (grid.get_stage_id(), grid.is_first_stage, grid.is_last_stage),
        "ranks": (grid.pp_group, grid.dp_group, grid.slice_group),
        "mp": (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()),
        "to_global": [grid.stage_to_global(s) for s in range(grid.pipe_parallel_size)],
        "data1": grid.stage_to_global(stage_id=0, data=1) if grid.data_parallel_size > 1 else None,
        "sums": sums,
        "valid": grid._is_grid_valid(),
    }


def test_pipeline_grid(pool4):
    # pipe x data, as DeepSpeed's test: stage 0 is ranks 0 and 1
    for rank, g in enumerate(pool4.run(_grid, ["pipe", "data"], [2, 2])):
        stage, data = divmod(rank, 2)
        assert g["dims"] == (2, 2, 1) and g["valid"]
        assert g["stage"] == (stage, stage == 0, stage == 1)
        assert g["ranks"] == ([data, data + 2], [2 * stage, 2 * stage + 1], [rank])
        assert g["to_global"] == [data, data + 2] and g["data1"] == 1
        assert g["mp"] == (stage, 2)  # DeepSpeed's model-parallel group: one whole replica
        assert g["sums"] == {
            "pipe_parallel": 2 * data + 2,
            "data_parallel": 4 * stage + 1,
            "model_parallel": 2 * data + 2,
            "slice_parallel": rank,  # a group of one, not the world
        }
    # no topology: 4 = 2 * 2, dealt to pipe then data
    assert pool4.run(_grid, [], [])[3]["dims"] == (2, 2, 1)
    # pipe x data x model: the slice group is the tensor-parallel one
    mesh = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    grids = pool4.run(_grid, mesh.axes, mesh.dims)
    assert [g["ranks"][2] for g in grids] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["sums"]["model_parallel"] for g in grids] == [6] * 4
    assert [g["mp"] for g in grids] == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_pipeline_grid_refuses_a_process_group():
    with pytest.raises(ValueError, match="pass only topology"):
        PipelineParallelGrid(process_group=object())


def test_deepspeed_paths_resolve_to_the_room_and_the_layout():
    from shardspeed import compat
    from shardspeed.compat.deepspeed.runtime.pipe import topology

    assert compat.resolve("deepspeed.runtime.pipe.schedule") == "shardspeed.pipe.schedule"
    layout = "shardspeed.compat.deepspeed.runtime.pipe.topology"
    assert compat.resolve("deepspeed.runtime.pipe.topology") == layout
    assert topology.PipelineParallelGrid is PipelineParallelGrid
