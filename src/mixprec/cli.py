"""The ``mixprec`` command line.

This release has one working command, ``mixprec policy``, which prints the precision each op
runs in under a policy (and why); ``mixprec bench`` and ``mixprec train`` follow in later
releases. ``mixprec --version`` prints the versions that matter for reproducing a result.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mixprec._version import __version__

__all__ = ["main"]

_EPILOG = """\
examples:
  mixprec policy --device cuda                    # the CUDA table, grouped by category
  mixprec policy --device cpu --op softmax mm     # one line per op, with the reason
  mixprec policy --policy 'fp32=softmax' --device cuda --op softmax
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="mixprec: automatic mixed-precision training for PyTorch. Runs matmuls "
        "and convolutions in bf16/fp16 and precision-sensitive ops in fp32, with an op policy "
        "you can read and edit.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action="store_true", help="print mixprec, torch and Python versions"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    pol = sub.add_parser(
        "policy",
        help="show which precision each op runs in, and why",
        description="Print the op policy for a device type: every listed op by category, or "
        "the decision and its reason for the ops named with --op.",
    )
    pol.add_argument(
        "--device", default="cpu", help="device type: cuda, cpu, xpu or mps (default: cpu)"
    )
    pol.add_argument(
        "--dtype", default=None, help="low dtype: bf16 or fp16 (default: the device's default)"
    )
    pol.add_argument(
        "--policy",
        default="",
        help="policy string, e.g. 'compute=bf16,fp32=softmax+layer_norm' (default: torch's lists)",
    )
    pol.add_argument("--op", nargs="+", metavar="OP", help="ops to explain (default: all listed)")
    return parser


def _versions() -> str:
    import platform

    import torch

    return (
        f"mixprec {__version__}\ntorch {torch.__version__} "
        f"(CUDA {'available' if torch.cuda.is_available() else 'not available'})\n"
        f"Python {platform.python_version()}"
    )


def _policy_command(args: argparse.Namespace) -> int:
    from mixprec.dtypes import dtype_name, resolve_dtype
    from mixprec.policy import OpCategory, Policy

    policy = Policy.from_string(args.policy)
    choice = resolve_dtype(args.device, args.dtype, policy.compute)
    print(f"policy: {policy}")
    print(f"device: {args.device}, low dtype: {dtype_name(choice.dtype)} ({choice.reason})")
    if args.op:
        for op in args.op:
            print(policy.decide(op, device_type=args.device, dtype=choice.dtype))
        return 0
    resolved = policy.resolve(args.device, choice.dtype)
    for cat in OpCategory:
        if cat is OpCategory.PASSTHROUGH:
            continue
        names = sorted(n for n, c in resolved.ops.items() if c is cat)
        print(f"\n{cat.value} ({len(names)} ops): {cat.summary}")
        print("  " + ", ".join(names) if names else "  (none)")
    print("\nEvery other op runs in its input dtype (passthrough).")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_versions())
        return 0
    if args.command == "policy":
        from mixprec.errors import MixprecError

        try:
            return _policy_command(args)
        except MixprecError as err:
            print(f"mixprec policy: error: {err}", file=sys.stderr)
            return 2
    parser.print_help()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
