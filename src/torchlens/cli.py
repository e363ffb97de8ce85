"""The ``torchlens`` command line (``python -m torchlens``)."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    import torchlens as tl
    from torchlens.demo import demo_model

    model, x = demo_model()
    log = tl.trace(model, x)
    print(log)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="torchlens", description="Trace a PyTorch forward pass.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="trace the built-in demo model and print the summary")
    demo.set_defaults(run=_demo)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
