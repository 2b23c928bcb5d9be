"""Instructions per step of mixprec.autocast against torch.autocast, counted by valgrind.

Wall-clock ratios on a shared CPU drift by several percent between runs; instruction counts do
not. This script runs the dispatch-bound step of ``autocast_overhead.py`` (20 x Linear(64) +
ReLU, batch 8, forward + backward, bf16, one thread) under ``valgrind --tool=callgrind`` for each
variant, once with N steps and once with none, and reports the difference per step. It counts
work, not time: memory stalls and kernel speed do not show, so read it next to the timings.

Usage::

    python benchmarks/autocast_instructions.py            # needs valgrind on PATH
    python benchmarks/autocast_instructions.py --steps 20 --json results/instr.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import tempfile

VARIANTS = ("torch.autocast", "mixprec.autocast", "torch.autocast + empty mode (floor)")

_CHILD = r"""
import contextlib, sys, torch, mixprec
from torch.overrides import TorchFunctionMode
torch.set_num_threads(1)
torch.manual_seed(0)
layers = []
for _ in range(20):
    layers += [torch.nn.Linear(64, 64), torch.nn.ReLU()]
model, x = torch.nn.Sequential(*layers), torch.randn(8, 64)

class Empty(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **kwargs) if kwargs else func(*args)

@contextlib.contextmanager
def floor():
    with torch.autocast("cpu", dtype=torch.bfloat16), Empty():
        yield

region = {
    "torch.autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "mixprec.autocast": lambda: mixprec.autocast("cpu", dtype=torch.bfloat16),
    "torch.autocast + empty mode (floor)": floor,
}[sys.argv[1]]

def step():
    with region():
        loss = model(x).float().pow(2).mean()
    loss.backward()

for _ in range(5):
    step()
for _ in range(int(sys.argv[2])):
    step()
"""


def _instructions(variant: str, steps: int) -> int:
    with tempfile.NamedTemporaryFile("w", suffix=".py") as script:
        script.write(_CHILD)
        script.flush()
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
             sys.executable, script.name, variant, str(steps)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    match = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if match is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{out.stderr[-2000:]}")
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH; install it (Debian: apt-get install valgrind)")
    import torch

    rows = []
    for variant in VARIANTS:
        per_step = (_instructions(variant, args.steps) - _instructions(variant, 0)) / args.steps
        rows.append({"variant": variant, "instructions_per_step": per_step})
    base = rows[0]["instructions_per_step"]
    print(f"torch {torch.__version__}, Python {platform.python_version()}, 1 thread, "
          f"{args.steps} steps")  # fmt: skip
    print(f"  {'variant':38s} {'instr/step':>12s} {'ratio':>7s}")
    for row in rows:
        row["ratio_vs_torch_autocast"] = row["instructions_per_step"] / base
        print(f"  {row['variant']:38s} {row['instructions_per_step']:12.0f} "
              f"{row['ratio_vs_torch_autocast']:7.3f}")  # fmt: skip
    if args.json:
        meta = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                "python": platform.python_version(), "steps": args.steps}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
