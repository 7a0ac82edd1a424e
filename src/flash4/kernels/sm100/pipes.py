"""mbarrier pipelines of the sm100 forward, built against flash4.config.sm100.pipeline_specs.

Each pipeline is created by the kernel from its own warp-role table (which CUTLASS pipeline class,
which cooperative groups); `Pipe` then checks at trace time that the DSL's mbarrier init counts
equal the spec's arithmetic, and every arrive-type call goes through `Pipe` with the calling role,
so `ArrivalLedger.check` can assert, once the kernel is traced, that exactly the spec's roles
arrive on each side of each barrier. A mismatch (a hang on hardware) is a compile error here, with
the arithmetic in the message. What this cannot check: how many times per tile each role arrives
(the protocol itself; docs/design/sm100_forward.md walks through it).
"""

from __future__ import annotations

import collections

import cutlass.cute as cute
from cutlass import Int32, pipeline
from cutlass.cutlass_dsl import dsl_user_op

from flash4.kernels.sm100.plan import PipelineSpec, Signal
from flash4.kernels.common.dsl import DynamicState


class ArrivalLedger:
    """Roles seen arriving on each (pipeline, side) while tracing."""

    def __init__(self, specs: dict):
        self.specs = specs
        self.seen = collections.defaultdict(set)

    def record(self, name: str, side: str, role: str, signal: Signal):
        self.seen[(name, side)].add((role, signal))

    def check(self):
        """Raises RuntimeError when the traced arrivals differ from the specs."""
        problems = []
        for name, spec in self.specs.items():
            want_full = {(p.role, p.signal) for p in spec.producers}
            want_empty = {(p.role, p.signal) for p in spec.consumers} if spec.waited_empty else set()
            for side, want in (("full", want_full), ("empty", want_empty)):
                got = self.seen.get((name, side), set())
                if got != want:
                    fmt = lambda s: sorted(f"{r} ({sig.value})" for r, sig in s)  # noqa: E731
                    problems.append(f"{name}.{side}: spec says {fmt(want)}, the kernel arrives from {fmt(got)}")
        unknown = {n for n, _ in self.seen} - set(self.specs)
        if unknown:
            problems.append(f"arrivals on pipelines without a spec: {sorted(unknown)}")
        if problems:
            raise RuntimeError("sm100 forward: mbarrier arrivals do not match flash4.config.sm100.pipeline_specs:\n  "
                               + "\n  ".join(problems))


def check_init_counts(spec: PipelineSpec, pipe, cta_group: int | None = None):
    """The DSL's mbarrier init counts of `pipe` must equal the spec's (trace time; cta_group: the
    spec's own unless given)."""
    full = pipe.sync_object_full.arrive_count
    empty = pipe.sync_object_empty.arrive_count
    if (full, empty) != (spec.full_arrivals(cta_group), spec.empty_arrivals(cta_group)):
        raise RuntimeError(
            f"sm100 forward: pipeline {spec.name} initializes its mbarriers with (full, empty) = ({full}, {empty}) "
            f"arrivals, but its spec needs {spec.describe(cta_group)}")


