"""The ``weightsync`` command line. The environment is read here and nowhere else."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, main

    cfg = DemoConfig(trainers=args.trainers, inference=args.inference, size=args.size, rounds=args.rounds,
                     mode=args.mode, checksum="" if args.no_checksum else "crc32", json=args.json)
    return main(cfg)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Move fresh weights from trainers to inference.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a real multi-process transfer on this machine (no GPU needed)")
    demo.add_argument("--trainers", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_TRAINERS", 2)))
    demo.add_argument("--inference", type=int, default=int(os.environ.get("WEIGHTSYNC_DEMO_INFERENCE", 2)))
    demo.add_argument("--size", default=os.environ.get("WEIGHTSYNC_DEMO_SIZE", "small"),
                      choices=["tiny", "small", "medium", "large"], help="GPT-2 size (default small, 124M)")
    demo.add_argument("--rounds", type=int, default=3)
    demo.add_argument("--mode", default="shadow", choices=["shadow", "inplace"])
    demo.add_argument("--no-checksum", action="store_true", help="skip per-transfer CRC-32 verification")
    demo.add_argument("--json", action="store_true", help="print a machine-readable summary as the last line")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
