"""A model of the sm100 forward's warp-role protocol, run on the CPU: each role is a generator of
mbarrier waits and arrivals written after its code in flash4/kernels/sm100/fwd.py (same order,
same phase bits, same per-tile counts), the barriers take their arrive counts from
flash4.config.sm100.pipeline_specs, and a scheduler runs the roles in many random interleavings.

It checks intent, not the compiled code (BLACKWELL.md section 3, item 6): every interleaving
terminates (no deadlock), every barrier ends on a completed phase (no stray or missing arrival),
and no wait is satisfied by a later phase than the one it meant (no phase lapping: with parity
waits, a barrier two phases ahead would look like the phase the waiter expects). MMAs, TMA copies
and commits complete instantly here; the real kernel's extra latency only delays arrivals.

2-CTA configs (cta_group 2) run as a pair: each CTA has its own barriers and roles, the MMA role runs
in the leader CTA only, and every arrival goes where the kernel's pipelines send it (the DSL's
PipelineTmaUmma / PipelineUmmaAsync with the pair's cluster layout): a tcgen05.commit is multicast
(one arrival on the barrier of each CTA), the leader's load warp alone arrives with expect_tx of
both CTAs' bytes and each CTA's TMA completes its half on the leader's barrier (transaction bytes:
a phase completes when its arrivals and its bytes are in), the softmax and correction threads of
both CTAs release s_p_o (and would o_full) on the leader's barrier; sm_stats and corr_epi stay
CTA-local. Waits are on the waiter's own CTA's barriers. Not modelled: the cluster launch and the
init handshake (pipeline_init_arrive / wait), the TMEM dealloc handshake, remote-arrive latency
beyond reordering.

Ragged keys (varlen_k / seqused_k configs): a tile whose key-edge block is partial (`partial`) has the
load warp wait for that V block to land, zero its rows past seqlen_k, wait v_tail's empty side and
arrive on its full side; the MMA waits on v_tail before the tile's first PV and acknowledges at once.
The model also records the zeroing ("do" ops): it must happen after that V landed and before it is
released, and the tile's first PV must find this use of the stage zeroed.
"""

import dataclasses
import random

import pytest

from flash4.config.sm100 import Signal, pipeline_specs, select_fwd_config


class Barrier:
    def __init__(self, name, count):
        self.name, self.count = name, count
        self.pending = 0  # arrivals in the current (incomplete) phase
        self.completed = 0  # phases completed so far
        self.tx = 0  # transaction balance of the current phase (expect_tx adds, complete_tx subtracts)

    def arrive(self, n, expect_tx=0):
        self.pending += n
        self.tx += expect_tx
        assert self.pending <= self.count, f"{self.name}: {self.pending} arrivals > count {self.count}"
        self._complete()

    def complete_tx(self, n=1):
        self.tx -= n
        self._complete()

    def _complete(self):
        if self.pending == self.count and self.tx == 0:
            self.pending = 0
            self.completed += 1

    def passes(self, parity):
        # mbarrier.try_wait.parity(P): the phase of parity P has completed, i.e. the current phase's
        # parity differs from P (a fresh barrier: waiting on parity 1 passes at once).
        return self.completed % 2 != parity


LEADER = 0