class Pipe(DynamicState):
    """One pipeline with its spec: the kernel's only door to its arrive / wait calls.

    Per stage and phase bit (the per-Q-tile pipelines use stage = Q tile and a phase bit the
    caller toggles; the TMA rings pass a PipelineState's index and phase):
      wait_full / wait_empty(index, phase): wait until that phase of the stage's barrier completed;
      arrive_full / arrive_empty(index, role): arrive as `role` (a party of the spec), the way the
      spec says (tcgen05.commit for the MMA warp, one arrive per thread otherwise).
      acquire(state, role): a TMA producer's wait on empty + arrive.expect_tx on full.
    `role` names the calling party (flash4.config.sm100.ROLE_WARPS); the ledger records it.
    The DSL pipeline (its barrier pointers) is the dynamic part; spec and ledger are trace-time."""

    _dynamic_fields = ("pipe",)

    def __init__(self, spec: PipelineSpec, pipe, ledger: ArrivalLedger):
        check_init_counts(spec, pipe)
        self.spec, self.pipe, self.ledger = spec, pipe, ledger

    def _party(self, parties, role: str):
        for p in parties:
            if p.role == role:
                return p
        raise RuntimeError(f"sm100 forward: role {role} is not a party of pipeline {self.spec.describe()}")

    def acquire(self, state, role: str, expected_tx=None):
        """TMA producer: wait until the stage is free, then arrive with the expected bytes (the
        pipeline's tx count, or expected_tx: a V block of Dv != D in the K/V ring)."""
        party = self._party(self.spec.producers, role)
        if party.signal is not Signal.TMA:
            raise RuntimeError(f"sm100 forward: acquire is for TMA producers; {self.spec.describe()}")
        self.ledger.record(self.spec.name, "full", role, party.signal)
        if expected_tx is None:
            self.pipe.producer_acquire(state)
        else:
            self.pipe.producer_acquire(state, expected_tx=expected_tx)

    def arrive_full(self, index, role: str):
        party = self._party(self.spec.producers, role)
        if party.signal is Signal.TMA:
            raise RuntimeError(f"sm100 forward: {self.spec.name} is completed by the TMA unit; no arrive")
        self.ledger.record(self.spec.name, "full", role, party.signal)
        self.pipe.sync_object_full.arrive(index, self.pipe.producer_mask, getattr(self.pipe, "cta_group", None))

    def arrive_empty(self, index, role: str):
        party = self._party(self.spec.consumers, role)
        if not self.spec.waited_empty:
            raise RuntimeError(f"sm100 forward: {self.spec.name}'s empty barrier is not used ({self.spec.note})")
        self.ledger.record(self.spec.name, "empty", role, party.signal)
        self.pipe.sync_object_empty.arrive(index, self.pipe.consumer_mask, getattr(self.pipe, "cta_group", None))

    def wait_full(self, index, phase):
        self.pipe.sync_object_full.wait(index, phase)

    def wait_empty(self, index, phase):
        self.pipe.sync_object_empty.wait(index, phase)

    def barrier_full(self, index):
        """The stage's full barrier (a TMA copy's completion barrier)."""
        return self.pipe.sync_object_full.get_barrier(index)

    def producer_tail(self, state):
        """Before exit: wait until every stage's last release landed (no arrive after exit)."""
        self.pipe.producer_tail(state)


def thread_group(n: int):
    return pipeline.CooperativeGroup(pipeline.Agent.Thread, n)


# ---------------------------------------------------------------- sync ops of both sm100 kernels (fwd.py, bwd.py)
@dsl_user_op
def tcgen05_fence_before(*, loc=None, ip=None):
    """tcgen05.fence::before_thread_sync: order this thread's prior tcgen05 ops before a sync."""
    from cutlass._mlir.dialects import nvvm

    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tcgen05_fence_after(*, loc=None, ip=None):
    """tcgen05.fence::after_thread_sync: order later tcgen05 ops after a sync this thread took part in."""
    from cutlass._mlir.dialects import nvvm

    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def named_barrier_sync(barrier_id: int, num_threads: int, *, loc=None, ip=None):
    """bar.sync without .aligned: the warp roles reach it from different code."""
    from cutlass._mlir.dialects import nvvm

    nvvm.barrier_cta_sync(Int32(barrier_id).ir_value(loc=loc, ip=ip),
                          thread_count=Int32(num_threads).ir_value(loc=loc, ip=ip), aligned=False, loc=loc, ip=ip)


@dsl_user_op
def named_barrier_arrive(barrier_id: int, num_threads: int, *, loc=None, ip=None):
    cute.arch.barrier_arrive(barrier_id=barrier_id, number_of_threads=num_threads, aligned=False, loc=loc, ip=ip)
