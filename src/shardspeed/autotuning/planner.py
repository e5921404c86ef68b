"""The autotuner's analytic planner: which ZeRO stage / micro-batch / accumulation settings to try first.

Every measured trial costs a launch, so the planner prunes what cannot fit in memory and ranks the
rest by an estimated throughput, both from a model calibrated on measured trials (two to start
with: the smallest and the largest micro-batch that fits, at one stage). Per rank, with P parameters
per model-parallel rank, N data-parallel ranks, f = (N - 1) / N, w bytes per 16-bit or fp32
parameter, s the ZeRO stage, m the micro-batch, g the accumulation steps and T tokens per sample:

- memory = the ZeRO paper's model states (:func:`shardspeed.zero.estimate.model_state_bytes`, Adam
  assumed) + r + a * m: a per sample, r (buffers, the runtime) fixed. With peaks measured at two
  micro-batch sizes, peak - model states is fitted as r + a * m (a by least squares, r the least
  that leaves no measured peak above the line). With one size: when the trial measured its
  activations (bytes one forward pass keeps), a = activations / m and r = peak - model states -
  activations; without that, r = 0 and a = (peak - model states) / m, which charges r to every
  sample and overestimates every larger micro-batch, the safe side for pruning.
- step = g * (o_s + m * c) + optimizer + communication, no overlap assumed; throughput =
  m * g * N / step samples/s.
- g * (o_s + m * c) is the forward and backward work: c seconds per sample (reported as
  F = 6 * P * T / c FLOP/s) and o_s seconds per micro-step that do not depend on the micro-batch
  (Python, kernel launches, hooks; per stage, since stages 2 and 3 do more per micro-step). Both
  are fitted by least squares, relative to each measured step, to the measured steps less the
  modelled optimizer and communication: c is shared by all stages, o_s is fitted for each measured
  stage and a stage not measured yet takes the nearest measured stage's. One measurement cannot
  separate o from c: then o = 0 and everything is charged per sample, as the first version of this
  planner did (it underestimates larger micro-batches).
- optimizer = u * the parameters a rank updates (P at stage 0, P / N at stages 1-3), u the seconds
  per parameter of one AdamW step, measured by the tuner's probe.
- communication = bytes per step / B, B the bus bandwidth of a measured all-reduce; ring collectives
  move f * w * P bytes a rank per reduce-scatter or all-gather and twice that per all-reduce: stage 0
  one all-reduce a step; stage 1 a reduce to the owners a step plus the all-gather of the updated
  shards; stage 2 the reduce every micro-step plus the all-gather; stage 3 per micro-step a gather
  for forward, one for backward and the reduce.

Before any trial, given the `cluster` the job will run on, the estimates come from the step-time
model instead (`step_time.py`, the one a dry run's plan uses): the same FLOPs at the GPU kind's
stated efficiency, and the same collectives, each by alpha-beta over the data-parallel group's
link with the overlap the engine does, so layouts are ranked before anything is launched.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from shardspeed.zero.estimate import model_state_bytes

from .step_time import StepInputs, step_time
from .systems import Cluster

STAGES = (0, 1, 2, 3)
_WIDTH = {"fp16": 2, "bf16": 2, "fp32": 4}
# A measured step time is never all communication: when the bandwidth estimate says otherwise, this
# share of it is still kept as compute so that the fitted FLOP/s stays finite.
_MIN_COMPUTE_SHARE = 0.05


def format_bytes(value: float) -> str:
    """``1.5 GiB``, ``12 KiB``: readable at any size."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.4g} {unit}"
        value /= 1024
    return f"{value:.4g} TiB"


@dataclass(frozen=True)
class Candidate:
    """One configuration to try: ZeRO stage, micro-batch per rank, accumulation steps, batch size."""

    stage: int
    micro_batch: int
    grad_accum: int
    train_batch: int

    @property
    def name(self) -> str:
        return f"z{self.stage}_mbs{self.micro_batch}_gas{self.grad_accum}"

    @property
    def samples_per_rank(self) -> int:
        return self.micro_batch * self.grad_accum


