"""Cached kernels loaded through TVM-FFI alone (FLASH4_RUNTIME_LOAD=1; docs/design/warm_start.md), on
the GPU (marker gpu; skipped without CUDA): a first process compiles one forward kernel into a fresh
cache directory and links its shared library; a second process loads it without importing the CuTe
DSL and its result is within the rule against the float32 reference, bit-equal to the first
process's. About a minute (one compile)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

CHILD = """
    import json, sys
    import torch
    import flash4
    from flash4.compile import disk_cache
    from flash4.reference import fwd_errors
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out, lse = flash4.flash_attn_func(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    errs = fwd_errors(q, k, v, out, lse)
    print(json.dumps(dict(ok=bool(errs["ok"]), errs={k: v for k, v in errs.items() if k != "ok"},
                          counts=dict(disk_cache.counts), cutlass="cutlass" in sys.modules,
                          out=out.float().sum().item(), lse=lse.sum().item())))
"""


def _child(cache_dir):
    # SRC first, the caller's path after it (where the CuTe DSL may live, e.g. an unpacked wheel set).
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, FLASH4_CACHE_DIR=str(cache_dir), FLASH4_RUNTIME_LOAD="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler driver to link the shared library")
def test_runtime_loaded_kernel_runs(tmp_path):
    first = _child(tmp_path)
    assert first["ok"], first
    assert first["counts"]["compiled"] >= 1 and list(tmp_path.glob("*.so")), first
    second = _child(tmp_path)
    assert second["ok"], second
    assert second["counts"] == {"loaded": first["counts"]["compiled"] + first["counts"]["loaded"], "compiled": 0}
    assert not second["cutlass"], "the CuTe DSL was imported although every kernel came from a shared library"
    assert (second["out"], second["lse"]) == (first["out"], first["lse"])
