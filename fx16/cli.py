"""The ``fx16`` command."""

import argparse
import sys

from fx16.demo import run_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fx16", description="Cast torch.export programs to 16-bit."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="cast a built-in transformer block and show before/after")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        run_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
