"""The ``weightsync`` command line (placeholder until the engine lands)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="weightsync")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the transfer demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print("weightsync demo: the transfer engine has not landed yet (see issue 4); wire/ is ready.")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