class Model:
    """The barriers of each CTA (one, or the pair of a 2-CTA config): (cta, name, side, stage) ->
    Barrier, initialized with the spec's counts (count_group: the cta_group the counts are taken for,
    the config's unless a test breaks it)."""

    def __init__(self, cfg, count_group=None, delay_tma=False):
        self.specs = pipeline_specs(cfg)
        # delay_tma (1-CTA): a TMA's bytes land later, at a random point (the scheduler's "tma" steps),
        # not with the load warp's expect_tx arrive
        self.delay_tma = delay_tma
        self.inflight = []  # full barriers with a TMA's bytes still in flight
        assert not delay_tma or cfg.cta_group == 1
        self.group = cfg.cta_group
        g = self.group if count_group is None else count_group
        self.bars = {}
        self.zeroed = {}  # (cta, kv stage) -> the use whose V tail the load warp zeroed last
        for cta in range(self.group):
            for spec in self.specs.values():
                for s in range(spec.stages):
                    self.bars[(cta, spec.name, "full", s)] = Barrier(f"cta{cta}.{spec.name}.full[{s}]",
                                                                     spec.full_arrivals(g))
                    self.bars[(cta, spec.name, "empty", s)] = Barrier(f"cta{cta}.{spec.name}.empty[{s}]",
                                                                      spec.empty_arrivals(g))

    def party(self, name, side, role):
        spec = self.specs[name]
        parties = spec.producers if side == "full" else spec.consumers
        return next(p for p in parties if p.role == role)

    def arrivals(self, name, side, role):
        """Arrivals one CTA's `role` adds in one arrive op (its own threads: a 1-CTA count)."""
        return self.party(name, side, role).arrivals(1)

    def apply_arrive(self, cta, op):
        """One arrive op of `role` in CTA `cta`, routed as the kernel's pipelines route it."""
        _, name, side, stage, role, k = op
        party = self.party(name, side, role)
        if party.signal is Signal.TMA:
            # the leader's elected thread: arrive + expect_tx of the pair's bytes; each CTA's TMA
            # completes its bytes on the leader's barrier (1-CTA: its own, the same thing)
            bar = self.bars[(LEADER, name, side, stage)]
            assert bar.completed == k, f"cta{cta} TMA into {bar.name} for completion {k + 1}, found {bar.completed}"
            if cta == LEADER:
                bar.arrive(1, expect_tx=self.group)
            if self.delay_tma:
                self.inflight.append(bar)
            else:
                bar.complete_tx(1)
        elif party.signal is Signal.COMMIT:
            assert cta == LEADER, "only the leader CTA issues MMAs and commits"
            for c in range(self.group):  # multicast to the pair
                self.bars[(c, name, side, stage)].arrive(1)
        else:
            self.bars[(LEADER if party.to_leader else cta, name, side, stage)].arrive(party.arrivals(1))


# Ops a role yields: ("wait", name, side, stage, parity, expected_phase) or ("arrive", name, side, stage, role).
def W(name, side, stage, parity, k):
    """Wait for the k-th completion (0-based) of a barrier, by parity as the kernel does."""
    return ("wait", name, side, stage, parity, k)


def A(name, side, stage, role, k=None):
    """An arrive; k: the completion (0-based) it is meant for (checked for TMA arrivals)."""
    return ("arrive", name, side, stage, role, k)


def D(fn):
    """An instant action on the model (fn(model, cta)): the V-tail zeroing and its checks."""
    return ("do", fn)


def zero_v(stage, use, check_landed=True):
    """The load warp zeroes the rows past seqlen_k of the `use`-th block in K/V stage `stage`."""
    def fn(model, cta):
        full = model.bars[(cta, "kv", "full", stage)]
        empty = model.bars[(cta, "kv", "empty", stage)]
        if check_landed:
            assert full.completed == use + 1, f"V-tail zeroing of kv[{stage}] use {use} before its TMA landed"
        assert empty.completed == use, f"V-tail zeroing of kv[{stage}] use {use} after the MMA released it"
        model.zeroed[(cta, stage)] = use
    return D(fn)


def pv_reads_zeroed(stage, use):
    """The MMA's first PV of a partial tile reads the `use`-th block of stage `stage`: zeroed."""
    def fn(model, cta):
        assert model.zeroed.get((cta, stage)) == use, (
            f"first PV reads kv[{stage}] use {use} before its V tail was zeroed ({model.zeroed.get((cta, stage))})")
    return D(fn)


class Ring:
    """A PipelineState: index and phase of a ring of `stages`, advanced per use; counts uses per
    stage for the expected completion index."""

    def __init__(self, stages, phase):
        self.stages, self.index, self.phase, self.uses = stages, 0, phase, [0] * stages

    def advance(self):
        self.uses[self.index] += 1
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


