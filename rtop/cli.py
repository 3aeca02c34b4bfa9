"""The ``rtop`` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from rtop import __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``rtop`` subcommand."""
    parser = argparse.ArgumentParser(
        prog="rtop", description="top for distributed training (PyTorch DDP, Ray Train)")
    parser.add_argument("--version", action="version", version=f"rtop {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="run a real instrumented DDP job with a fault")
    demo.add_argument("--fault", choices=["starved", "straggler", "memory", "none"],
                      default="starved")
    demo.add_argument("--ranks", type=int, default=3)
    demo.add_argument("--steps", type=int, default=80)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rtop`` console script."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from rtop import demo

        return demo.run(args.fault, args.ranks, args.steps)
    build_parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
