"""Command line: `python -m flash4 bench [...]`, `python -m flash4 bench --ablate [...]`,
`python -m flash4 compile-check [...]` and `python -m flash4 warmup [...]`.

Argument parsing and dispatch only; the work lives in flash4.bench.run, flash4.bench.ablate and
flash4.bench.report.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from flash4.bench import ablate as bench_ablate
    from flash4.bench import run as bench_run

    parser = argparse.ArgumentParser(prog="python -m flash4", description="flash4 attention kernels")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    bench = sub.add_parser(
        "bench", help="check correctness, then time the forward and backward sweep against cuDNN / FA2 / flash-attn-4",
        description=bench_run.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_run.add_arguments(bench)
    bench_ablate.add_arguments(bench)
    check = sub.add_parser(
        "compile-check", help="compile the shipped forward and backward configs without a GPU; report registers/spills/smem",
    )
    check.add_argument("--headdims", type=int, nargs="+", metavar="D", help="only these head dims")
    check.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), help="only these dtypes")
    check.add_argument("--causal", choices=("0", "1", "both"), default="both",
                       help="only non-causal (0), only causal (1) or both (default)")
    check.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    warm = sub.add_parser(
        "warmup", help="compile the shipped configs into the on-disk compile cache (FLASH4_CACHE_DIR) so later "
                       "processes load them in milliseconds",
        description="Compile the shipped configs into the on-disk compile cache. It lives in FLASH4_CACHE_DIR "
                    "(default $XDG_CACHE_HOME/flash4, else ~/.cache/flash4); FLASH4_CACHE=0 turns it off.",
    )
    for p in (warm,):
        p.add_argument("--headdims", type=int, nargs="+", metavar="D", help="only these head dims")
        p.add_argument("--dtypes", nargs="+", choices=("bf16", "fp16"), help="only these dtypes")
        p.add_argument("--causal", choices=("0", "1", "both"), default="both",
                       help="only non-causal (0), only causal (1) or both (default)")
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
    configs = select_configs(headdims=args.headdims, dtypes=args.dtypes, causals=causals)
    if args.command == "warmup":
        return warmup_main(configs)
    return compile_check_main(configs, json_path=args.json)


if __name__ == "__main__":
    sys.exit(main())