def load(tiles, q_stage, kv_stages, partial=None, bug=None):
    """partial[t]: tile t's key-edge block crosses seqlen_k (ragged configs: zero_v_tail). bug: a
    deliberate fault for the model's own tests: "no_landed_wait" (zero before the TMA landed),
    "no_empty_wait" (signal v_tail without waiting for the MMA's acknowledgement)."""
    q, kv = Ring(q_stage, 1), Ring(kv_stages, 1)
    partial = partial or [False] * len(tiles)
    vt_phase, vt_round = 1, 0

    def acquire(name, ring):
        # producer_acquire: wait empty (the previous use's release), then arrive.expect_tx on full
        yield W(name, "empty", ring.index, ring.phase, ring.uses[ring.index] - 1)
        yield A(name, "full", ring.index, "load", ring.uses[ring.index])  # the TMA bytes land at once here
        ring.advance()

    for n, cut in zip(tiles, partial):
        if n > 0:
            yield from acquire("kv", kv)  # K[n-1]
            for _ in range(q_stage):
                yield from acquire("q", q)
            v_index, v_use = kv.index, kv.uses[kv.index]
            yield from acquire("kv", kv)  # V[n-1]
            if cut:  # zero_v_tail
                if bug != "no_landed_wait":
                    yield W("kv", "full", v_index, kv_parity(v_use), v_use)
                yield zero_v(v_index, v_use, check_landed=True)
                if bug != "no_empty_wait":
                    yield W("v_tail", "empty", 0, vt_phase, vt_round - 1)
                yield A("v_tail", "full", 0, "load")
                vt_phase ^= 1
                vt_round += 1
            for _ in range(n - 1):
                yield from acquire("kv", kv)  # K
                yield from acquire("kv", kv)  # V
    for ring, name in ((kv, "kv"), (q, "q")):  # producer_tail
        for _ in range(ring.stages):
            yield W(name, "empty", ring.index, ring.phase, ring.uses[ring.index] - 1)
            ring.advance()


def kv_parity(use):
    """The consumer parity of the `use`-th completion of a ring stage's full barrier."""
    return use % 2


def mma(tiles, q_stage, kv_stages, partial=None, bug=None):
    """bug "no_v_tail_wait": the MMA does not wait for the V-tail zeroing (the model's own test)."""
    kv = Ring(kv_stages, 0)
    q_phase, spo_phase, q_round, spo_round = 0, 0, 0, 0
    partial = partial or [False] * len(tiles)
    vt_phase, vt_round = 0, 0

    def kv_wait():
        return W("kv", "full", kv.index, kv.phase, kv.uses[kv.index])

    for n, cut in zip(tiles, partial):
        if n == 0:
            continue
        yield kv_wait()
        for stage in range(q_stage):
            yield W("q", "full", stage, q_phase, q_round)
            yield A("s_p_o", "full", stage, "mma")  # S_stage(0) ready
        yield A("kv", "empty", kv.index, "mma")
        kv.advance()
        if cut:
            if bug != "no_v_tail_wait":
                yield W("v_tail", "full", 0, vt_phase, vt_round)
                yield A("v_tail", "empty", 0, "mma")
                vt_phase ^= 1
                vt_round += 1
            # the tile's first PV (in the loop below, or the last one for n == 1) reads this V
            yield pv_reads_zeroed(kv.index, kv.uses[kv.index])
        for i in range(n - 1):
            v_index = kv.index
            yield kv_wait()  # V[j-1]
            kv.advance()
            for stage in range(q_stage):
                yield W("s_p_o", "empty", stage, spo_phase, spo_round)
                if stage == q_stage - 1:
                    yield A("kv", "empty", v_index, "mma")
                if stage == 0:
                    yield kv_wait()  # K[j]
                yield A("s_p_o", "full", stage, "mma")
            yield A("kv", "empty", kv.index, "mma")
            kv.advance()
            spo_phase ^= 1
            spo_round += 1
        for stage in range(q_stage):
            yield A("q", "empty", stage, "mma")
        q_phase ^= 1
        q_round += 1
        yield kv_wait()
        for stage in range(q_stage):
            yield W("s_p_o", "empty", stage, spo_phase, spo_round)
            yield A("o_full", "full", stage, "mma")
        yield A("kv", "empty", kv.index, "mma")
        kv.advance()
        spo_phase ^= 1
        spo_round += 1