@dataclass(frozen=True)
class Measurement:
    """What a trial measured: optimizer-step time and, if known, a rank's peak memory and the
    activation memory of one forward pass."""

    candidate: Candidate
    step_time_s: float
    peak_memory_bytes: float | None = None
    activation_bytes: float | None = None


@dataclass(frozen=True)
class Estimate:
    """The planner's figures for one candidate, per rank (throughput for the whole job)."""

    candidate: Candidate
    model_state_bytes: float
    runtime_bytes: float
    activation_bytes: float
    compute_s: float
    comm_s: float
    optimizer_s: float = 0.0

    @property
    def memory_bytes(self) -> float:
        return self.model_state_bytes + self.runtime_bytes + self.activation_bytes

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.comm_s

    @property
    def throughput(self) -> float:
        return self.candidate.train_batch / self.step_time_s


@dataclass(frozen=True)
class Plan:
    """Candidates to try, best estimate first, and those left out with the reason."""

    ranked: list[Estimate]
    pruned: list[tuple[Estimate, str]]


def micro_batch_sizes(
    low: int, high: int, requested: int | Sequence[int] | None = None
) -> list[int]:
    """Micro-batch sizes to consider: a list the user gave, else the powers of two in [low, high]
    with both bounds and the user's own size, so that the ladder is short but spans the range."""
    if isinstance(requested, Sequence):
        return sorted({int(size) for size in requested})
    if low > high:
        raise ValueError(f"min micro-batch size {low} is above the max {high}")
    sizes = {low, high}
    power = 1
    while power <= high:
        if power >= low:
            sizes.add(power)
        power *= 2
    if requested is not None and low <= requested <= high:
        sizes.add(requested)
    return sorted(sizes)


def enumerate_candidates(
    stages: Iterable[int],
    micro_batches: Iterable[int],
    dp_size: int,
    *,
    train_batch_size: int | None = None,
    grad_accum: int | None = None,
    min_train_batch_size: int = 1,
    max_train_batch_size: int | None = None,
) -> list[Candidate]:
    """Every (stage, micro-batch) pair with the accumulation steps that keep the batch rules.

    A fixed `train_batch_size` stays fixed (it is part of the optimization, not of the speed): only
    micro-batches dividing it per rank are kept, with the steps it implies. Otherwise the steps are
    the largest that keep the batch within `max_train_batch_size`, or `grad_accum` (default 1)
    without a maximum, as DeepSpeed's autotuner does; batches below `min_train_batch_size` are dropped.
    """
    high = max_train_batch_size if max_train_batch_size is not None else math.inf
    if train_batch_size is not None and not min_train_batch_size <= train_batch_size <= high:
        raise ValueError(
            f"train_batch_size {train_batch_size} is outside the autotuning bounds "
            f"[{min_train_batch_size}, {max_train_batch_size}]"
        )
    candidates = []
    for stage in sorted(set(stages)):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
        for micro in sorted(set(micro_batches)):
            per_step = micro * dp_size
            if train_batch_size is not None:
                if train_batch_size % per_step:
                    continue
                steps = train_batch_size // per_step
            elif max_train_batch_size is not None:
                steps = max_train_batch_size // per_step
            else:
                steps = grad_accum or 1
            if steps < 1 or per_step * steps < min_train_batch_size:
                continue
            candidates.append(Candidate(stage, micro, steps, per_step * steps))
    return candidates


