"""Pipelines shared by the kernels: TMA producer (one thread) -> consumer warpgroups."""

from functools import partial

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
