"""Pipelines shared by the kernels: TMA producer (one thread) or cp.async producer threads ->
consumer warpgroups."""

import dataclasses
from functools import partial

import cutlass.cute as cute
from cutlass import pipeline


def next_state(state: pipeline.PipelineState) -> pipeline.PipelineState:
    """The following pipeline state, as a new object (so loops rebind it and the DSL carries it)."""
    nxt = state.clone()
    nxt.advance()
    return nxt


def tma_pipeline_factory(num_consumer_threads: int):
    """PipelineTmaAsync.create with flash4's participants bound: one producer thread issues the
    TMA (tx-count barrier), and every consumer warp arrives once on release (so the empty barrier
    counts num_consumer_threads // 32). Barrier init is deferred: the kernel fences and syncs once
    after creating all its pipelines. Call as f(barrier_storage=..., num_stages=..., tx_count=...)."""
    return partial(
        pipeline.PipelineTmaAsync.create,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads // 32),
        defer_sync=True,
    )


@dataclasses.dataclass(frozen=True)
class PipelineCpAsyncWarpRelease(pipeline.PipelineCpAsync):
    """PipelineCpAsync whose consumers release a stage with one arrive per warp (one elected lane),
    as tma_pipeline_factory's consumers do, instead of one per thread."""

    def consumer_release(self, state: pipeline.PipelineState):
        with cute.arch.elect_one():
            self.sync_object_empty.arrive(state.index, self.consumer_mask)


def cp_async_pipeline_factory(num_producer_threads: int, num_consumer_threads: int):
    """A pipeline filled by cp.async: each of num_producer_threads threads issues its copies and
    commits with cp.async.mbarrier.arrive.noinc (the full barrier completes once every thread's
    copies landed); every consumer warp arrives once on release. Barrier init is deferred, as in
    tma_pipeline_factory. Call as f(barrier_storage=..., num_stages=...)."""

    def create(barrier_storage, num_stages: int):
        base = pipeline.PipelineCpAsync.create(
            barrier_storage=barrier_storage, num_stages=num_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_producer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, num_consumer_threads // 32),
            defer_sync=True,
        )
        return PipelineCpAsyncWarpRelease(*(getattr(base, f.name) for f in dataclasses.fields(base)))

    return create
