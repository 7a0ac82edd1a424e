"""A model of the sm100 backward's warp-role protocol (1-CTA and the 2-CTA pair), run on the CPU, as
tests/cpu/test_sm100_protocol.py does for the forward: each role is a generator of mbarrier waits and
arrivals written after its code in flash4/kernels/sm100/bwd.py (same order, same phase bits), the
barriers take their counts from flash4.kernels.sm100.bwd_plan.bwd_pipeline_specs, and a scheduler
runs the roles in many random interleavings. Checked: every interleaving terminates (no deadlock),
every barrier ends on a completed phase, no wait is satisfied by a later phase than it meant (no
lapping), and the TMEM overwrites the 2-CTA schedule relies on happen after the reads they must
follow (S(i+1) after dQ(i-1) was read out, dQ(i) after S(i+1) was read and dQ(i-1) read out), and
those of the serial 1-CTA schedule of (192, 128) (S(i) after dQ(i-1) was read out, dP(i) after
S(i) was read), and the two passes of hd256 (bwd_pass "dv": S^T and dV only; "dkdq": dP^T over the
V / dO chunks of the do ring, dQ over S and dP: S(i) and dP(i) after dQ(i-1) was read out, dQ(i)
after S(i) was read), with and without softcap (whose LSE stage pass dv releases after P^T), and the
serial 2-CTA pair of (192, 128) (Q / Q^T and dO / dO^T through one ring each: two uses per step; S(i)
after dQ(i-1) was read out in both CTAs, dP(i) after S(i) was read, dQ(i) after S(i) was read).

2-CTA routing (as the kernel's pipelines): tcgen05.commit is the leader's and multicast to both CTAs;
the TMA pipelines' expect_tx is the leader's, each CTA's bytes complete on the leader's barrier;
LSE / dPsum are CTA-local; thread parties marked to_leader arrive on the leader's barrier; dsx is
armed (expect_tx) and completed (DSMEM copy) by the peer CTA's compute thread on this CTA's barrier;
the relay arrives on the leader's. It checks intent, not the compiled code; MMAs, copies and commits
complete at once here. Not modelled: the cluster launch and init handshake, the TMEM dealloc
handshake, the named barriers inside a role.
"""

import random

import pytest

from flash4.config import sm100
from flash4.kernels.sm100.bwd_plan import (BWD_VDO_COLS, _arrivals, bwd_pass, bwd_pipeline_specs, bwd_serial_schedule,
                                           bwd_two_cta_serial, bwd_two_cta_shared_rings)
from flash4.kernels.sm100.plan import Signal
from test_sm100_protocol import LEADER, A, Barrier, Ring, W

CTA_LOCAL_TMA = ("lse", "dpsum")


