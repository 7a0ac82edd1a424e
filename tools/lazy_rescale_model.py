"""CPU model of the sm90 forward's online softmax, to size the tolerances of
tests/gpu/test_softmax_adversarial.py without a GPU.

    python tools/lazy_rescale_model.py          # ~1 min on 2 cores

Models what decides the numerics (not the tiling across threads): key blocks of 128 visited from
the last one down to block 0; a row's max moves only when it grew by more than tau (log2 units);
x = s * c - m * c as one fma; exp2 on MUFU (torch.exp2) or, for the kernel's share of columns, the
bit-exact polynomial model (exp2_poly.exp2_emulated_np); P rounded to bf16 for P @ V, the row sum
from unrounded P; out = O / row_sum rounded to the output dtype; lse = (m * c + log2 row_sum) ln 2.
Runs the test's own body on every case with the model as the kernel, then prints the worst ratio
of each error to its bound (< 1 passes).
"""

import collections
import functools
import itertools
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "gpu")]

from flash4.config import LOG2E  # noqa: E402
from flash4.kernels.common.exp2_poly import exp2_emulated_np, mixed_pattern  # noqa: E402
from flash4.reference import attention_ref, max_abs_err  # noqa: E402

import test_softmax_adversarial as T  # noqa: E402


def model_forward(q, k, v, scale, causal, tau, emu_frac, tile_n=128):
    """(out, lse) as the kernel computes them (layouts as flash4.flash_attn_func)."""
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qf, kf, vf = (t.float().permute(0, 2, 1, 3) for t in (q, k, v))
    s = (qf.double() @ kf.double().transpose(-1, -2)).float()
    if causal:
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        s = s.masked_fill(j > i + sk - sq, -math.inf)
    c = scale * LOG2E
    k_emu, period = mixed_pattern(emu_frac)
    m = row_sum = None
    o = torch.zeros(b, h, sq, d)
    for idx, nb in enumerate(reversed(range(-(-sk // tile_n)))):
        st = s[..., nb * tile_n:(nb + 1) * tile_n]
        m_tile = st.amax(-1)
        if idx == 0:
            m, row_scale = m_tile, torch.ones_like(m_tile)
        else:
            m_new = torch.maximum(m, m_tile)
            move = (m_new - m) * c > tau  # NaN (both -inf) compares false
            row_scale = torch.where(move, torch.exp2((m - m_new) * c), torch.ones_like(m))
            m = torch.where(move, m_new, m)
        neg = torch.where(m == -math.inf, torch.zeros_like(m), -(m * c))
        x = (st.double() * c + neg.double()[..., None]).float()
        p = torch.exp2(x)
        if k_emu:
            col = torch.arange(st.shape[-1])
            reg_col = (col // 8) * 2 + col % 2  # the thread's register column of each key (wgmma C layout)
            emu = (reg_col % period) < k_emu
            p[..., emu] = torch.from_numpy(exp2_emulated_np(x[..., emu].numpy()))
        row_sum = p.sum(-1) if idx == 0 else row_sum * row_scale + p.sum(-1)
        o = o * row_scale[..., None] + p.bfloat16().float() @ vf[..., nb * tile_n:(nb + 1) * tile_n, :]
    empty = (row_sum == 0) | row_sum.isnan()
    out = (o * torch.where(empty, 0.0, 1 / row_sum)[..., None]).to(q.dtype).permute(0, 2, 1, 3)
    lse = torch.where(empty, -math.inf, (m * c + torch.log2(row_sum)) * math.log(2))
    return out, lse


def main():
    T.make_case = functools.partial(T.make_case, device="cpu")
    T.run_variant = lambda q, k, v, scale, causal, tau, emu: model_forward(q, k, v, scale, causal, tau, emu)
    worst = collections.defaultdict(lambda: (0.0, None))
    n = 0
    for case, d, causal, (sq, sk) in itertools.product(T.CASES, T.HEADDIMS, (False, True), T.SHAPES):
        T.test_lazy_rescale_matches_always(case, d, causal, sq, sk)  # raises on a failure
        n += 1
        q, k, v, scale = T.make_case(case, sq, sk, d)
        out_ref, lse_ref = attention_ref(q, k, v, scale, causal)
        ulp = T.out_ulp(out_ref, q.dtype)
        for emu in T.EMU_FRACS:
            (lo, ll), (ao, al) = ((max_abs_err(x, r) for x, r in zip(model_forward(q, k, v, scale, causal, tau, emu),
                                                                       (out_ref, lse_ref)))
                                  for tau in (T.TAU_LAZY, T.TAU_ALWAYS))
            where = f"{case} d{d} {'causal' if causal else 'full'} {sq}x{sk} emu{emu}"
            for key, ratio in (("out lazy/(2 always + ulp)", lo / (2 * ao + ulp)),
                               ("lse lazy/(2 always + LAZY_LSE_ATOL)", ll / (2 * al + T.LAZY_LSE_ATOL))):
                if ratio > worst[key][0]:
                    worst[key] = (ratio, where)
    print(f"{n} cases pass against the model; worst ratio to the bound:")
    for key, (ratio, where) in worst.items():
        print(f"  {key}: {ratio:.2f} ({where})")


if __name__ == "__main__":
    main()