def softmax(tiles, stage):
    spo_phase, stats_phase, spo_round, stats_round = 0, 1, 0, 0

    def send_stat():
        nonlocal stats_phase, stats_round
        yield W("sm_stats", "empty", stage, stats_phase, stats_round - 1)
        yield A("sm_stats", "full", stage, "softmax")
        stats_phase ^= 1
        stats_round += 1

    for n in tiles:
        for j in range(n):
            yield W("s_p_o", "full", stage, spo_phase, spo_round)
            if j > 0:
                yield from send_stat()  # the O factor of block j
            yield A("s_p_o", "empty", stage, "softmax")  # P written
            spo_phase ^= 1
            spo_round += 1
        if n > 0:
            yield from send_stat()  # 1 / row_sum


def correction(tiles, q_stage, release_on_empty=False):
    """release_on_empty: a deliberate bug for the model's own test (the kernel arrives on s_p_o
    only for tiles with keys)."""
    stats_phase, ofull_phase, rounds, ofull_rounds = 0, 0, 0, 0
    epi = Ring(q_stage, 1)
    for stage in range(q_stage):
        yield A("s_p_o", "empty", stage, "correction")
    for n in tiles:
        for _ in range(max(n - 1, 0)):
            for stage in range(q_stage):
                yield W("sm_stats", "full", stage, stats_phase, rounds)
                yield A("sm_stats", "empty", stage, "correction")
                yield A("s_p_o", "empty", stage, "correction")  # O rescaled
            stats_phase ^= 1
            rounds += 1
        for stage in range(q_stage):
            if n > 0:
                yield W("sm_stats", "full", stage, stats_phase, rounds)
                yield A("sm_stats", "empty", stage, "correction")
                yield W("o_full", "full", stage, ofull_phase, ofull_rounds)
            yield W("corr_epi", "empty", epi.index, epi.phase, epi.uses[epi.index] - 1)
            yield A("corr_epi", "full", epi.index, "correction")
            epi.advance()
            if n > 0 or release_on_empty:
                yield A("s_p_o", "empty", stage, "correction")  # O read out
        if n > 0:
            stats_phase ^= 1
            ofull_phase ^= 1
            rounds += 1
            ofull_rounds += 1
    for _ in range(q_stage):  # producer_tail
        yield W("corr_epi", "empty", epi.index, epi.phase, epi.uses[epi.index] - 1)
        epi.advance()


def epilogue(tiles, q_stage):
    epi = Ring(q_stage, 0)
    for _ in tiles:
        indices = []
        for _ in range(q_stage):
            yield W("corr_epi", "full", epi.index, epi.phase, epi.uses[epi.index])
            indices.append(epi.index)
            epi.advance()
        for index in indices:
            yield A("corr_epi", "empty", index, "epilogue")


TMA_LANDS = (0, "tma")  # the scheduler's pseudo role: a delayed TMA completes


