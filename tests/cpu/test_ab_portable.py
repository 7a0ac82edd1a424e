"""tools/ab_portable.py on the CPU (no GPU, nothing compiled): the plan (the 8 cells, shipped and
its candidates), and the host path the device run takes: flash4.backward.run routed to each
variant asks for exactly the kernels that --precompile puts in the disk cache (the register-order
dQ postprocess included), with recording stand-ins for the runners and meta tensors."""

import dataclasses
import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_bwd_tiles  # noqa: E402
import ab_portable as tool  # noqa: E402


@pytest.fixture
def portable(monkeypatch):
    monkeypatch.setenv("FLASH4_FAMILY", "portable")
    monkeypatch.setenv("FLASH4_ARCH", "90")
    monkeypatch.delenv("FLASH4_PORTABLE_BWD", raising=False)
    for name in ("CELLS", "variants", "cfg_short", "short", "plan_kernels"):
        monkeypatch.setattr(ab_bwd_tiles, name, getattr(ab_bwd_tiles, name))
    monkeypatch.setattr(tool.ab_switch, "load_kernel", tool.ab_switch.load_kernel)


def test_dry_run(portable, capsys):
    assert tool.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert all(case.name in text for case in tool.CELLS) and len(tool.CELLS) == 8


def test_variants(portable):
    from flash4.config.sm80 import Sm80BwdConfig

    for case in tool.CELLS:
        vs = tool.variants(case)
        # shipped = shipped_bwd_candidate on these plain dense cells (since 2026-12-05 fa2w at d64, fa2s
        # at d128); "table" the tile table's config; the table's other candidates follow, fa2 (shipped
        # until 2026-12-05) among them, then the step-order switches on the shipped tiles
        # (Sm80BwdConfig.p_before_dp / dq_before_dk)
        want = ["shipped", "table", "coal", "fa2"] + (
            ["m128", "fa2sp", "fa2sq", "fa2spq", "fa2sp1", "fa2spq1", "fa2sps", "fa2spqs"] if case.headdim == 128
            else ["fa2e", "fa2s", "fa2wp", "fa2wq", "fa2wpq", "fa2w1", "fa2wp1", "fa2wpq1", "fa2wps", "fa2wpqs"])
        assert list(vs) == want, (case.name, list(vs))
        fa2 = vs["fa2"].cfg
        assert vs["shipped"].cfg.lse_smem and not fa2.lse_smem
        for name in want[4:]:
            if name.startswith(("fa2w", "fa2s")) and name != "fa2s":
                stages = 1 if name.endswith("1") else 2
                assert dataclasses.replace(vs[name].cfg, p_before_dp=False, dq_before_dk=False, dp_split=False,
                                           q_stages=2) == \
                    vs["shipped"].cfg and vs[name].cfg.q_stages == stages, name
                assert vs[name].cfg.p_before_dp == ("p" in name[4:]) and vs[name].cfg.dq_before_dk == ("q" in name[4:])
                assert vs[name].cfg.dp_split == ("s" in name[4:]), name  # (dp_split: fa2wps / fa2wpqs, fa2sps / fa2spqs)
        if case.headdim == 64:  # fa2e / fa2s: fa2's tiles with lse_early / lse_smem; shipped fa2w: FA2's warps
            assert vs["fa2e"].cfg == dataclasses.replace(fa2, lse_early=True)
            assert vs["fa2s"].cfg == dataclasses.replace(fa2, lse_smem=True)
            assert vs["shipped"].cfg == dataclasses.replace(fa2, lse_smem=True, warps_m_sdp=4)
        else:  # shipped fa2s: fa2's tiles with the LSE through smem
            assert vs["shipped"].cfg == dataclasses.replace(fa2, lse_smem=True)
        assert all(isinstance(v.cfg, Sm80BwdConfig) for v in vs.values())
        assert vs["shipped"].cfg.dq_coalesced and vs["shipped"].cfg.tile_n == 128
        assert not vs["table"].cfg.dq_coalesced and vs["coal"].cfg.dq_coalesced
        assert len({v.cfg for v in vs.values()}) == len(want)


def test_routed_backward_asks_for_the_precompiled_kernels(portable, monkeypatch):
    from cpu_helpers import routed_bwd_runs

    def postprocess(args, kwargs):
        post = tuple(sorted((k, x) for k, x in kwargs.items() if k in ("accum_tile_m", "wg_halves", "sm80_warps")))
        return ("bwd_postprocess_sm80", args[0], args[1], kwargs["wide_stores"], post)

    for case, name, v, asked, _, want in routed_bwd_runs(monkeypatch, tool, ab_bwd_tiles, postprocess):
        assert set(asked) <= want, (case.name, name, set(asked) - want)
        assert ("bwd", v.cfg) in asked


def test_variants_filter(portable, monkeypatch):
    """--variants (ab_bwd_tiles.VARIANT_FILTER) keeps "shipped" and the named variants only, so the
    precompile and the carried cache hold just those kernels."""
    monkeypatch.setattr(tool.ab_bwd_tiles, "VARIANT_FILTER", ("fa2wq", "fa2sq"))
    for case in tool.CELLS:
        assert list(tool.variants(case)) == ["shipped", "fa2wq" if case.headdim == 64 else "fa2sq"], case.name
