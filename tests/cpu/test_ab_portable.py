"""tools/ab_portable.py on the CPU (no GPU, nothing compiled): the plan (the 8 cells, shipped and
its candidates), and the host path the device run takes: flash4.backward.run routed to each
variant asks for exactly the kernels that --precompile puts in the disk cache (the register-order
dQ postprocess included), with recording stand-ins for the runners and meta tensors."""

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
        want = ["shipped", "coal", "fa2"] + (["m128"] if case.headdim == 128 else [])
        assert list(vs) == want, (case.name, list(vs))
        assert all(isinstance(v.cfg, Sm80BwdConfig) for v in vs.values())
        assert not vs["shipped"].cfg.dq_coalesced and vs["coal"].cfg.dq_coalesced
        assert len({v.cfg for v in vs.values()}) == len(want)


def test_routed_backward_asks_for_the_precompiled_kernels(portable, monkeypatch):
    import torch

    from flash4 import backward
    from flash4.compile import cache

    asked = []

    def recorder(kind):
        def get(*args, **kwargs):
            if kind == "bwd_preprocess":
                asked.append((kind, args[0], args[1]))
            elif kind == "bwd_postprocess":
                post = tuple(sorted((k, x) for k, x in kwargs.items() if k in ("accum_tile_m", "wg_halves", "sm80_warps")))
                asked.append(("bwd_postprocess_sm80", args[0], args[1], kwargs["wide_stores"], post))
            else:
                asked.append((kind, args[0]))
            return lambda *a, **k: None
        return get

    for kind in ("bwd", "bwd_preprocess", "bwd_postprocess"):
        monkeypatch.setattr(cache, f"get_{kind}_runner", recorder(kind))
    monkeypatch.setattr(backward, "dq_target", lambda dq: dq)  # meta tensors have no address
    for case in tool.CELLS:
        want = set(tool.plan_kernels([case]))
        req = ab_bwd_tiles.request(case)
        out = torch.empty(req.q.shape, device="meta", dtype=req.q.dtype)
        lse = torch.empty(case.batch, case.nheads, case.seqlen_q, device="meta", dtype=torch.float32)
        with ab_bwd_tiles.TileRoute() as route:
            for name, v in tool.variants(case).items():
                asked.clear()
                route.plan = ab_bwd_tiles.BwdPlan(v.cfg, v.heads_per_cta)
                backward.run(req, out, out, lse, None)
                assert set(asked) <= want, (case.name, name, set(asked) - want)
                assert ("bwd", v.cfg) in asked
            assert route.calls == len(tool.variants(case))