def run(cfg, tiles, seed, correction_role=None, count_group=None, partial=None, load_bug=None, mma_bug=None,
        delay_tma=False):
    """Run every role of each CTA (the pair's for 2-CTA: the MMA role in the leader only) over `tiles`
    (key blocks per tile; both CTAs of a pair walk the same tiles) in a random interleaving.
    partial[t]: ragged configs, tile t's key-edge block crosses seqlen_k (the V-tail zeroing).
    delay_tma: TMA bytes land at random later steps (1-CTA)."""
    model = Model(cfg, count_group, delay_tma)
    q, kvs = cfg.q_stage, cfg.kv_stages
    if partial is not None:
        assert "v_tail" in model.specs, "partial key-edge blocks only in ragged configs"
        partial = [bool(c) and n > 0 for n, c in zip(tiles, partial)]
    roles = {}
    for cta in range(cfg.cta_group):
        roles[(cta, "load")] = load(tiles, q, kvs, partial, load_bug)
        if cta == LEADER:
            roles[(cta, "mma")] = mma(tiles, q, kvs, partial, mma_bug)
        roles[(cta, "epilogue")] = epilogue(tiles, q)
        roles[(cta, "correction")] = (correction_role or correction)(tiles, q)
        for s in range(q):
            roles[(cta, f"softmax{s}")] = softmax(tiles, s)
    current = {key: next(gen) for key, gen in roles.items()}
    rng = random.Random(seed)
    while current or model.inflight:
        runnable = [TMA_LANDS] if model.inflight else []
        for key, op in current.items():
            if op[0] in ("arrive", "do"):
                runnable.append(key)
            else:
                _, bname, side, stage, parity, k = op
                bar = model.bars[(key[0], bname, side, stage)]
                if k < 0 or bar.passes(parity):  # k < 0: a producer's first acquire (buffer empty)
                    runnable.append(key)
        assert runnable, f"deadlock: every role waits: {current}"
        key = runnable[rng.randrange(len(runnable))]
        if key == TMA_LANDS:  # one TMA in flight lands (any of them: copies complete out of order)
            model.inflight.pop(rng.randrange(len(model.inflight))).complete_tx(1)
            continue
        op = current[key]
        if op[0] == "do":
            op[1](model, key[0])
        elif op[0] == "arrive":
            model.apply_arrive(key[0], op)
        else:
            _, bname, side, stage, parity, k = op
            bar = model.bars[(key[0], bname, side, stage)]
            if k >= 0:
                # the wait means the k-th completion; a later one would be phase lapping
                assert bar.completed == k + 1, f"{key} waited on {bar.name} for completion {k + 1}, found {bar.completed}"
            else:
                assert bar.passes(parity), f"{key}: first acquire of {bar.name} found it busy"
        try:
            current[key] = next(roles[key])
        except StopIteration:
            del current[key]
    for (cta, name, side, stage), bar in model.bars.items():
        if side == "empty" and not model.specs[name].waited_empty:
            assert bar.completed == 0 and bar.pending == 0, bar.name
        elif (name, side) == ("s_p_o", "empty") and cta == LEADER:
            # the correction's release after the last tile's O read is for a next tile that never
            # comes: exactly its arrivals stay pending (harmless at exit: nobody waits); in a pair
            # both CTAs' corrections release on the leader's barrier
            assert bar.pending == cfg.cta_group * model.arrivals("s_p_o", "empty", "correction"), (bar.name, bar.pending)
        else:
            assert bar.pending == 0 and bar.tx == 0, f"{bar.name}: {bar.pending} arrivals / {bar.tx} tx left in a phase"
    return model


TILE_SETS = [[1], [2], [5], [3, 0, 4], [0, 0, 2], [1, 1, 1, 1], [7, 2, 0, 1, 6]]


@pytest.mark.parametrize("hd,dv", [(64, None), (128, None), (192, 128), (256, None)],
                         ids=["d64", "d128", "d192v128-q_stage1-kv3", "d256-q_stage1-kv1"])
@pytest.mark.parametrize("tiles", TILE_SETS, ids=[str(t) for t in TILE_SETS])
def test_protocol_terminates_without_lapping(hd, dv, tiles):
    """q_stage 2 (hd64: 10 K/V stages, hd128: 3) and q_stage 1 ((192, 128): 3 stages, hd256: a
    single K/V stage, so every K and V block waits for the previous one's release)."""
    cfg = select_fwd_config(hd, headdim_v=dv)
    for seed in range(40):
        model = run(cfg, tiles, seed)
    check_counts(cfg, model, tiles)


