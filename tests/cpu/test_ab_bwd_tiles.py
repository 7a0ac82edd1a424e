"""tools/ab_bwd_tiles.py on the CPU (no GPU, nothing compiled): the plan (cells, variants, kernel
list), and the host path the device run takes: flash4.backward.run routed to each variant asks for
exactly the kernels that --precompile puts in the disk cache (recording stand-ins for the runners,
meta tensors), with the variant's heads per CTA."""

import dataclasses
import os
import sys

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import ab_bwd_tiles as tool  # noqa: E402


def test_dry_run(capsys):
    assert tool.main(["--dry-run"]) == 0
    text = capsys.readouterr().out
    assert all(case.name in text for case in tool.CELLS)


def test_variants_are_configs_other_than_shipped():
    for case in tool.CELLS:
        vs = tool.variants(case)
        assert list(vs)[0] == "shipped" and len(vs) >= 3
        plan = tool.shipped_plan(case)
        assert (vs["shipped"].cfg, vs["shipped"].heads_per_cta) == (plan.cfg, plan.heads_per_cta)
        seen = set()
        for name, v in vs.items():
            assert (v.cfg, v.heads_per_cta) not in seen, (case.name, name)
            seen.add((v.cfg, v.heads_per_cta))
            # shipped defaults untouched: every field a variant changes is a tile / switch field
            changed = {f.name for f in dataclasses.fields(v.cfg) if getattr(v.cfg, f.name) != getattr(plan.cfg, f.name)}
            assert changed <= {"tile_m", "tile_n", "transposed_dkv", "split_headdim", "exp_before_dp_wait",
                               "dq_handoff_per_wg", "dq_swapab", "dq_whole", "lse_early", "sink_delta_db",
                                   "sink_delta", "mask_rel", "dpsum_scaled"}, (case.name, name, changed)
            if plan.cfg.dkv_accum:
                assert v.cfg.dkv_accum and 1 <= v.heads_per_cta < case.nheads // case.nheads_k


def test_routed_backward_asks_for_the_precompiled_kernels(monkeypatch):
    from cpu_helpers import routed_bwd_runs

    monkeypatch.setenv("FLASH4_ARCH", "90")

    def postprocess(args, kwargs):
        return ("bwd_postprocess", args[0], args[1], kwargs["accum_tile_m"], kwargs["wide_stores"],
                kwargs.get("wg_halves", False))

    for case, name, v, asked, launched, want in routed_bwd_runs(monkeypatch, tool, tool, postprocess, with_delta=True):
        assert set(asked) <= want, (case.name, name, set(asked) - want)
        assert ("bwd", v.cfg) in asked
        group = case.nheads // case.nheads_k
        assert launched == [v.heads_per_cta if v.cfg.dkv_accum else group], (case.name, name)