@dataclass(frozen=True)
class Planner:
    """The memory and step-time model of the module docstring, for one model and job shape.

    Built uncalibrated from what the config says; :meth:`calibrate` returns a copy fitted to
    measurements. `bandwidth` (bus bytes/s) is needed only when there is more than one data-parallel
    rank; `optimizer_s_per_param` (u) is 0 unless measured. `offload_optimizer` / `offload_param`
    say what the user's config offloads; they count only at the stages that can offload (1-3 and 3).
    `micro_step_s` maps a stage to its fitted o_s (see :meth:`micro_step_time`).
    """

    num_params: int
    dp_size: int
    mp_size: int = 1
    precision: str = "fp16"
    offload_optimizer: bool = False
    offload_param: bool = False
    bandwidth: float | None = None
    tokens_per_sample: float = 1.0
    optimizer_s_per_param: float = 0.0
    flops_per_s: float | None = None
    micro_step_s: Mapping[int, float] = field(default_factory=dict)
    activation_bytes_per_sample: float = 0.0
    runtime_bytes: float = 0.0
    cluster: Cluster | None = None  # where the job runs: estimates before any calibration

    @property
    def params_per_rank(self) -> float:
        return self.num_params / self.mp_size

    def model_states(self, candidate: Candidate) -> dict[str, float]:
        """:func:`model_state_bytes` for this candidate's stage and the offloads it allows."""
        return model_state_bytes(
            math.ceil(self.params_per_rank),
            self.dp_size,
            candidate.stage,
            self.precision,
            offload_optimizer=self.offload_optimizer and candidate.stage >= 1,
            offload_param=self.offload_param and candidate.stage == 3,
        )

    def comm_bytes(self, candidate: Candidate) -> float:
        """Bytes one rank sends per optimizer step, in units of a ring reduce-scatter's traffic."""
        share = (self.dp_size - 1) / self.dp_size * _WIDTH[self.precision] * self.params_per_rank
        steps = candidate.grad_accum
        passes = {0: 2, 1: 2, 2: steps + 1, 3: 3 * steps}[candidate.stage]
        return passes * share

    def step_inputs(self, candidate: Candidate) -> StepInputs:
        """`candidate`'s step as the step-time model takes it: the forward and backward FLOPs
        (6 per parameter and token) and `comm_bytes`' passes as collectives over the
        data-parallel group (ranks `mp_size` apart), each of `w * P` bytes a call."""
        payload = _WIDTH[self.precision] * self.params_per_rank
        steps = candidate.grad_accum
        calls = {
            0: {"all_reduce": 1},
            1: {"reduce_scatter": 1, "all_gather": 1},
            2: {"reduce_scatter": steps, "all_gather": 1},
            3: {"all_gather": 2 * steps, "reduce_scatter": steps},
        }[candidate.stage]
        collectives = []
        if self.dp_size > 1:
            assert self.cluster is not None, "the step-time model needs the cluster"
            ranks = tuple(range(0, self.dp_size * self.mp_size, self.mp_size))
            link = self.cluster.link_class(ranks)
            collectives = [
                (kind, self.dp_size, link, int(count * payload), count)
                for kind, count in calls.items()
            ]
        return StepInputs(
            flops=6 * self.params_per_rank * self.tokens_per_sample * candidate.samples_per_rank,
            collectives=collectives,
            data_parallel=self.dp_size,
            zero_stage=candidate.stage,
            micro_batches=steps,
        )

    def comm_s(self, candidate: Candidate) -> float:
        traffic = self.comm_bytes(candidate)
        if not traffic:
            return 0.0
        if not self.bandwidth:
            raise ValueError(
                f"{self.dp_size} data-parallel ranks communicate: measure a bandwidth first"
            )
        return traffic / self.bandwidth

    def optimizer_s(self, candidate: Candidate) -> float:
        """One optimizer step: u times the parameters this rank updates (all of them at stage 0)."""
        shards = self.dp_size if candidate.stage >= 1 else 1
        return self.optimizer_s_per_param * self.params_per_rank / shards

    def micro_step_time(self, stage: int) -> float:
        """o_s: the fitted seconds per micro-step of `stage`, or else of the nearest fitted stage
        (the lower one on a tie); 0 before any fit."""
        if not self.micro_step_s:
            return 0.0
        nearest = min(self.micro_step_s, key=lambda fitted: (abs(fitted - stage), fitted))
        return self.micro_step_s[nearest]

    def estimate(self, candidate: Candidate) -> Estimate:
        if self.flops_per_s is None:
            if self.cluster is None:
                raise ValueError(
                    "the planner is not calibrated: call calibrate() with a measurement, or give "
                    "it the cluster to estimate with the step-time model"
                )
            return self._predicted(candidate)
        flops = 6 * self.params_per_rank * self.tokens_per_sample * candidate.samples_per_rank
        overhead = self.micro_step_time(candidate.stage) * candidate.grad_accum
        return Estimate(
            candidate,
            model_state_bytes=self.model_states(candidate)["device_total"],
            runtime_bytes=self.runtime_bytes,
            activation_bytes=self.activation_bytes_per_sample * candidate.micro_batch,
            compute_s=flops / self.flops_per_s + overhead,
            comm_s=self.comm_s(candidate),
            optimizer_s=self.optimizer_s(candidate),
        )

    def _predicted(self, candidate: Candidate) -> Estimate:
        """The step-time model's estimate on `cluster` (no measurement yet: no runtime or
        activation memory is known beyond what the planner was given)."""
        assert self.cluster is not None
        time = step_time(self.step_inputs(candidate), self.cluster)
        return Estimate(
            candidate,
            model_state_bytes=self.model_states(candidate)["device_total"],
            runtime_bytes=self.runtime_bytes,
            activation_bytes=self.activation_bytes_per_sample * candidate.micro_batch,
            compute_s=time.compute + time.bubble,
            comm_s=time.exposed_communication,
            optimizer_s=time.offload,
        )

    def calibrate(self, measurements: Sequence[Measurement]) -> Planner:
        """A copy fitted to `measurements` (at least one).

        Forward and backward time (the step less the modelled optimizer and communication) is
        fitted by non-negative least squares of the relative error as g * (o_s + m * c): c shared,
        one o_s per measured stage (see the module docstring); what the measurements cannot tell
        apart is charged per sample. Memory (peak less model states) is fitted as r + a * m once
        two micro-batch sizes were measured: a by least squares, r the least that leaves no
        measurement above the line. With one size, a and r come from the measured activations
        (the largest over the measurements), or else all of it is charged per sample; either way
        the estimate errs towards more memory.
        """
        if not measurements:
            raise ValueError("calibrate() needs at least one measurement")
        stages = sorted({measured.candidate.stage for measured in measurements})
        rows = []
        for measured in measurements:
            candidate = measured.candidate
            work = measured.step_time_s - self.comm_s(candidate) - self.optimizer_s(candidate)
            work = max(work, _MIN_COMPUTE_SHARE * measured.step_time_s)
            features = [float(candidate.samples_per_rank)] + [
                float(candidate.grad_accum if candidate.stage == stage else 0) for stage in stages
            ]
            rows.append((features, work, 1 / measured.step_time_s))
        per_sample, *per_micro_step = _fit_non_negative(rows)
        fitted = dataclasses.replace(
            self,
            flops_per_s=6 * self.params_per_rank * self.tokens_per_sample / per_sample,
            micro_step_s=dict(zip(stages, per_micro_step)),
        )
        with_peak = [m for m in measurements if m.peak_memory_bytes is not None]
        if not with_peak:
            return fitted
        rests = [
            (
                m.candidate.micro_batch,
                m.peak_memory_bytes - self.model_states(m.candidate)["device_total"],
            )
            for m in with_peak
        ]
        if len({micro for micro, _ in rests}) > 1:
            # Two micro-batch sizes tell the per-sample memory from the fixed part directly.
            rows = [
                ([float(micro), 1.0], max(rest, 1.0), 1 / max(rest, 1.0)) for micro, rest in rests
            ]
            per_sample, _ = _fit_non_negative(rows)
            runtime = max(0.0, *(rest - per_sample * micro for micro, rest in rests))
            return dataclasses.replace(
                fitted, activation_bytes_per_sample=per_sample, runtime_bytes=runtime
            )
        per_sample_bytes, runtime_bytes = [0.0], [0.0]
        split = all(m.activation_bytes is not None for m in with_peak)
        for measured, (micro, rest) in zip(with_peak, rests):
            if split:
                per_sample_bytes.append(measured.activation_bytes / micro)
                runtime_bytes.append(rest - measured.activation_bytes)
            else:
                per_sample_bytes.append(rest / micro)
        return dataclasses.replace(
            fitted,
            activation_bytes_per_sample=max(per_sample_bytes),
            runtime_bytes=max(runtime_bytes),
        )

    def plan(
        self,
        candidates: Iterable[Candidate],
        memory_limit_bytes: float | None,
        *,
        per_stage: int | None = None,
        metric: str = "throughput",
    ) -> Plan:
        """Rank `candidates` by estimate (throughput, or step time for the latency metric).

        Those estimated over `memory_limit_bytes` (None: no limit) are pruned, then per stage only
        the `per_stage` best micro-batch sizes are kept. Ties go to the larger micro-batch (better
        device utilisation than the model counts), then the lower stage (less communication).
        """
        fitting, pruned = [], []
        for candidate in candidates:
            estimate = self.estimate(candidate)
            if memory_limit_bytes is not None and estimate.memory_bytes > memory_limit_bytes:
                pruned.append(
                    (
                        estimate,
                        f"estimated {format_bytes(estimate.memory_bytes)} > limit "
                        f"{format_bytes(memory_limit_bytes)}",
                    )
                )
            else:
                fitting.append(estimate)

        def order(estimate: Estimate) -> tuple[float, int, int]:
            score = -estimate.step_time_s if metric == "latency" else estimate.throughput
            # Rounded so that candidates the model cannot tell apart tie exactly.
            return (
                -float(f"{score:.6g}"),
                -estimate.candidate.micro_batch,
                estimate.candidate.stage,
            )

        ranked, kept_per_stage = [], dict.fromkeys(STAGES, 0)
        for estimate in sorted(fitting, key=order):
            stage = estimate.candidate.stage
            if per_stage is not None and kept_per_stage[stage] >= per_stage:
                pruned.append(
                    (estimate, f"beyond the {per_stage} best micro-batch sizes of stage {stage}")
                )
                continue
            kept_per_stage[stage] += 1
            ranked.append(estimate)
        return Plan(ranked, pruned)