def check_counts(cfg, model, tiles):
    blocks = sum(tiles)
    with_keys = sum(1 for n in tiles if n)
    for cta in range(cfg.cta_group):
        leader = cta == LEADER
        bars = {k[1:]: b for k, b in model.bars.items() if k[0] == cta}
        for stage in range(cfg.q_stage):
            # one S-ready commit and one "P written + O rescaled" phase per Q tile and key block
            # (the MMA-side barriers of the pair live in the leader: the follower's are never used)
            assert bars[("s_p_o", "full", stage)].completed == blocks
            assert bars[("s_p_o", "empty", stage)].completed == (blocks if leader else 0)
            # softmax -> correction: n messages per tile with keys (factors of blocks 1..n-1, 1 / row_sum)
            assert bars[("sm_stats", "full", stage)].completed == blocks
            assert bars[("o_full", "full", stage)].completed == with_keys
            assert bars[("corr_epi", "full", stage)].completed == len(tiles)  # empty tiles store O = 0 too
            assert bars[("q", "full", stage)].completed == (with_keys if leader else 0)
            assert bars[("q", "empty", stage)].completed == with_keys  # the multicast release reaches both
        kv_full = sum(bars[("kv", "full", s)].completed for s in range(cfg.kv_stages))
        assert kv_full == (2 * blocks if leader else 0)
        assert sum(bars[("kv", "empty", s)].completed for s in range(cfg.kv_stages)) == 2 * blocks


def test_the_model_finds_a_missing_release():
    """Sanity of the model itself: drop the correction's initial release and it deadlocks."""
    def broken(tiles, q_stage):
        gen = correction(tiles, q_stage)
        for _ in range(q_stage):
            next(gen)  # skip the initial s_p_o releases
        yield from gen

    with pytest.raises(AssertionError, match="deadlock"):
        run(select_fwd_config(128), [2], seed=0, correction_role=broken)


def test_two_q_tiles_need_two_kv_stages():
    """Why (192, 128) runs one Q tile (plan.q_stage_for): with two Q tiles and a single K/V stage the
    MMA warp waits for K[j] after PV_0(j - 1) while V[j - 1] is still needed by PV_1: it deadlocks
    as soon as a tile has two key blocks. One Q tile releases V before it waits for K (hd256)."""
    one_stage = dataclasses.replace(select_fwd_config(128), kv_stages=1)
    run(one_stage, [1], seed=0)
    with pytest.raises(AssertionError, match="deadlock"):
        run(one_stage, [2], seed=0)
    assert select_fwd_config(256).kv_stages == 1
    run(select_fwd_config(256), [2], seed=0)


def test_the_model_finds_an_extra_release():
    """An s_p_o release on a tile without keys completes a phase with correction arrivals only: the
    MMA would issue PV before P is written. The model sees the stray arrivals."""
    def broken(tiles, q_stage):
        return correction(tiles, q_stage, release_on_empty=True)

    with pytest.raises(AssertionError):
        for seed in range(20):
            run(select_fwd_config(128), [0, 2, 1], seed=seed, correction_role=broken)


# ---------------------------------------------------------------- the 2-CTA pair
@pytest.mark.parametrize("tiles", TILE_SETS, ids=[str(t) for t in TILE_SETS])
def test_two_cta_pair_terminates_without_lapping(tiles):
    """The pair (hd128 non-causal, cta_group 2) with the spec's per-CTA counts: multicast commits,
    leader-only expect_tx of both halves, both CTAs' releases on the leader's s_p_o (512 a phase)."""
    cfg = select_fwd_config(128, two_cta=True)
    assert cfg.cta_group == 2
    for seed in range(40):
        model = run(cfg, tiles, seed)
    check_counts(cfg, model, tiles)


def test_the_pair_model_finds_one_cta_counts():
    """Sanity of the pair model: barriers initialized with 1-CTA counts (the leader's s_p_o empty at
    256, the TMA full barriers expecting one half) complete phases early: PV before the peer's P is
    written; the parity waits then lap (here: a deadlock, the hang it would be on hardware)."""
    cfg = select_fwd_config(128, two_cta=True)
    with pytest.raises(AssertionError):
        for seed in range(20):
            run(cfg, [3, 1], seed=seed, count_group=1)


def test_the_pair_model_finds_a_follower_missing_release():
    """Drop the follower's initial s_p_o releases (as if its correction arrived on its own barrier):
    the leader's MMA waits forever for 512 arrivals."""
    cfg = select_fwd_config(128, two_cta=True)
    calls = []

    def follower_broken(tiles, q_stage):
        gen = correction(tiles, q_stage)
        calls.append(1)
        if len(calls) == 2:  # the second CTA's correction (roles are built leader first)
            for _ in range(q_stage):
                next(gen)
        yield from gen

    with pytest.raises(AssertionError, match="deadlock"):
        run(cfg, [2], seed=0, correction_role=follower_broken)


