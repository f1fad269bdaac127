"""Command line: ``python -m npu_attn <command>``; each command lives in a module of this folder."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m npu_attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo", help="a diffusers pipeline under every attention strategy", add_help=False
    )
    sub.add_parser(
        "doctor",
        help="check this installation: versions, devices, kernel variants, self-tests",
        add_help=False,
    )
    sub.add_parser("info", help="build information and the kernel variant per dtype")
    sub.add_parser(
        "ui", help="a web page to generate and compare (needs npu_attn[ui])", add_help=False
    )
    sub.add_parser(
        "bench", help="benchmark every attention strategy on this machine", add_help=False
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"] and "--parallel" in argv:  # scale-out benchmark, own options
        from .bench_parallel import main as bench_parallel_main

        return bench_parallel_main([a for a in argv[1:] if a != "--parallel"])
    if argv and argv[0] == "bench":  # the benchmark has its own options
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv and argv[0] == "ui":
        from .ui import main as ui_main

        return ui_main(argv[1:])
    if argv and argv[0] == "doctor":
        from .doctor import main as doctor_main

        return doctor_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "info":
        from ..runtime.controls import build_info

        for key, value in build_info().items():
            print(f"{key}: {value}")
        return 0
    return 2
