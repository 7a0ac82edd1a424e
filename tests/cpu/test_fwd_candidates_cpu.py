"""Forward speed candidates of issue 26 on the CPU (docs/design/speed_candidates.md section 7):
the switches are off by default (shipped configs unchanged), each turns on only where it applies,
the KV-head L2 sections keep every tile exactly once and whole KV groups per section, the host
passes the larger section to the kernel, the candidate kernels compile for sm_90a without spills or
serialized wgmma (l2_kv_heads: the same cubin as off), and tools/ab_fwd.py's plan."""

import dataclasses
import os
import sys

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

from flash4.config import fwd_config  # noqa: E402
from flash4.config import sm90  # noqa: E402
from flash4.request import Request  # noqa: E402
from flash4.schedule import l2_section_heads, l2_section_pairs, tile_coords, tile_order  # noqa: E402


def dense(b=2, s=4096, h=16, hk=16, d=128, causal=False, window=(-1, -1)):
    q = torch.empty(b, s, h, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(b, s, hk, d, device="meta", dtype=torch.bfloat16)
    return Request.dense(q, k, torch.empty_like(k), d ** -0.5, causal, window, 0.0, None)


def varlen(total=4096, h=32, hk=8, d=128):
    q = torch.empty(total, h, d, device="meta", dtype=torch.bfloat16)
    k = torch.empty(total, hk, d, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(3, device="meta", dtype=torch.int32)
    return Request.varlen(q, k, torch.empty_like(k), cu, cu, 2048, 2048, softmax_scale=d ** -0.5, causal=True)


# ------------------------------------------------------------------------------- off by default
def test_switches_are_off_by_default():
    assert sm90.FWD_WIDE_TILE_N == {} and sm90.FWD_KV_STAGES == {} and sm90.FWD_L2_KV_HEADS is False
    for cfg in sm90.shipped_fwd_configs():
        assert not cfg.l2_kv_heads and cfg.kv_stages == 2 and "l2_kv_heads" not in repr(cfg)
    for req in (dense(), dense(s=1024), dense(causal=True), dense(h=32, hk=8, causal=True),
                dense(h=32, hk=1, d=64, causal=True), dense(d=96, causal=True)):
        cfg = fwd_config(req, 90).cfg
        d, causal = req.headdim, req.mask.causal
        expected = sm90.with_pack_gqa(sm90.select_fwd_config(d, "bf16", causal, seqlen_k=req.k.shape[1]),
                                      req.nheads, req.nheads_k)  # bf16 d64 causal GQA packs (pack_gqa_wanted)
        assert cfg == sm90.shipped_p_smem(expected), cfg  # d96: 192-row tiles, P through smem (2026-12-04)


def test_l2_kv_heads_needs_lpt():
    with pytest.raises(AssertionError):
        sm90.FwdConfig(headdim=128, l2_kv_heads=True)
    cfg = sm90.FwdConfig(headdim=128, causal=True, lpt=True, l2_kv_heads=True)
    assert "l2_kv_heads=True" in repr(cfg) and cfg != dataclasses.replace(cfg, l2_kv_heads=False)


# ------------------------------------------------------------------------- where each applies
def test_wide_tile_applies_to_plain_dense_only(monkeypatch):
    monkeypatch.setattr(sm90, "FWD_WIDE_TILE_N", {(128, False): 176, (96, True): 192})
    monkeypatch.setattr(sm90, "FWD_KV_STAGES", {(128, False): 3})
    # Q 32 KiB + 3 stages of 176 x 256 x 2 B does not fit: the whole candidate is refused
    assert fwd_config(dense(), 90).cfg == sm90.select_fwd_config(128, "bf16", False, seqlen_k=4096)
    monkeypatch.setattr(sm90, "FWD_KV_STAGES", {})
    cfg = fwd_config(dense(), 90).cfg
    assert (cfg.tile_n, cfg.kv_stages) == (176, 2) and cfg.smem_bytes() <= 227 * 1024 - 1024
    assert fwd_config(dense(d=96, causal=True), 90).cfg.tile_n == 192
    assert fwd_config(dense(causal=True), 90).cfg.tile_n == 128  # no entry for d128 causal
    assert fwd_config(dense(window=(256, 0)), 90).cfg.tile_n != 176  # windows keep their tiles
    assert sm90.wide_tile_fwd_config(dataclasses.replace(sm90.select_fwd_config(128), varlen_q=True)).tile_n == 128
    # what the switch turns on is built by compile-check
    assert any(c.tile_n == 176 for c in sm90.shipped_fwd_configs())


def test_wide_tile_refuses_what_does_not_fit():
    base = sm90.select_fwd_config(128)
    assert sm90.wide_tile_fwd_config(base, 192).tile_n == 192  # 224 KiB
    assert sm90.wide_tile_fwd_config(base, kv_stages=3).kv_stages == 3  # 224 KiB
    assert sm90.wide_tile_fwd_config(base, 176, 3) == base  # 296 KiB
    assert sm90.wide_tile_fwd_config(sm90.select_fwd_config(256), 128) == sm90.select_fwd_config(256)
    short = sm90.select_fwd_config(128, causal=True, seqlen_k=1024)  # persistent: its own rule
    assert short.persistent and sm90.wide_tile_fwd_config(short, 176) == short


def test_l2_kv_heads_applies_to_unpacked_gqa_lpt(monkeypatch):
    monkeypatch.setattr(sm90, "FWD_L2_KV_HEADS", True)
    assert fwd_config(dense(h=32, hk=8, causal=True), 90).cfg.l2_kv_heads
    assert fwd_config(dense(h=32, hk=1, d=96, causal=True), 90).cfg.l2_kv_heads
    assert not fwd_config(dense(h=32, hk=1, d=64, causal=True), 90).cfg.l2_kv_heads  # packed (bf16 d64 causal)
    assert fwd_config(varlen(), 90).cfg.l2_kv_heads
    assert not fwd_config(dense(causal=True), 90).cfg.l2_kv_heads  # MHA: nothing to share
    assert not fwd_config(dense(h=32, hk=8), 90).cfg.l2_kv_heads  # not LPT: no sections
    assert not fwd_config(dense(h=32, hk=8, window=(256, 0)), 90).cfg.l2_kv_heads  # packed window


# ---------------------------------------------------------------------------------- tile order
@pytest.mark.parametrize("m_blocks,heads,hk,batch,seqlen_k", [(64, 32, 8, 4, 8192), (32, 64, 8, 8, 4096),
                                                               (43, 32, 1, 4, 8192), (5, 12, 4, 3, 300_000)])
def test_kv_sections_cover_every_tile_once_with_whole_groups(m_blocks, heads, hk, batch, seqlen_k):
    group = heads // hk
    pairs = l2_section_pairs(seqlen_k, 128, None, group)
    assert pairs == l2_section_heads(seqlen_k, 128) * group
    order = tile_order(m_blocks, heads, batch, causal=True, lpt=True, heads_per_l2_group=pairs)
    assert sorted(order) == sorted((m, h, b) for m in range(m_blocks) for h in range(heads) for b in range(batch))
    assert order == [tile_coords(t, m_blocks, heads, batch, causal=True, lpt=True, heads_per_l2_group=pairs)
                     for t in range(len(order))]
    # a KV group's query heads (same batch, h // group) all fall in one section, next to each other
    num_hb = heads * batch
    section = min(pairs, num_hb)
    for hb in range(num_hb):
        b, h = divmod(hb, heads)
        first = b * heads + (h // group) * group
        assert hb // section == first // section == (first + group - 1) // section
    # within a section, each m_block runs the section's pairs in a row: the group's tiles are adjacent
    per_m = {}
    for t, (m, h, b) in enumerate(order):
        per_m.setdefault((m, (b * heads + h) // section), []).append(t)
    assert all(ts == list(range(ts[0], ts[0] + len(ts))) for ts in per_m.values())


def test_host_passes_the_kv_section(monkeypatch):
    from flash4.compile import cache

    monkeypatch.setattr(cache, "load_or_compile", lambda *a, **k: object())
    cache.get_fwd_runner.cache_clear()
    try:
        q = torch.empty(4, 8192, 32, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(4, 8192, 8, 128, device="meta", dtype=torch.bfloat16)
        base = sm90.select_fwd_config(128, causal=True)
        l2_off = cache.get_fwd_runner(base).tail(q, k, 0.1)[7]
        l2_on = cache.get_fwd_runner(dataclasses.replace(base, l2_kv_heads=True)).tail(q, k, 0.1)[7]
        assert l2_off == l2_section_heads(8192, 128) == 8 and l2_on == 4 * l2_off
    finally:
        cache.get_fwd_runner.cache_clear()


# ------------------------------------------------------------------------------------- compile
COMPILED = [
    sm90.wide_tile_fwd_config(sm90.select_fwd_config(128), 176),
    sm90.wide_tile_fwd_config(sm90.select_fwd_config(128), 192),
    sm90.wide_tile_fwd_config(sm90.select_fwd_config(128), kv_stages=3),
    sm90.wide_tile_fwd_config(sm90.select_fwd_config(96, causal=True), 192),
]


@pytest.fixture(scope="module")
def rows():
    pytest.importorskip("cutlass")
    from flash4.compile.check import compile_check

    return compile_check(COMPILED)


@pytest.mark.parametrize("i", range(len(COMPILED)),
                         ids=[f"d{c.headdim}{'c' if c.causal else ''}_n{c.tile_n}s{c.kv_stages}" for c in COMPILED])
def test_candidate_compiles_clean(rows, i, compiled_clean):
    assert COMPILED[i] != sm90.select_fwd_config(COMPILED[i].headdim, causal=COMPILED[i].causal)
    compiled_clean(rows[i])
    assert rows[i]["smem_bytes"] <= 227 * 1024 - 1024


def test_l2_kv_heads_is_the_same_kernel():
    pytest.importorskip("cutlass")
    from flash4.compile.cache import compile_fwd
    from flash4.compile.check import extract_cubin

    off = sm90.select_fwd_config(64, causal=True)
    cubins = [extract_cubin(compile_fwd(cfg)) for cfg in (off, dataclasses.replace(off, l2_kv_heads=True))]
    if cubins[0] is None:
        pytest.skip("no cubin in the compiled object")
    assert cubins[0] == cubins[1]


# ------------------------------------------------------------------------------------- the tool
def test_tool_plan(capsys):
    import ab_fwd as tool

    assert tool.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert all(case.name in text for case in tool.CELLS)
    for case in tool.CELLS:
        vs = tool.variants(case)
        assert list(vs)[0] == "shipped" and len(vs) >= 2, case.name
        assert vs["shipped"] == tool.shipped_cfg(case)
        assert len(set(vs.values())) == len(vs), case.name
        for name, cfg in vs.items():
            base = vs["shipped"]
            changed = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(base, f.name)}
            allowed = {"tile_n", "kv_stages", "l2_kv_heads", "pack_gqa", "softmax_vote_first", "lookahead_qk",
                       "mask_bits", "persistent", "early_q_release", "p_smem", "tile_m", "rescale_always",
                       "pv_zero_init", "flat_tile_order", "split_row_max", "softmax_branch_free", "exp2_emu_frac",
                       "pin_p_convert"}
            assert changed <= allowed, (case.name, name, changed)
            assert ("tile_m" in changed) <= (name in ("m192p", "m192pra", "m192n144p", "nop")), (case.name, name)
            assert (name in ("ra", "ravf", "m192pra", "bfra", "bfrasm", "vfemu8", "bfraemu8")) == (
                "rescale_always" in changed), (case.name, name)
            assert (name in ("sm", "bfrasm")) == ("split_row_max" in changed), (case.name, name)
            assert (name in ("pin", "pinvf")) == ("pin_p_convert" in changed), (case.name, name)
            assert (name in ("bf", "bfra", "bfrasm", "bfraemu8")) == ("softmax_branch_free" in changed), (case.name, name)
            assert name.endswith("emu8") == ("exp2_emu_frac" in changed) and (not name.endswith("emu8") or
                                                                            cfg.headdim <= 48), (case.name, name)
            assert (name in ("mb", "nomb")) == ("mask_bits" in changed), (case.name, name)
            assert (name in ("la", "nola")) == ("lookahead_qk" in changed), (case.name, name)
            vote_first_changed = name in ("vf", "novf", "ravf", "vfemu8", "pinvf") or (
                "softmax_branch_free" in changed and base.softmax_vote_first)  # branch-free replaces it
            assert vote_first_changed == ("softmax_vote_first" in changed), (case.name, name)
            assert (name in ("pz", "flatpz")) == ("pv_zero_init" in changed), (case.name, name)
            assert (name in ("flat", "flatpz")) == ("flat_tile_order" in changed), (case.name, name)
            assert cfg.smem_bytes() <= 227 * 1024 - 1024
    assert len(tool.plan_kernels(tool.CELLS)) == len({c for case in tool.CELLS for c in tool.variants(case).values()})


def test_tool_d64_full_p_smem_tiles():
    """d64 full cells: P through smem at 192 x 128 / 160 / 176 / 192 (FlashAttention-3's d64 tile is 192 x
    192 with P through smem); not on causal d64 cells nor at other head dims."""
    import ab_fwd as tool

    cells = {case.name: case for case in list(tool.CELLS) + list(getattr(tool, "EXTRA_CELLS", ()))}
    full = tool.variants(cells["d64_full_4k"])
    for name, n in (("p", 128), ("n160p", 160), ("n176p", 176), ("n192p", 192)):
        cfg = full[name]
        assert cfg.p_smem and cfg.tile_n == n and cfg.tile_m == full["shipped"].tile_m == 192, (name, cfg)
        assert dataclasses.replace(cfg, p_smem=False, tile_n=128) == full["shipped"]
    for other in ("d64_causal_4k", "d128_full_4k"):
        if other in cells:
            assert not {"n160p", "n176p", "n192p"} & set(tool.variants(cells[other])), other


def test_tool_run_cell_plumbing(monkeypatch):
    """run_cell on the CPU with small shapes and a recording stand-in for the compiled kernel: every
    variant launches with the layout flash4.forward uses (dense (B, S, H, D) / lse (B, H, S); varlen
    the batch-1 views, lse (1, H, total), lse_split (2, 1, H, total), cu_seqlens, batch and
    max_seqlen_q), and the checks read what the kernel wrote."""
    import ab_fwd as tool
    import ab_switch

    from flash4.bench import cases, common, varlen
    from flash4.compile import cache

    calls = []

    def fake_compiled(q, k, v, out, lse, lse_hi, lse_lo, cu_q, cu_k, used_q, used_k, table, o_acc, lse_acc, sink,
                      *scalars):
        assert out.dim() == q.dim() == 4 and lse.dim() == 3 and lse_hi.shape == lse.shape == lse_lo.shape
        assert out.shape[:3] == q.shape[:3] and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        calls.append((tuple(q.shape), cu_q is not None, scalars[2], scalars[3], scalars[7]))
        out.zero_()
        lse.zero_()

    monkeypatch.setattr(cache, "load_or_compile", lambda *a, **k: fake_compiled)
    monkeypatch.setattr(tool, "DEVICE", "cpu")
    monkeypatch.setenv("FLASH4_NUM_SMS", "132")
    monkeypatch.setattr(common, "make_inputs", lambda b, sq, sk, h, hk, d, dt, headdim_v=None: (
        torch.randn(b, sq, h, d, dtype=dt), torch.randn(b, sk, hk, d, dtype=dt), torch.randn(b, sk, hk, d, dtype=dt)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ab_switch, "interleaved",
                        lambda fns, rounds, rep_ms: {n: (fn(), 1.0)[1] for n, fn in fns.items()})
    monkeypatch.setattr(tool, "varlen_lengths", lambda: [100, 28, 300])
    monkeypatch.setattr(varlen, "varlen_lengths", lambda: [100, 28, 300])
    cache.get_fwd_runner.cache_clear()
    try:
        dense_cell = cases.Case("gqa_small", 128, True, 1536, 1536, 2, 8, 2)  # not short: not persistent
        row = tool.run_cell(dense_cell, 1, 1.0, 800.0)
        assert set(row["variants"]) == {"shipped", "l2kv", "pack", "vf", "ra", "ravf", "pz", "sm", "bf", "bfra", "bfrasm",
                                        "pin", "pinvf"} and not tool.failures([row]), row
        assert len(calls) == 26 and not any(c[1] for c in calls)  # each variant: the check call + one timed
        assert calls[0][4] * 4 == calls[1][4]  # l2kv: 4x the L2 section of shipped
        calls.clear()
        row = tool.run_cell(varlen.VarlenCase("varlen_small", 8, 2), 1, 1.0, 800.0)
        assert set(row["variants"]) == {"shipped", "l2kv", "vf", "ra", "ravf", "pz", "sm", "bf", "bfra",
                                        "bfrasm", "pin", "pinvf"} and not tool.failures([row]), row
        assert calls[0][:4] == ((1, 428, 8, 128), True, 3, 300)
    finally:
        cache.get_fwd_runner.cache_clear()
