"""What ordinary sliding windows run, in one source tree: plans, kernel sides, cubins (the "window
bands cost nothing" check of issue 29; docs/conformance/fa4-suite.md "Window bands: cost").

    CUTE_DSL_ARCH=sm_90a PYTHONPATH=<tree>/src python tools/window_cost.py OUT.jsonl
    python tools/kernel_fingerprint.py --compare BEFORE.jsonl AFTER.jsonl

For each case (d64/d128 windows (256, 0) with and without causal, (128, 128) dense and packed, and
gpt-oss's d64 causal window 128 with learnable sinks, 64 / 8 heads, dense and packed) it writes one
"plan" line: the sm90 forward and backward plans (configs, GQA packing, splits) and the (causal,
(left, right)) the kernels take, hashed; then tools/kernel_fingerprint.py's line (cubin sha256,
SASS) for every config those plans select. Runs against trees from before flash4.geometry.Band
(it only uses Request.dense / Request.varlen and flash4.config.fwd_config / bwd_config); where Band
exists, the same windows spelled as Bands must give the same plan text (asserted).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# (name, headdim, nheads, nheads_k, causal, window (left, right), learnable sink, packed varlen)
CASES = [case for d in (64, 128) for case in (
    (f"d{d} window(256,0)", d, 16, 16, False, (256, 0), False, False),
    (f"d{d} causal window(256,0)", d, 16, 16, True, (256, 0), False, False),
    (f"d{d} window(128,128)", d, 16, 16, False, (128, 128), False, False),
    (f"d{d} varlen window(128,128)", d, 16, 16, False, (128, 128), False, True))] + [
    ("gpt-oss d64 causal window(128,0)+sink h64/8", 64, 64, 8, True, (128, 0), True, False),
    ("gpt-oss d64 varlen causal window(128,0)+sink h64/8", 64, 64, 8, True, (128, 0), True, True)]


def request(d, h, hk, causal, window, sink, varlen, batch=2, seqlen=4096):
    import torch

    from flash4.request import Request

    lead = (batch * seqlen,) if varlen else (batch, seqlen)
    q = torch.empty(*lead, h, d, dtype=torch.bfloat16)
    k, v = (torch.empty(*lead, hk, d, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(causal=causal, window_size=window, learnable_sink=torch.zeros(h) if sink else None)
    if varlen:
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32)
        return Request.varlen(q, k, v, cu, cu, seqlen, seqlen, **kw)
    return Request.dense(q, k, v, **kw)


def plan_text(req) -> tuple[str, object, object]:
    from flash4.config import bwd_config, fwd_config

    fwd, bwd = fwd_config(req, 90), bwd_config(req, 90)
    return f"fwd {fwd!r}\nbwd {bwd!r}\ncausal={req.mask.causal} window={req.mask.window}", fwd.cfg, bwd.cfg


def main(argv=None) -> int:
    import kernel_fingerprint

    out_path = (argv or sys.argv[1:])[0]
    try:
        from flash4.geometry import Band
    except ImportError:  # a tree from before the bands
        Band = None
    configs = {}
    with open(out_path, "w") as out:
        for name, *args in CASES:
            text, fwd, bwd = plan_text(request(*args))
            if Band is not None:
                band_args = list(args)
                band_args[4] = Band(*args[4])
                assert plan_text(request(*band_args))[0] == text, f"{name}: a Band plans differently"
            out.write(json.dumps({"kind": "plan", "config": name, "text": text,
                                  "sha256": hashlib.sha256(text.encode()).hexdigest()}) + "\n")
            print(f"{name}: causal={text.split('causal=')[-1]}", file=sys.stderr)
            configs.setdefault(("fwd", repr(fwd)), fwd)
            configs.setdefault(("bwd", repr(bwd)), bwd)
        for i, ((kind, _), cfg) in enumerate(configs.items()):
            row = kernel_fingerprint.fingerprint(kind, cfg)
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"[{i + 1}/{len(configs)}] {kind} {row.get('sha256', row.get('error'))[:64]} "
                  f"registers {row.get('registers')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
