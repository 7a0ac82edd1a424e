"""Command line: `python -m flash4 bench [...]`, `python -m flash4 bench --ablate [...]`,
`python -m flash4 compile-check [...]` and `python -m flash4 warmup [...]`.

Argument parsing and dispatch only; the work lives in flash4.bench.run, flash4.bench.ablate and
flash4.bench.report. Help texts speak to users: what an option does, its units and default.
"""

from __future__ import annotations

import argparse
import sys


CACHE_NOTE = ("The cache lives in FLASH4_CACHE_DIR (default: $XDG_CACHE_HOME/flash4, else ~/.cache/flash4); "
              "FLASH4_CACHE=0 turns it off.")


def _add_kernel_filters(parser: argparse.ArgumentParser) -> None:
    """--headdims, --dtypes, --causal of compile-check and warmup."""
    parser.add_argument("--headdims", type=int, nargs="+", metavar="D",
                        help="only the kernels of these head dims (default: every head dim)")
    parser.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"),
                        help="only the kernels of these data types (default: bf16 and fp16)")
    parser.add_argument("--causal", choices=("0", "1", "both"), default="both",
                        help="0: only the kernels without a mask, 1: only those with the causal mask, "
                             "both: each (default)")


def build_parser() -> argparse.ArgumentParser:
    from flash4.bench import ablate as bench_ablate
    from flash4.bench import run as bench_run

    parser = argparse.ArgumentParser(prog="python -m flash4", description="flash4: exact attention kernels for "
                                     "NVIDIA GPUs (Hopper; the portable family for Ampere / Ada / consumer Blackwell and the sm100 "
                                     "family for B200, compile-verified). Benchmark them, or compile them ahead of time.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="check flash4's results, then time its forward and backward passes against cuDNN, "
                      "FlashAttention-2 and flash-attn-4 (without a GPU: compile the kernels instead)",
        description=bench_run.DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_run.add_arguments(bench)
    bench_ablate.add_arguments(bench)
    check = sub.add_parser(
        "compile-check", help="compile flash4's forward and backward kernels (no GPU needed) and report "
                              "registers, spills, shared memory and compile time",
        description="Compile flash4's shipped forward and backward kernels for sm_90a (no GPU needed) and print, "
                    "per kernel, its registers, register spills, shared memory, instruction counts and compile "
                    "time. Exits with 1 on a compile error, a spill or a serialized wgmma, else 0.",
    )
    _add_kernel_filters(check)
    check.add_argument("--json", metavar="PATH", help="also write the results to this JSON file")
    check.add_argument("--arch", choices=("sm_90a", "sm_100a"), default="sm_90a",
                       help="sm_90a (default): the Hopper kernels. sm_100a: the Blackwell (B200) forward and "
                            "backward, compile-verified for sm_100a, not yet run on Blackwell hardware; reports "
                            "registers per warp role, TMEM columns, shared memory, SASS opcode counts and compile time")
    check.add_argument("--features", action="store_true",
                       help="with --arch sm_100a: also the forward's sliding-window, softcap and sink variants (96 "
                            "configs instead of 12) and the backward's sliding-window ones (24 instead of 16)")
    check.add_argument("--pass", dest="passes", choices=("fwd", "bwd", "both"), default="both",
                       help="with --arch sm_100a: only the forward (fwd) or backward (bwd) kernels, or both (default)")
    warm = sub.add_parser(
        "warmup", help="compile flash4's kernels into the on-disk compile cache (no GPU needed), so later "
                       "processes load them in milliseconds",
        description="Compile flash4's shipped kernels into the on-disk compile cache (no GPU needed), so later "
                    "processes load each kernel in milliseconds instead of compiling it. " + CACHE_NOTE,
    )
    _add_kernel_filters(warm)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "bench":
        from flash4.bench import ablate

        problem = ablate.argument_error(args)
        if problem:
            parser.error(problem)  # exits with status 2
        if args.ablate:
            return ablate.main(args)
        from flash4.bench.run import main as bench_main

        return bench_main(args)
    from flash4.bench.report import compile_check_main, select_configs, warmup_main

    causals = {"0": (False,), "1": (True,), "both": None}[args.causal]
    if args.command == "compile-check" and args.arch == "sm_100a":
        from flash4.compile import sm100_check

        passes = ("fwd", "bwd") if args.passes == "both" else (args.passes,)
        return sm100_check.main(sm100_check.configs(args.headdims, args.dtypes, causals, args.features, passes),
                                json_path=args.json)
    configs = select_configs(headdims=args.headdims, dtypes=args.dtypes, causals=causals)
    if args.command == "warmup":
        return warmup_main(configs)
    return compile_check_main(configs, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