# ---------------------------------------------------------------- ragged keys: the V-tail zeroing
RAGGED = [(64, dict(varlen_q=True, varlen_k=True)), (128, dict(seqused_k=True)),
          (96, dict(varlen_q=True, varlen_k=True, seqused_k=True)),
          # q_stage 1: hd256 (one K/V stage: the zeroing waits for the V it will zero in the only stage),
          # (192, 128) (3 stages)
          (256, dict(varlen_q=True, varlen_k=True)), (192, dict(varlen_q=True, varlen_k=True, seqused_k=True))]
PARTIAL_SETS = [([1], [1]), ([2], [1]), ([3, 0, 4], [1, 0, 1]), ([1, 1, 1, 1], [1, 1, 1, 1]),
                ([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12), ([7, 2, 0, 1, 6], [1, 0, 0, 1, 1]),
                ([2, 1, 3, 1], [0, 1, 0, 1])]


@pytest.mark.parametrize("hd,layout", RAGGED, ids=["d64-varlen", "d128-seqused_k", "d96-varlen-seqused_k",
                                                   "d256-q_stage1-varlen", "d192v128-q_stage1-varlen-seqused_k"])
@pytest.mark.parametrize("tiles,partial", PARTIAL_SETS, ids=[f"{t}-{p}" for t, p in PARTIAL_SETS])
def test_v_tail_zeroing_terminates_without_lapping(hd, layout, tiles, partial):
    """Ragged configs (v_tail in pipeline_specs): with partial key-edge blocks (the load warp waits for
    that V, zeroes it, signals v_tail; the MMA waits before the first PV and acknowledges), every
    interleaving terminates, no wait laps, the zeroing happens after the V landed and before its
    release, and every partial tile's first PV reads its zeroed V. v_tail completes once per partial
    tile on each side."""
    cfg = dataclasses.replace(select_fwd_config(hd, "bf16", hd == 64, headdim_v=128 if hd == 192 else None), **layout)
    for seed in range(40):
        model = run(cfg, tiles, seed, partial=partial, delay_tma=seed % 2 == 1)
    check_counts(cfg, model, tiles)
    cut = sum(1 for n, c in zip(tiles, partial) if n and c)
    assert model.bars[(0, "v_tail", "full", 0)].completed == cut
    assert model.bars[(0, "v_tail", "empty", 0)].completed == cut


def test_v_tail_model_finds_its_faults():
    """Sanity of the ragged model: zeroing before the V landed (with TMA bytes landing late) and an MMA
    that does not wait for the zeroing are each caught in some interleaving."""
    cfg64 = dataclasses.replace(select_fwd_config(64), varlen_q=True, varlen_k=True)
    tiles, partial = [1] * 8, [1] * 8
    with pytest.raises(AssertionError, match="before its TMA landed"):
        for seed in range(40):
            run(cfg64, tiles, seed, partial=partial, load_bug="no_landed_wait", delay_tma=True)
    with pytest.raises(AssertionError):
        for seed in range(40):
            run(cfg64, tiles, seed, partial=partial, mma_bug="no_v_tail_wait")


def test_v_tail_empty_wait_is_a_second_guard():
    """The load warp's wait on v_tail's empty side (the MMA's acknowledgement of the previous signal)
    is not what prevents lapping today: the load warp reaches the next tile's V only after acquiring
    its Q stages, which the MMA releases after it passed this tile's v_tail wait. The model shows the
    protocol holding without it (hd64, 10 K/V stages, one-block tiles: the loosest ring); the kernel
    keeps the wait (one try_wait per partial tile) so a future Q-ring change cannot lap v_tail."""
    cfg64 = dataclasses.replace(select_fwd_config(64), varlen_q=True, varlen_k=True)
    for seed in range(40):
        run(cfg64, [1] * 8, seed, partial=[1] * 8, load_bug="no_empty_wait", delay_tma=seed % 2 == 1)
