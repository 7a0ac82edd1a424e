"""Compile check of the sm100 forward on the CPU (no GPU; the kernel has never run on hardware):
every shipped config builds for sm_100a, and its PTX and SASS show the design -- tcgen05 MMAs
(.2CTA exactly in the 2-CTA configs), commits, TMEM loads/stores, TMA, the TMEM allocation of tmem_map, the setmaxnreg budgets of
register_plan -- with no Hopper opcodes, no local memory and a stack of 0. PTX and SASS counts of
the tcgen05 instructions must agree (BLACKWELL.md section 3)."""

import dataclasses
import re
import time
import types

import pytest

pytest.importorskip("cutlass")

from flash4.compile.check import extract_cubin, resource_usage  # noqa: E402
from flash4.config.sm100 import (pipeline_specs, register_plan, select_fwd_config,  # noqa: E402
                                 shipped_fwd_configs, tmem_alloc_cols)
from flash4.kernels.sm100.pipes import ArrivalLedger, check_init_counts  # noqa: E402

# The 12 base configs, and one or two of each feature's (bf16; the feature adds const_expr code only
# where its flag is on, so the other dtype and head dims add nothing a compile gate would see).
# (select_fwd_config's keywords, then the sequence-layout fields the host sets with dataclasses.replace)
FEATURES = [(dict(softcap=True), {}), (dict(sink=True), {}), (dict(local=True), {}),
            ({}, dict(varlen_q=True, varlen_k=True, seqused_q=True)),
            # ragged keys with seqused_k: dense batches (the V-tail zeroing's own config class)
            ({}, dict(seqused_k=True))]
# shipped_fwd_configs(features=False) ends with the 2-CTA configs (hd128 non-causal, bf16 / fp16) and the
# q_stage 1 configs ((192, 128) and hd256 x bf16 / fp16 x causal / not); one 2-CTA feature config
# (softcap + sink) and two q_stage 1 feature configs follow.
CONFIGS = shipped_fwd_configs(features=False) + [
    dataclasses.replace(select_fwd_config(hd, "bf16", causal, **selected), **layout)
    for selected, layout in FEATURES for hd, causal in ((128, True), (64, False))] + [
    select_fwd_config(128, "bf16", False, softcap=True, sink=True, two_cta=True)] + [
    # q_stage 1 with features: hd256 (Gemma's head dim) with every feature, (192, 128) with softcap
    select_fwd_config(256, "bf16", True, local=True, softcap=True, sink=True),
    select_fwd_config(192, "bf16", False, softcap=True, sink=True, headdim_v=128)] + [
    # packed varlen + seqused_k at hd96 fp16 with a window, softcap and sink (ragged keys, every feature)
    dataclasses.replace(select_fwd_config(96, "fp16", True, local=True, softcap=True, sink=True),
                        varlen_q=True, varlen_k=True, seqused_k=True)] + [
    # q_stage 1 with packed sequences (late_sched: each role builds its tile schedule after setmaxnreg):
    # hd256 causal with seqused_q, hd256 fp16 with every feature and seqused_k, (192, 128) with seqused_k
    dataclasses.replace(select_fwd_config(256, "bf16", True), varlen_q=True, varlen_k=True, seqused_q=True),
    dataclasses.replace(select_fwd_config(256, "fp16", False, local=True, softcap=True, sink=True),
                        varlen_q=True, varlen_k=True, seqused_k=True),
    dataclasses.replace(select_fwd_config(192, "bf16", True, headdim_v=128), varlen_q=True, varlen_k=True,
                        seqused_k=True)]
IDS = [f"d{c.headdim}" + (f"v{c.headdim_v}" if c.headdim_v else "") + f"-{c.dtype}-{'causal' if c.causal else 'full'}" + ("-2cta" if c.cta_group == 2 else "")
       + ("-softcap" if c.softcap else "") + ("-sink" if c.sink else "") + ("-local" if c.local else "")
       + ("-varlen" if c.varlen_q else "") + ("-seqused_k" if c.seqused_k else "") for c in CONFIGS]
# CPU seconds of one cold compile (trace + MLIR + ptxas, one core). Measured 3.5-4.9 s on the 2-core
# CI box; the target is 5 s, the assert leaves room for a loaded machine.
COMPILE_CPU_LIMIT_S = 10.0


def ptx_counts(ptx: str) -> dict:
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return {
        "mma": count(r"\btcgen05\.mma\b"), "commit": count(r"\btcgen05\.commit\b"),
        "ld": count(r"\btcgen05\.ld\b"), "st": count(r"\btcgen05\.st\b"),
        "alloc_dealloc_relinquish": count(r"\btcgen05\.(alloc|dealloc|relinquish_alloc_permit)\b"),
        "cta_group_2": count(r"cta_group::2"),
        "mma_2cta": count(r"\btcgen05\.mma\.cta_group::2\b"),
        "commit_2cta_multicast": count(r"\btcgen05\.commit\.cta_group::2\.[\w:.]*multicast"),
    }


