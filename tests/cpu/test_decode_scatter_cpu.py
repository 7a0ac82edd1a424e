"""FLASH4_DECODE_SCATTER on the CPU (issue 25 item 4): a varlen door's decode step whose plan splits the
keys has the split-KV combine write the varlen out / lse rows by cu_seqlens_q, instead of new step
buffers, a searchsorted and two gathers after the step.

    the row map           flash4.forward.decode_slot_rows (plain Python, brute-force checked) against
                          scatter_rows (the device ops the switch removes), NaN-filled buffers
    the compile           the combine's packed-rows variant compiles for sm_90a (with and without sink)

The doors with the switch on and off: tests/cpu/test_decode_doors_cpu.py (the reference in place of
the kernels: the same out / lse on every row a sequence owns; a caller's out / lse keep the old
path); the launches: tests/cpu/test_memo_cpu.py (recorded kernels: a split step launches the
packed-rows combine on the door's out / lse and cu_seqlens_q, an unsplit one what the switch-off
path launches, the prepared call what the full path does).

(tests/gpu/test_decode_scatter.py: bitwise equal out / lse on the GPU, switch on vs off.)"""

import math
import random

import pytest
import torch
from cpu_helpers import BF16, I32

from flash4 import env, forward


# ================================================================ the row map
def _cu(lengths):
    return [0] + [sum(lengths[: i + 1]) for i in range(len(lengths))]


@pytest.mark.parametrize("seed", range(40))
def test_decode_slot_rows_brute_force(seed):
    """Every row in [cu[0], cu[-1]) once, from the slot s >= Sq - len_b of its sequence, right-aligned."""
    rng = random.Random(seed)
    sq = rng.randint(1, 8)
    lengths = [rng.choice([0, sq, rng.randint(0, sq)]) for _ in range(rng.randint(1, 9))]
    c = _cu(lengths)
    got = forward.decode_slot_rows(c, sq)
    seen = []
    for b, slots in enumerate(got):
        assert len(slots) == sq
        for s, r in enumerate(slots):
            if s < sq - lengths[b]:
                assert r is None
            else:
                assert r == c[b] + s - (sq - lengths[b])  # query s - (Sq - len_b) of sequence b
                seen.append(r)
    assert seen == list(range(c[0], c[-1]))


@pytest.mark.parametrize("lengths,sq", [((1, 1, 1, 1), 1), ((1, 0, 1, 0), 1), ((0, 1, 0, 0, 0, 0), 1), ((1,), 1),
                                        ((3,), 4), ((2, 2, 2), 2), ((4, 1, 0, 3), 4), ((0, 2, 0, 1), 3)])
@pytest.mark.parametrize("given", [False, True])
def test_scatter_rows_is_the_row_map(lengths, sq, given):
    """scatter_rows (the switch-off path's device ops) writes what decode_slot_rows says on every row a
    sequence owns; rows past cu[-1] keep a caller's values (given)."""
    batch, h, dv, pad = len(lengths), 3, 8, 2
    c = _cu(list(lengths))
    total_q = c[-1] + pad
    out_step = torch.randn(batch, sq, h, dv).to(BF16)
    lse_step = torch.randn(batch, h, sq)
    out = torch.full((total_q, h, dv), math.nan, dtype=BF16)
    lse = torch.full((h, total_q), math.nan)
    forward.scatter_rows(torch.tensor(c, dtype=I32), batch, sq, out_step, lse_step, out, lse, (given, given))
    for b, slots in enumerate(forward.decode_slot_rows(c, sq)):
        for s, r in enumerate(slots):
            if r is not None:
                assert torch.equal(out[r], out_step[b, s]) and torch.equal(lse[:, r], lse_step[b, :, s])
    if given:
        assert out[c[-1]:].isnan().all() and lse[:, c[-1]:].isnan().all()


def test_switch_reads_env(monkeypatch):
    monkeypatch.delenv("FLASH4_DECODE_SCATTER", raising=False)
    assert env.decode_scatter() is True  # on by default since the H200 A/B
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "0")
    assert env.decode_scatter() is False
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "1")
    assert env.decode_scatter() is True
    monkeypatch.setenv("FLASH4_DECODE_SCATTER", "maybe")
    with pytest.raises(ValueError, match="FLASH4_DECODE_SCATTER"):
        env.decode_scatter()
    assert "FLASH4_DECODE_SCATTER" in env.PLAN_VARIABLES  # flash4.memo keys on it


# ================================================================ the compile
@pytest.mark.parametrize("headdim,sink", [(128, False), (64, True)])
def test_packed_rows_combine_compiles(headdim, sink):
    from flash4.compile.cache import get_combine_runner

    get_combine_runner.cache_clear()
    run = get_combine_runner(headdim, "bf16", 90, sink=sink, packed_rows=True)
    assert callable(run) and run.compiled is not get_combine_runner(headdim, "bf16", 90, sink=sink).compiled


# ================================================================ the measurement tool
def test_host_overhead_env_option():
    """tools/host_overhead.py --env FLASH4_DECODE_SCATTER=0,1 measures the varlen door with the switch
    off, then on, in one process (a child: --fake patches flash4 for good); on, the door makes fewer
    Python calls (no step buffers, searchsorted or scatter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env_vars = dict(os.environ, PYTHONPATH=str(root / "src"))
    res = subprocess.run([sys.executable, str(root / "tools" / "host_overhead.py"), "--fake", "--env",
                          "FLASH4_DECODE_SCATTER=0,1", "-n", "3", "varlen_paged"],
                         capture_output=True, text=True, env=env_vars, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    parts = res.stdout.split("with FLASH4_DECODE_SCATTER=")[1:]
    assert [p[0] for p in parts] == ["0", "1"], res.stdout
    calls = [float(next(line for line in p.splitlines() if line.split()[:1] == ["varlen_paged"]).split()[2])
             for p in parts]
    assert calls[1] < calls[0], res.stdout
    bad = subprocess.run([sys.executable, str(root / "tools" / "host_overhead.py"), "--fake", "--env", "NOVALUE",
                          "-n", "1", "varlen_paged"], capture_output=True, text=True, env=env_vars, timeout=300)
    assert bad.returncode != 0 and "--env" in bad.stderr
