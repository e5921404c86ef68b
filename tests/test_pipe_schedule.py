"""Pipeline schedules: built lists pass the checker, and the checker catches planted faults."""

from __future__ import annotations

import pytest

from shardspeed.pipe.schedule import (
    BackwardPass,
    ForwardPass,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ScheduleError,
    SendActivation,
    SendGrad,
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