class Model:
    def __init__(self, cfg, count_group=None):
        self.specs = bwd_pipeline_specs(cfg)
        self.group = cfg.cta_group
        g = self.group if count_group is None else count_group
        self.bars = {}
        for cta in range(self.group):
            for spec in self.specs.values():
                for s in range(spec.stages):
                    for side, count in (("full", spec.full_arrivals(g)), ("empty", spec.empty_arrivals(g))):
                        self.bars[(cta, spec.name, side, s)] = Barrier(f"cta{cta}.{spec.name}.{side}[{s}]", count)
        # TMEM reads done, per CTA: S^T loads by the compute warps, dQ read-outs by the reduce warps
        self.s_read = [0] * self.group
        self.dq_read = [0] * self.group
        self.serial = bwd_serial_schedule(cfg)  # (192, 128): dQ over S and dP, dP over S's tail
        self.dkdq = bwd_pass(cfg) == "dkdq"  # hd256 pass dkdq: dQ over S and dP, dP clear of S
        self.serial2 = bwd_two_cta_serial(cfg)  # (192, 128) pair: dQ over S's tail and dP, dP over S's tail

    def party(self, name, side, role):
        spec = self.specs[name]
        return next(p for p in (spec.producers if side == "full" else spec.consumers) if p.role == role)

    def apply_arrive(self, cta, op):
        _, name, side, stage, role, k = op
        party = self.party(name, side, role)
        if party.signal is Signal.TMA:
            if name == "dsx":  # the peer's compute thread arms this CTA's barrier, its DSMEM copy completes it
                bar = self.bars[(cta ^ 1, name, side, stage)]
                assert bar.completed == k, f"cta{cta} dS half into {bar.name} for completion {k + 1}, found {bar.completed}"
                bar.arrive(1, expect_tx=1)
                bar.complete_tx(1)
                return
            if self.group == 1 or name in CTA_LOCAL_TMA:
                bar = self.bars[(cta, name, side, stage)]
                bar.arrive(1, expect_tx=1)
                bar.complete_tx(1)
                return
            bar = self.bars[(LEADER, name, side, stage)]
            assert bar.completed == k, f"cta{cta} TMA into {bar.name} for completion {k + 1}, found {bar.completed}"
            if cta == LEADER:
                bar.arrive(1, expect_tx=self.group)
            bar.complete_tx(1)
        elif party.signal is Signal.COMMIT:
            assert cta == LEADER, "only the leader CTA issues MMAs and commits"
            for c in range(self.group):
                self.bars[(c, name, side, stage)].arrive(1)
        else:
            self.bars[(LEADER if party.to_leader else cta, name, side, stage)].arrive(_arrivals(party, 1))

    def apply_event(self, cta, op, n):
        """A TMEM read done, or an MMA about to write TMEM: check what it overwrites was read."""
        _, what, i = op
        if what == "S read":
            self.s_read[cta] += 1
        elif what == "dQ read":
            self.dq_read[cta] += 1
        elif self.serial2:  # both CTAs' TMEM: S(i) and dP(i) over dQ(i-1), dP(i) and dQ(i) over S(i)'s tail
            if what in ("S", "dP", "dQ"):
                assert all(r >= i for r in self.dq_read), f"{what}({i}) issued before dQ({i - 1}) was read"
            if what in ("dP", "dQ"):
                assert all(r >= i + 1 for r in self.s_read), f"{what}({i}) issued before S({i}) was read: {self.s_read}"
        elif what == "S" and self.group == 2:  # S(i) over dQ(i-2)'s columns
            assert all(r >= i - 1 for r in self.dq_read), f"S({i}) issued before dQ({i - 2}) was read: {self.dq_read}"
        elif what == "dQ" and self.group == 2:  # dQ(i) over S(i+1)'s tail and over dQ(i-1)
            if i + 1 < n:
                assert all(r >= i + 2 for r in self.s_read), f"dQ({i}) issued before S({i + 1}) was read: {self.s_read}"
            assert all(r >= i for r in self.dq_read), f"dQ({i}) issued before dQ({i - 1}) was read: {self.dq_read}"
        elif what == "S" and self.serial:  # S(i) over dQ(i-1)
            assert all(r >= i for r in self.dq_read), f"S({i}) issued before dQ({i - 1}) was read"
        elif what == "dQ" and self.dkdq:  # dQ(i) over S(i) (and dP(i): read before dS(i) was written)
            assert all(r >= i + 1 for r in self.s_read), f"dQ({i}) issued before S({i}) was read"
        elif what == "dP" and self.dkdq:  # dP(i) over dQ(i-1) only (clear of S)
            assert all(r >= i for r in self.dq_read), f"dP({i}) issued before dQ({i - 1}) was read"
        elif what == "dP" and self.group == 1:  # dP(i) over dQ(i-1); serial: and over S(i)'s tail
            assert all(r >= i for r in self.dq_read), f"dP({i}) issued before dQ({i - 1}) was read"
            if self.serial:
                assert all(r >= i + 1 for r in self.s_read), f"dP({i}) issued before S({i}) was read"


def E(what, i=0):
    return ("event", what, i)


def acquire(name, ring):
    """producer_acquire of a TMA ring (the caller advances it)."""
    yield W(name, "empty", ring.index, ring.phase, ring.uses[ring.index] - 1)
    yield A(name, "full", ring.index, "load", ring.uses[ring.index])