def _fit_non_negative(rows: Sequence[tuple[Sequence[float], float, float]]) -> list[float]:
    """Weighted least squares y = x . beta with beta[0] > 0 and the rest >= 0, for rows
    (x, y, weight) with y > 0 and x[0] > 0.

    Exact for the few unknowns here: every subset of the unknowns after the first is tried as the
    free set (the others 0), largest first; the feasible solution with the least residual wins, the
    larger free set on a tie. A free set the rows cannot determine (one measurement and two
    unknowns) is skipped, so beta[0] alone, which always fits, is the last resort.
    """
    width = len(rows[0][0])
    best: tuple[float, list[float]] | None = None
    scale = sum((y * weight) ** 2 for _, y, weight in rows)
    for size in range(width - 1, -1, -1):
        for chosen in itertools.combinations(range(1, width), size):
            free = (0, *chosen)
            solution = _least_squares(
                [([x[i] * weight for i in free], y * weight) for x, y, weight in rows]
            )
            if solution is None or solution[0] <= 0 or min(solution) < 0:
                continue
            beta = [0.0] * width
            for index, value in zip(free, solution):
                beta[index] = value
            residual = sum(
                ((sum(b * v for b, v in zip(beta, x)) - y) * weight) ** 2 for x, y, weight in rows
            )
            if best is None or residual < best[0] - 1e-12 * scale:
                best = (residual, beta)
    assert best is not None  # the first unknown alone always solves
    return best[1]


def _least_squares(rows: Sequence[tuple[Sequence[float], float]]) -> list[float] | None:
    """Least squares for rows (x, y) by the normal equations; None when they do not determine it."""
    width = len(rows[0][0])
    if len(rows) < width:
        return None
    matrix = [
        [sum(x[i] * x[j] for x, _ in rows) for j in range(width)] + [sum(x[i] * y for x, y in rows)]
        for i in range(width)
    ]
    largest = max(abs(matrix[i][i]) for i in range(width))
    for column in range(width):
        pivot = max(range(column, width), key=lambda row: abs(matrix[row][column]))
        if abs(matrix[pivot][column]) <= 1e-9 * largest:
            return None
        matrix[column], matrix[pivot] = matrix[pivot], matrix[column]
        for row in range(width):
            if row != column:
                factor = matrix[row][column] / matrix[column][column]
                matrix[row] = [a - factor * b for a, b in zip(matrix[row], matrix[column])]
    return [matrix[i][width] / matrix[i][i] for i in range(width)]
