"""ResNet-50 at lr 0.1: does fp16 go NaN where bf16 does not, and where does the first inf appear?

The case of issue reports and of our H100 baseline (fp16 autocast, SGD lr 0.1, batch 128,
32x32 inputs: NaN within ~45 steps; bf16: none). This script trains the bench ResNet-50 under
O1 with the GradScaler, with `mixprec.watch_nonfinite` attached, and prints for each dtype the
first non-finite loss, the skipped steps and the watch's summary with its suggested fix.

    python examples/resnet50_fp16_nan.py --device cuda                    # the H100 case
    python examples/resnet50_fp16_nan.py --device cpu --dtypes bf16 --width 8 --steps 5

Data: synthetic CIFAR-sized batches (fixed seed), or ``--data cifar10:PATH`` for the real set
in its python-pickle format. fp16 on a CPU is about 100x slower than bf16: use a GPU for it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.data import load
from mixprec.bench.models import ResNet50


def run(dtype: torch.dtype, args: argparse.Namespace, data) -> dict:
    torch.manual_seed(0)
    device = args.device
    model = ResNet50(num_classes=data.num_classes, width=args.width).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scaler = mixprec.GradScaler(device, enabled=dtype is torch.float16, check_every=10)
    g = torch.Generator().manual_seed(0)
    losses = []
    with mixprec.watch_nonfinite(model, ops=args.ops, attach=scaler, history=args.steps) as w:
        for _ in range(args.steps):
            i = torch.randint(0, len(data.train_x), (args.batch,), generator=g)
            x, y = data.train_x[i].to(device), data.train_y[i].to(device)
            opt.zero_grad(set_to_none=True)
            with mixprec.autocast(device, dtype=dtype):
                loss = F.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
        values = torch.stack(losses).tolist()  # one sync, after the run
        summary = w.summary()
        first = w.first
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    history = mixprec.scale_history(scaler) if scaler.is_enabled() else None
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "first_nonfinite_loss_step": bad[0] if bad else None,
        "nonfinite_loss_steps": len(bad),
        "skipped_updates": len(history.skipped) if history else 0,
        "final_loss": values[-1],
        "first_event": str(first) if first else None,
        "summary": summary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16, bf16")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--width", type=int, default=64, help="ResNet-50's base width (64)")
    parser.add_argument("--data", default="synthetic", help="synthetic or cifar10:PATH")
    parser.add_argument("--ops", action="store_true", help="also name the aten op (slower)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    names = {"fp16": torch.float16, "bf16": torch.bfloat16}
    dtypes = [names[d.strip()] for d in args.dtypes.split(",")]
    data = load(args.data)
    results = []
    for dtype in dtypes:
        r = run(dtype, args, data)
        results.append(r)
        print(f"{r['dtype']}: first non-finite loss at step {r['first_nonfinite_loss_step']}, "
              f"{r['nonfinite_loss_steps']} non-finite losses, {r['skipped_updates']} skipped "
              f"updates, final loss {r['final_loss']:.4g}")  # fmt: skip
        print("  " + r["summary"].replace("\n", "\n  "))
    if args.json:
        device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor()
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "device": device,
                       "torch": torch.__version__, "mixprec": mixprec.__version__,
                       "results": results}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