def setmaxnreg(ptx: str) -> list:
    return sorted((kind, int(n)) for kind, n in re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))


def alloc_columns(ptx: str) -> list:
    """Column operand of every tcgen05.alloc (an immediate moved into the register it names)."""
    cols = []
    for reg in re.findall(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+);", ptx):
        cols += [int(v) for v in re.findall(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)]
    return cols


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each shipped config compiled once: {id: (cfg, cpu seconds, ptx, sass row)}."""
    from flash4.compile.cache import compile_fwd

    out = {}
    dump = tmp_path_factory.mktemp("sm100")
    for cfg, name in zip(CONFIGS, IDS):
        t0 = time.process_time()
        compiled = compile_fwd(cfg, options=f" --keep-ptx --keep-cubin --dump-dir {dump}")
        cpu_s = time.process_time() - t0
        cubin = extract_cubin(compiled)
        out[name] = (cfg, cpu_s, compiled.__ptx__, resource_usage(cubin) if cubin is not None else {})
    return out


@pytest.mark.parametrize("name", IDS)
def test_compiles_for_sm100a(built, name):
    cfg, cpu_s, ptx, _ = built[name]
    assert ".target sm_100a" in ptx
    assert cpu_s < COMPILE_CPU_LIMIT_S, f"{name}: {cpu_s:.1f} s CPU to compile"


@pytest.mark.parametrize("name", IDS)
def test_sass_gates(built, name):
    cfg, _, ptx, row = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    hd = cfg.headdim
    # one code site per MMA of the MMA warp (the Q tile is a loop index): QK^T in the prologue and the
    # key-block loop (hd / 16 MMAs each), PV in the loop and the tail (tile_n / 16 each)
    assert row["utchmma"] == 2 * hd // 16 + 2 * cfg.tile_n // 16, row
    # commit sites: S ready x2, O final x1, Q releases x q_stage (unrolled), K/V releases x4
    assert row["utcbar"] == 7 + cfg.q_stage
    assert row["ldtm"] > 0 and row["sttm"] > 0
    assert row["utmaldg"] > 0
    # O: one TMA store per Q tile (dense), or row-by-row stores below seqlen_q (packed varlen)
    assert (row["utmastg"] > 0) == (not cfg.varlen_q)
    assert row["utcatomsws"] == 3  # alloc, relinquish, dealloc
    if cfg.cta_group == 2:
        # every MMA .cta_group::2 (no plain UTCHMMA), every commit multicast to the pair, every TMA
        # load .2CTA (completing on the leader's barrier), the TMEM allocation .2CTA: the alloc's
        # two FIND_AND_SET sites (the dealloc's UTCATOMSWS.AND has no suffix, as in FA4's 2-CTA SASS)
        assert row["utchmma_2cta"] == row["utchmma"], row
        assert row["utcbar_2cta_multicast"] == row["utcbar"], row
        assert row["utmaldg_2cta"] == row["utmaldg"], row
        assert row["utcatomsws_2cta"] == 2, row
    else:
        assert row["utchmma_2cta"] == row["utcbar_2cta_multicast"] == row["utmaldg_2cta"] == 0
        assert row["utcatomsws_2cta"] == 0
    assert row["hgmma"] == 0
    assert row["spills"] == 0, f"{name}: {row['spills']} LDL/STL"
    assert row["stack_bytes"] == 0
    assert row["registers"] == 128  # the launch cap 65536 / 512; the budgets are setmaxnreg's
    assert row["mufu_ex2"] > 0 and row["ffma2"] > 0  # exp2 on MUFU, the scale-subtract on packed FMAs


def exp2_sites(cfg) -> dict:
    """The static exp2 sites the plan predicts. The softmax step is traced once per block kind (the
    first block, masked; the unmasked loop; causal: the diagonal loop), each over the 128 columns of
    a row: per body 64 scale-subtract FFMA2, and per emulated pair (exp2_emu_frac of the 64 pairs) 3
    Horner FFMA2 and 1 FADD2.RM instead of 2 MUFU.EX2. Besides, one MUFU.EX2 per non-first body for
    the O factor, and two in the finalize of a sink config (the sink's term and the row's shift)."""
    bodies = 3 if cfg.causal and not cfg.local else 2  # a window: the first block, then one masked loop
    pairs = round(cfg.tile_n // 2 * cfg.exp2_emu_frac)
    return {"mufu_ex2": bodies * (cfg.tile_n - 2 * pairs) + bodies - 1 + (2 if cfg.sink else 0),
            "ffma2": bodies * (cfg.tile_n // 2 + 3 * pairs), "fadd2_rm": bodies * pairs,
            "mufu_tanh": bodies * cfg.tile_n if cfg.softcap else 0}


@pytest.mark.parametrize("name", IDS)
def test_exp2_mix_gate(built, name):
    """FA4's exp2 emulation is in the SASS: MUFU.EX2 reduced by the planned share (the static sites of
    the MUFU-only kernel, 257 non-causal / 386 causal, minus the emulated pairs), the polynomial's
    packed FMAs (FFMA2) and its round-down packed add (FADD2.RM) present in the planned numbers."""
    cfg, _, _, row = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    assert cfg.exp2_emu_frac > 0
    want = exp2_sites(cfg)
    assert {k: row[k] for k in want} == want, (name, row)
    mufu_only = exp2_sites(dataclasses.replace(cfg, exp2_emu_frac=0.0))
    causal_loops = cfg.causal and not cfg.local
    assert mufu_only["mufu_ex2"] == (386 if causal_loops else 257) + 2 * cfg.sink and mufu_only["fadd2_rm"] == 0
    saved = mufu_only["mufu_ex2"] - row["mufu_ex2"]
    assert saved == (3 if causal_loops else 2) * round(cfg.tile_n * cfg.exp2_emu_frac) > 0


@pytest.mark.parametrize("name", IDS)
def test_ptx_counts_equal_sass_counts(built, name):
    _, _, ptx, row = built[name]
    if not row:
        pytest.skip("cuobjdump not installed: SASS not checked")
    cfg = built[name][0]
    p = ptx_counts(ptx)
    if cfg.cta_group == 2:
        assert p["mma_2cta"] == p["mma"] and p["commit_2cta_multicast"] == p["commit"] > 0
    else:
        assert p["cta_group_2"] == 0
    assert (p["mma"], p["commit"], p["ld"], p["st"], p["alloc_dealloc_relinquish"]) == (
        row["utchmma"], row["utcbar"], row["ldtm"], row["sttm"], row["utcatomsws"])


@pytest.mark.parametrize("name", IDS)
def test_v_tail_zeroing_in_ragged_configs(built, name):
    """Ragged keys (varlen_k / seqused_k): the load warp's V-tail zeroing is compiled in: its
    fence.proxy.async.shared::cta (the zeros before the MMA's async-proxy reads) next to the O
    epilogue's one, and its 16-byte shared stores (a whole (tile_n, dv) V stage over the warp's 32
    lanes, each predicated on its row); the other configs have the epilogue's fence only (their
    SASS is byte-identical to the kernel before the zeroing: docs/design/sm100_forward.md section 11)."""
    cfg, _, ptx, row = built[name]
    ragged = cfg.varlen_k or cfg.seqused_k
    assert len(re.findall(r"\bfence\.proxy\.async\.shared::cta\b", ptx)) == 1 + ragged
    zero_stores = cfg.tile_n * cfg.hdim_v * 2 // 16 // 32
    if ragged:
        assert len(re.findall(r"\bst\.shared\.v4\.", ptx)) >= zero_stores
        if row:
            assert row["spills"] == 0 and row["stack_bytes"] == 0


@pytest.mark.parametrize("name", IDS)
def test_setmaxnreg_and_tmem_allocation_match_the_plans(built, name):
    cfg, _, ptx, _ = built[name]
    plan = register_plan(cfg)
    assert setmaxnreg(ptx) == plan.setmaxnreg_sites()
    if cfg.q_stage == 2:  # the q_stage 2 kernels: softmax .inc, the rest .dec
        assert plan.setmaxnreg_sites() == sorted([("inc", plan.softmax), ("dec", plan.correction), ("dec", plan.other)])
    assert alloc_columns(ptx) == [tmem_alloc_cols(cfg)]


# ---------------------------------------------------------------- the arrive-count checks themselves
def _fake_pipe(full, empty):
    return types.SimpleNamespace(sync_object_full=types.SimpleNamespace(arrive_count=full),
                                 sync_object_empty=types.SimpleNamespace(arrive_count=empty))


def test_init_count_mismatch_is_an_error():
    spec = pipeline_specs(CONFIGS[0])["s_p_o"]
    check_init_counts(spec, _fake_pipe(1, 256))
    with pytest.raises(RuntimeError, match=r"\(full, empty\) = \(1, 128\).*= 256"):
        check_init_counts(spec, _fake_pipe(1, 128))


def test_ledger_flags_a_missing_or_extra_arrival():
    specs = pipeline_specs(CONFIGS[0])
    ledger = ArrivalLedger(specs)
    for name, spec in specs.items():
        for p in spec.producers:
            ledger.record(name, "full", p.role, p.signal)
        if spec.waited_empty:
            for p in spec.consumers:
                ledger.record(name, "empty", p.role, p.signal)
    ledger.check()
    ledger.seen[("s_p_o", "empty")].discard(("correction", specs["s_p_o"].consumers[1].signal))
    with pytest.raises(RuntimeError, match="s_p_o.empty"):
        ledger.check()