def load(n, cfg):
    two, bpass, shared = cfg.cta_group == 2, bwd_pass(cfg), bwd_two_cta_shared_rings(cfg)
    kv, q, do = Ring(1, 1), Ring(cfg.q_stages, 1), Ring(cfg.do_stages, 1)
    lse, dps, qt = Ring(cfg.q_stages, 1), Ring(cfg.do_stages, 1), Ring(cfg.q_stages, 1)
    if n > 0:
        yield from acquire("kv", kv)
        kv.advance()
        for _ in range(n):
            yield from acquire("q", q)
            yield from acquire("lse", lse)
            q.advance()
            lse.advance()
            if bpass == "dkdq":  # a chunk of V and of dO per stage of the do ring, then dPsum (its own ring)
                for _ in range(cfg.hdim_v // BWD_VDO_COLS):
                    yield from acquire("do", do)
                    do.advance()
                yield from acquire("dpsum", dps)
                dps.advance()
                continue
            yield from acquire("do", do)
            if bpass != "dv":  # pass dv: no dPsum
                yield from acquire("dpsum", dps)
            do.advance()
            dps.advance()
            if shared:  # (192, 128) pair: Q^T into the q stage, dO^T into the do stage (load_2cta)
                yield from acquire("q", q)
                q.advance()
                yield from acquire("do", do)
                do.advance()
            elif two:
                yield from acquire("qt", qt)
                qt.advance()
    tails = (("q", q), ("qt", qt), ("do", do)) if two and not shared else (("q", q), ("do", do))
    for name, ring in tails:  # producer_tail
        for _ in range(ring.stages):
            yield W(name, "empty", ring.index, ring.phase, ring.uses[ring.index] - 1)
            ring.advance()


def full(name, ring):
    return W(name, "full", ring.index, ring.phase, ring.uses[ring.index])


def mma_1cta(n, cfg):
    q, do = Ring(cfg.q_stages, 0), Ring(cfg.do_stages, 0)
    dq_phase = 0
    if n == 0:
        return
    yield W("kv", "full", 0, 0, 0)
    yield full("q", q)
    yield E("S", 0)
    yield A("s", "full", 0, "mma")
    yield full("do", do)
    yield E("dP", 0)
    yield A("dp", "full", 0, "mma")
    for i in range(n):
        yield W("s", "empty", 0, i % 2, i)
        yield A("do", "empty", do.index, "mma")
        do.advance()
        q_index = q.index
        q.advance()  # q_next
        if i + 1 < n:
            yield full("q", q)
            yield E("S", i + 1)
            yield A("s", "full", 0, "mma")
        yield W("ds", "full", 0, i % 2, i)
        yield A("q", "empty", q_index, "mma")
        yield E("dQ", i)
        yield A("dq", "full", 0, "mma")
        yield A("ds", "empty", 0, "mma")
        if i + 1 < n:
            yield full("do", do)
            yield W("dq", "empty", 0, dq_phase, i)
            dq_phase ^= 1
            yield E("dP", i + 1)
            yield A("dp", "full", 0, "mma")
    yield A("dkv", "full", 0, "mma")


def mma_serial(n, cfg, wait_dq=True):
    """The serial MMA warp ((192, 128) 1-CTA and the pair's leader, hd256's pass dkdq:
    FlashAttentionBackwardSm100.mma_serial). wait_dq False: a deliberate bug for the model's own test
    (S(i) without waiting for dQ(i-1)'s read-out)."""
    two = cfg.cta_group == 2
    q, do = Ring(cfg.q_stages, 0), Ring(cfg.do_stages, 0)
    if n == 0:
        return
    yield W("kv", "full", 0, 0, 0)
    for i in range(n):
        yield full("q", q)
        if i > 0 and wait_dq:
            yield W("dq", "empty", 0, (i - 1) % 2, i - 1)
        yield E("S", i)
        yield A("s", "full", 0, "mma")
        if two:  # the pair: Q read by S only; the stage's next use is Q^T(i); dO, then dO^T(i) in the do stage
            yield A("q", "empty", q.index, "mma")
            q.advance()
            yield full("do", do)
            yield W("s", "empty", 0, i % 2, i)
            yield E("dP", i)
            yield A("dp", "full", 0, "mma")
            yield A("do", "empty", do.index, "mma")
            do.advance()
            yield full("do", do)
            yield A("do", "empty", do.index, "mma")  # after dV
            do.advance()
            yield W("dp", "empty", 0, i % 2, i)  # dS^T(i) in TMEM, both CTAs
            yield full("q", q)  # Q^T(i)
            yield A("q", "empty", q.index, "mma")  # after dK
            q.advance()
            yield W("ds", "full", 0, i % 2, i)
            yield W("relay", "full", 0, i % 2, i)
            yield E("dQ", i)
            yield A("dq", "full", 0, "mma")
            yield A("ds", "empty", 0, "mma")
            continue
        if bwd_pass(cfg) == "dkdq":  # dP^T over the chunks (clear of S: no s wait), each released by a commit
            yield E("dP", i)
            for _ in range(cfg.hdim_v // BWD_VDO_COLS):
                yield full("do", do)
                yield A("do", "empty", do.index, "mma")
                do.advance()
            yield A("dp", "full", 0, "mma")
            yield W("s", "empty", 0, i % 2, i)  # S^T(i) read: dQ(i) overwrites it
        else:
            yield full("do", do)
            yield W("s", "empty", 0, i % 2, i)
            yield E("dP", i)
            yield A("dp", "full", 0, "mma")
            yield A("do", "empty", do.index, "mma")  # after dV
            do.advance()
        yield W("ds", "full", 0, i % 2, i)
        yield A("q", "empty", q.index, "mma")  # after dK
        q.advance()
        yield E("dQ", i)
        yield A("dq", "full", 0, "mma")
        yield A("ds", "empty", 0, "mma")
    yield A("dkv", "full", 0, "mma")


def mma_2cta(n, cfg):
    """The leader's MMA warp (FlashAttentionBackwardSm100.mma_2cta)."""
    q, qt, do = Ring(cfg.q_stages, 0), Ring(cfg.q_stages, 0), Ring(cfg.do_stages, 0)
    dq_phase, dq_round = 0, 0
    if n == 0:
        return
    yield W("kv", "full", 0, 0, 0)
    yield full("q", q)
    yield E("S", 0)
    yield A("s", "full", 0, "mma")
    yield A("q", "empty", q.index, "mma")
    q.advance()
    yield full("do", do)
    yield A("dp", "full", 0, "mma")
    for i in range(n):
        yield W("s", "empty", 0, i % 2, i)
        yield A("do", "empty", do.index, "mma")
        do.advance()
        yield W("dp", "empty", 0, i % 2, i)
        yield full("qt", qt)
        yield A("qt", "empty", qt.index, "mma")
        qt.advance()
        if i + 1 < n:
            yield full("q", q)
            if i > 0:
                yield W("dq", "empty", 0, dq_phase, dq_round)
                dq_phase, dq_round = dq_phase ^ 1, dq_round + 1
            yield E("S", i + 1)
            yield A("s", "full", 0, "mma")
            yield A("q", "empty", q.index, "mma")
            q.advance()
            yield full("do", do)
            yield A("dp", "full", 0, "mma")
        elif i > 0:
            yield W("dq", "empty", 0, dq_phase, dq_round)
            dq_phase, dq_round = dq_phase ^ 1, dq_round + 1
        yield W("ds", "full", 0, i % 2, i)
        yield W("relay", "full", 0, i % 2, i)
        yield E("dQ", i)
        yield A("dq", "full", 0, "mma")
        yield A("ds", "empty", 0, "mma")
    yield A("dkv", "full", 0, "mma")


def compute(n, cfg, early_ds=True, dv_lse_after_p=True):
    """Both compute warpgroups of one CTA (one generator: the named barriers between them are inside
    it). early_ds False: a deliberate 2-CTA bug for the model's own test (the ds arrive at the end of
    the step, as 1-CTA, before S(i+1) was read). dv_lse_after_p False: a deliberate bug (pass dv with
    softcap keeping the one-kernel rule: its LSE stage released after a dS it never computes)."""
    two, dv_pass = cfg.cta_group == 2, bwd_pass(cfg) == "dv"
    lse, dps = Ring(cfg.q_stages, 0), Ring(cfg.do_stages, 0)
    for i in range(n):
        yield full("lse", lse)
        yield W("s", "full", 0, i % 2, i)
        yield E("S read", i)
        if two and early_ds and i > 0:
            yield A("ds", "full", 0, "compute")  # dS(i-1) in smem, S(i) read
        yield A("s", "empty", 0, "compute")  # P(i) written
        if not cfg.softcap or (dv_pass and dv_lse_after_p):
            yield A("lse", "empty", lse.index, "compute")
            lse.advance()
        if dv_pass:  # P^T only: no dPsum, dP^T, dS^T
            continue
        yield full("dpsum", dps)
        yield W("dp", "full", 0, i % 2, i)
        yield W("ds", "empty", 0, (i + 1) % 2, i - 1)
        if two:
            yield A("dp", "empty", 0, "compute")  # dS(i) in TMEM
            yield A("dsx", "full", 0, "compute", i)  # the peer's half of dS(i), over DSMEM
            if not early_ds:
                yield A("ds", "full", 0, "compute")
        else:
            yield A("ds", "full", 0, "compute")
        yield A("dpsum", "empty", dps.index, "compute")
        dps.advance()
        if cfg.softcap:  # dS read the LSE too: released after dS
            yield A("lse", "empty", lse.index, "compute")
            lse.advance()
    if two and early_ds and n > 0:
        yield A("ds", "full", 0, "compute")
    if n > 0:
        yield W("dkv", "full", 0, 0, 0)


def reduce(n, cfg):
    if bwd_pass(cfg) == "dv":  # no dQ in pass dv: the reduce warps idle
        return
    for i in range(n):
        yield W("dq", "full", 0, i % 2, i)
        yield E("dQ read", i)
        yield A("dq", "empty", 0, "reduce")


def mma_dv_pass(n, cfg):
    """The MMA warp of hd256's pass dv (FlashAttentionBackwardSm100.mma_dv_pass): S(i) over P^T(i-1),
    which dV(i-1) (issued before it, in-order tcgen05) read."""
    q, do = Ring(cfg.q_stages, 0), Ring(cfg.do_stages, 0)
    if n == 0:
        return
    yield W("kv", "full", 0, 0, 0)
    for i in range(n):
        yield full("q", q)
        yield E("S", i)
        yield A("s", "full", 0, "mma")
        yield A("q", "empty", q.index, "mma")
        q.advance()
        yield full("do", do)
        yield W("s", "empty", 0, i % 2, i)  # P^T(i) written
        yield A("do", "empty", do.index, "mma")  # after dV
        do.advance()
    yield A("dkv", "full", 0, "mma")


def relay(n, cfg):
    for i in range(n):
        yield W("dsx", "full", 0, i % 2, i)
        yield A("relay", "full", 0, "relay")


def run(cfg, n, seed, roles_override=None, count_group=None, model_cls=None):
    model = (model_cls or Model)(cfg, count_group)
    roles = {}
    for cta in range(cfg.cta_group):
        roles[(cta, "load")] = load(n, cfg)
        if cta == LEADER:
            roles[(cta, "mma")] = (mma_serial if bwd_two_cta_serial(cfg) else mma_2cta if cfg.cta_group == 2
                                   else mma_dv_pass if bwd_pass(cfg) == "dv"
                                   else mma_serial if bwd_serial_schedule(cfg) else mma_1cta)(n, cfg)
        # the serial pair arrives ds at the end of the step (dQ(i) waits for no S^T(i+1) read)
        roles[(cta, "compute")] = compute(n, cfg, early_ds=not bwd_two_cta_serial(cfg))
        roles[(cta, "reduce")] = reduce(n, cfg)
        if cfg.cta_group == 2:
            roles[(cta, "relay")] = relay(n, cfg)
    roles.update(roles_override or {})
    current = {}
    for key, gen in roles.items():
        try:
            current[key] = next(gen)
        except StopIteration:
            pass
    rng = random.Random(seed)
    while current:
        runnable = []
        for key, op in current.items():
            if op[0] in ("arrive", "event"):
                runnable.append(key)
            else:
                _, bname, side, stage, parity, k = op
                bar = model.bars[(key[0], bname, side, stage)]
                if k < 0 or bar.passes(parity):
                    runnable.append(key)
        assert runnable, f"deadlock: every role waits: {current}"
        key = runnable[rng.randrange(len(runnable))]
        op = current[key]
        if op[0] == "arrive":
            model.apply_arrive(key[0], op)
        elif op[0] == "event":
            model.apply_event(key[0], op, n)
        else:
            _, bname, side, stage, parity, k = op
            bar = model.bars[(key[0], bname, side, stage)]
            if k >= 0:
                assert bar.completed == k + 1, f"{key} waited on {bar.name} for completion {k + 1}, found {bar.completed}"
        try:
            current[key] = next(roles[key])
        except StopIteration:
            del current[key]
    for (cta, name, side, stage), bar in model.bars.items():
        assert bar.pending == 0 and bar.tx == 0, f"{bar.name}: {bar.pending} arrivals / {bar.tx} tx left in a phase"
        if side == "empty" and not model.specs[name].waited_empty:
            assert bar.completed == 0, bar.name
    return model


STEPS = [0, 1, 2, 3, 5]
CONFIGS = {"1cta": sm100.select_bwd_config(128), "1cta-softcap": sm100.select_bwd_config(128, softcap=True),
           "2cta": sm100.select_bwd_config(128, two_cta=True),
           "2cta-causal": sm100.select_bwd_config(128, causal=True, two_cta=True),
           "2cta-softcap": sm100.select_bwd_config(128, softcap=True, two_cta=True),
           "2cta-serial": sm100.select_bwd_config(192, headdim_v=128, two_cta=True),
           "2cta-serial-causal-softcap": sm100.select_bwd_config(192, causal=True, softcap=True, headdim_v=128,
                                                                 two_cta=True),
           "serial": sm100.select_bwd_config(192, headdim_v=128),
           "serial-causal-det": sm100.select_bwd_config(192, causal=True, deterministic=True, headdim_v=128),
           "d256-dv": sm100.select_bwd_config(256, bwd_pass="dv"),
           "d256-dv-softcap": sm100.select_bwd_config(256, softcap=True, bwd_pass="dv"),
           "d256-dkdq": sm100.select_bwd_config(256, bwd_pass="dkdq"),
           "d256-dkdq-softcap": sm100.select_bwd_config(256, causal=True, softcap=True, bwd_pass="dkdq")}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("n", STEPS)
def test_protocol_terminates_without_lapping(name, n):
    cfg = CONFIGS[name]
    for seed in range(60):
        model = run(cfg, n, seed)
    # every phase the spec counts happened: n steps of the per-step pipelines in every CTA
    for cta in range(cfg.cta_group):
        if bwd_pass(cfg) != "dv":  # pass dv has no dq pipeline
            assert model.bars[(cta, "dq", "full", 0)].completed == n
        assert model.bars[(cta, "s", "full", 0)].completed == n
        assert sum(model.bars[(cta, "lse", "empty", s)].completed for s in range(cfg.q_stages)) == n
        if bwd_pass(cfg) == "dkdq":  # every V / dO chunk through the one-stage do ring
            assert model.bars[(cta, "do", "full", 0)].completed == n * (cfg.hdim_v // BWD_VDO_COLS)
        if cfg.cta_group == 2:
            assert model.bars[(cta, "dsx", "full", 0)].completed == n
    if cfg.cta_group == 2:
        assert model.bars[(LEADER, "relay", "full", 0)].completed == n
        assert model.bars[(LEADER, "ds", "full", 0)].completed == n
        assert model.bars[(1, "ds", "full", 0)].completed == 0  # the follower's: never used


def test_the_pair_model_finds_one_cta_counts():
    """The pair with 1-CTA counts on its barriers (the leader's thread-side barriers then complete on
    one CTA's arrivals): it hangs or laps."""
    with pytest.raises(AssertionError, match="deadlock|arrivals > count|for completion"):
        for seed in range(20):
            run(CONFIGS["2cta"], 3, seed, count_group=1)


def test_the_pair_model_finds_a_late_ds_arrive():
    """The 1-CTA ds arrive (end of the step) in a pair lets dQ(i) overwrite S(i+1) before it is read."""
    cfg = CONFIGS["2cta"]
    with pytest.raises(AssertionError, match=r"dQ\(\d\) issued before S\(\d\) was read"):
        for seed in range(60):
            run(cfg, 3, seed, {(c, "compute"): compute(3, cfg, early_ds=False) for c in (0, 1)})


def test_the_serial_pair_model_finds_the_pipelined_ds_arrive():
    """The pipelined pair's ds arrive (step i's after S^T(i+1) was read) in the serial pair: S(i+1)
    waits for dQ(i)'s read-out, dQ(i) for that arrive: a deadlock."""
    cfg = CONFIGS["2cta-serial"]
    with pytest.raises(AssertionError, match="deadlock"):
        run(cfg, 2, 0, {(c, "compute"): compute(2, cfg, early_ds=True) for c in (0, 1)})


def test_the_serial_pair_model_finds_a_missing_dq_wait():
    """The serial pair's MMA warp issuing S(i) before both CTAs read dQ(i-1) out."""
    cfg = CONFIGS["2cta-serial"]
    with pytest.raises(AssertionError, match=r"S\(\d\) issued before dQ\(\d\) was read"):
        for seed in range(60):
            run(cfg, 3, seed, {(LEADER, "mma"): mma_serial(3, cfg, wait_dq=False)})


def test_the_pair_model_finds_a_relay_that_stays_local():
    """The follower's relay arriving on its own barrier: the leader's relay barrier never completes."""

    class LocalRelay(Model):
        def apply_arrive(self, cta, op):
            if op[1] == "relay" and cta != LEADER:
                self.bars[(cta, "relay", "full", 0)].arrive(1)
                return
            super().apply_arrive(cta, op)

    with pytest.raises(AssertionError, match="deadlock"):
        run(CONFIGS["2cta"], 2, 0, model_cls=LocalRelay)


def test_the_serial_model_finds_s_over_an_unread_dq():
    """The serial schedule ((192, 128)) without the dq empty wait before S(i): S(i) lands on dQ(i-1)
    before the reduce warps read it."""
    cfg = CONFIGS["serial"]
    assert cfg.q_stages == 1
    with pytest.raises(AssertionError, match=r"S\(\d\) issued before dQ\(\d\) was read"):
        for seed in range(60):
            run(cfg, 3, seed, {(0, "mma"): mma_serial(3, cfg, wait_dq=False)})


def test_the_pass_model_finds_a_dv_pass_holding_its_lse():
    """hd256 pass dv with softcap keeping the one-kernel rule (the LSE stage released after dS, which
    this pass never computes): the load warp waits forever for the LSE stage of step 2 (one Q stage)."""
    cfg = CONFIGS["d256-dv-softcap"]
    assert cfg.q_stages == 1
    with pytest.raises(AssertionError, match="deadlock"):
        run(cfg, 3, 0, {(0, "compute"): compute(3, cfg, dv_lse_after_p=False)})


def test_the_pass_model_finds_s_over_an_unread_dq():
    """hd256 pass dkdq without the dq empty wait before S(i): S(i) (and dP(i)) land on dQ(i-1), which
    spans S and dP, before the reduce warps read it. (Its s empty wait before dQ(i) is implied by the
    ds wait: dS(i) is written after S^T(i) was read, so dropping it breaks nothing here.)"""
    cfg = CONFIGS["d256-dkdq"]
    with pytest.raises(AssertionError, match=r"(S|dP)\(\d\) issued before dQ\(\d\) was read"):
        for seed in range(60):
            run(cfg, 3, seed, {(0, "mma"): mma_serial(3, cfg, wait_dq=False)})
