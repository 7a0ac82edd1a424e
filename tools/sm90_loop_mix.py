"""The forward's key-block loop (or, --bwd, the backward's query-tile step) on Hopper, flash4 beside
flash-attn-4, from SASS compiled on the CPU (no GPU): per implementation the innermost loop that
issues the block's exponentials (MUFU.EX2) and wgmmas, its static instruction count, opcode mix and, with --sequence, its opcode sequence
(run-length encoded; branches, barriers and wgmma waits with their addresses). Static counts: a
branch's two sides both count (flash4's exact-path and rescale branches), so read the sequence for
the common path. docs/design/speed_candidates.md section 20 has the d64 full reading.

    pip install --no-deps --target /tmp/fa4 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 einops
    PYTHONPATH=src:tools python tools/sm90_loop_mix.py --headdim 64 --seqlen 4096
    PYTHONPATH=src:tools python tools/sm90_loop_mix.py --headdim 64 --switches rescale_always,softmax_vote_first --sequence

flash-attn-4 is the competitor, never a dependency: imported only here, from --fa4-path (default
$FA4_PATH or /tmp/fa4; without it, flash4's half only), driven as tools/fa4_sass_mix.py drives it
(fake tensors, FLASH_ATTENTION_ARCH=sm_90a, 132 SMs) on (32768 / seqlen, seqlen, heads, headdim).
flash4's kernel is the config its API selects for that shape (select_fwd_config), plus --switches
(flash4.config.sm90.with_fwd_switches).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

os.environ["CUTE_DSL_ARCH"] = "sm_90a"
os.environ["FLASH_ATTENTION_ARCH"] = "sm_90a"
os.environ["FLASH_ATTENTION_NUM_SMS"] = "132"  # H100 / H200
os.environ.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", None)

_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_MARKED = ("BRA", "DEPBAR", "SYNCS", "VOTE", "BAR.")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS line. Pure."""
    return [(int(m.group(1), 16), m.group(2).strip()) for m in map(_LINE.match, sass.splitlines()) if m]


def opcode(text: str) -> str:
    """The opcode of one instruction, its predicate dropped. Pure."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def loops(ins: list) -> list[tuple[int, int]]:
    """(first, last) index of every loop: a branch back to an earlier address of the listing. Pure."""
    index = {a: i for i, (a, _) in enumerate(ins)}
    out = []
    for i, (a, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in index:
            out.append((index[int(m.group(1), 16)], i))
    return out


def key_block_loop(ins: list) -> tuple[int, int] | None:
    """The innermost loop with both MUFU.EX2 and HGMMA (the forward's steady-state key block), or
    None. Pure."""
    found = [(s, e) for s, e in loops(ins)
             if any(opcode(t) == "MUFU.EX2" for _, t in ins[s:e + 1])
             and any(opcode(t).startswith("HGMMA") for _, t in ins[s:e + 1])]
    return min(found, key=lambda se: se[1] - se[0]) if found else None


def sequence(ins: list, first: int, last: int) -> str:
    """The loop's opcodes run-length encoded; branches, barriers, votes and waits with addresses. Pure."""
    runs = []
    for a, text in ins[first:last + 1]:
        op = opcode(text)
        if any(op.startswith(m) or m in op for m in _MARKED):
            op = f"{op}@{a:#x}"
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    return " ".join(op if n == 1 else f"{op}x{n}" for op, n in runs)


def report(name: str, sass: str, show_sequence: bool) -> None:
    ins = instructions(sass)
    loop = key_block_loop(ins)
    if loop is None:
        print(f"{name}: no key-block loop found ({len(ins)} instructions)")
        return
    first, last = loop
    mix = collections.Counter(opcode(t) for _, t in ins[first:last + 1])
    top = ", ".join(f"{op} {n}" for op, n in mix.most_common(12))
    print(f"{name}: loop {ins[first][0]:#x}-{ins[last][0]:#x}, {last - first + 1} instructions, "
          f"MUFU.EX2 {mix['MUFU.EX2']}\n  {top}")
    if show_sequence:
        print("  " + sequence(ins, first, last))


def flash4_sass(headdim: int, causal: bool, seqlen: int, switches: tuple, bwd: bool = False) -> tuple[str, str]:
    from flash4.compile.cache import compile_bwd, compile_fwd
    from flash4.compile.check import extract_cubin, sass_text
    from flash4.compile.jit import export_only
    from flash4.config import select_bwd_config, select_fwd_config
    from flash4.config.sm90 import with_fwd_switches

    if bwd:
        cfg = select_bwd_config(headdim, "bf16", causal)
        compile_ = compile_bwd
    else:
        cfg = with_fwd_switches(select_fwd_config(headdim, "bf16", causal, seqlen_k=seqlen), switches)
        compile_ = compile_fwd
    with export_only():
        return repr(cfg), sass_text(extract_cubin(compile_(cfg)))


def fa4_sass(fa4_path: str, headdim: int, causal: bool, seqlen: int, bwd: bool = False) -> str | None:
    import fa4_sass_mix

    fi, why = fa4_sass_mix.load_fa4(fa4_path)
    if fi is None:
        print(f"flash-attn-4: {why}")
        return None
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash4.compile.check import extract_cubin, sass_text

    with fa4_sass_mix.catching_compiles() as caught, FakeTensorMode():
        heads = 16 if headdim <= 128 else 8
        q, k, v = (torch.empty(32768 // seqlen, seqlen, heads, headdim, dtype=torch.bfloat16, device="cuda")
                   for _ in range(3))
        if bwd:
            out, dout = torch.empty_like(q), torch.empty_like(q)
            lse = torch.empty(q.shape[0], heads, seqlen, dtype=torch.float32, device="cuda")
            fi._flash_attn_bwd(q, k, v, out, dout, lse, causal=causal)
        else:
            fi._flash_attn_fwd(q, k, v, causal=causal, return_lse=True)
    texts = [sass_text(extract_cubin(c)) for c in caught]
    return max(texts, key=len) if texts else None  # the backward's main kernel, not its pre / postprocess


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--headdim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--switches", default="", help="flash4 forward speed switches, comma-separated")
    p.add_argument("--bwd", action="store_true", help="the backward's main kernel (flash4: select_bwd_config)")
    p.add_argument("--fa4-path", default=os.environ.get("FA4_PATH", "/tmp/fa4"))
    p.add_argument("--flash4-only", action="store_true")
    p.add_argument("--sequence", action="store_true", help="also print each loop's opcode sequence")
    args = p.parse_args(argv)
    switches = tuple(s for s in args.switches.split(",") if s)
    cfg, sass = flash4_sass(args.headdim, args.causal, args.seqlen, switches, args.bwd)
    print(cfg)
    report("flash4", sass, args.sequence)
    if not args.flash4_only:
        sass = fa4_sass(args.fa4_path, args.headdim, args.causal, args.seqlen, args.bwd)
        if sass is not None:
            report("flash-attn-4", sass, args.sequence)
    return 0


if __name__ == "__main__":
    sys.exit(main())
