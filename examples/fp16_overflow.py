"""An fp16 failure, diagnosed and fixed with mixprec's diagnostics (a CPU run of about a minute).

The failure mode is the one behind many "fp16 NaN / fp16 does not learn" reports (T5 and LLaMA
ports among them): a hand-written RMSNorm squares its input, ``x * x``, and in fp16 any |x|
above 256 squares past fp16's largest number, 65504. The mean of squares becomes inf, its
reciprocal square root 0, and the whole row is wiped out (or NaN). The norm exists precisely so
that the layers before it may grow, so fp32 and bf16 train fine while fp16 collapses to chance.
The data here are the scikit-learn digits as 8-bit pixel intensities (0..255), unnormalised,
which the first RMSNorm is there to absorb.

    python examples/fp16_overflow.py [--steps 300] [--json out.json] [--plot scale.png]

Steps: (1) train in fp16 and see it fail, (2) ask `watch_nonfinite` where the first inf comes
from, (3) ask `explain` why those ops ran in fp16, (4) apply the fix the report points to (run
the norm in fp32 by registering it with the policy) and the other fix (bf16), and compare with
fp32.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.report import cpu_name

SEED = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm as often hand-written: fine in fp32 and bf16, not in fp16 (x * x)."""
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight


#: The fix: the same function, registered to run in fp32 inside any mixprec.autocast region.
rms_norm_fp32 = mixprec.float_function(rms_norm)


class RMSNorm(nn.Module):
    def __init__(self, n: int, fn=rms_norm) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, self.weight)


def make_model(fn=rms_norm) -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(64, 256), RMSNorm(256, fn), nn.ReLU(),
        nn.Linear(256, 256), RMSNorm(256, fn), nn.ReLU(),
        nn.Linear(256, 10),
    )  # fmt: skip


def digits():
    """The digits as raw 8-bit intensities; a fixed train/test split."""
    from mixprec.bench.data import digits_arrays  # scikit-learn's digits, read from its file

    pixels, y = digits_arrays()
    x = pixels * (255 / 16)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(SEED))
    x, y = x[order], y[order]
    return x[:1437], y[:1437], x[1437:], y[1437:]


def train(name, fn, dtype, steps, data, watch=False):
    train_x, train_y, test_x, test_y = data
    model = make_model(fn)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    amp = dtype is not None
    scaler = mixprec.GradScaler("cpu", enabled=dtype is torch.float16)
    g = torch.Generator().manual_seed(SEED)
    w = mixprec.watch_nonfinite(model, attach=scaler, history=1024) if watch else None
    if w is not None:
        w.__enter__()
    losses = []
    try:
        for _ in range(steps):
            i = torch.randint(0, len(train_x), (64,), generator=g)
            opt.zero_grad()
            with mixprec.autocast("cpu", dtype=dtype, enabled=amp):
                loss = F.cross_entropy(model(train_x[i]).float(), train_y[i])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            losses.append(loss.detach())
    finally:
        if w is not None:
            w.__exit__(None, None, None)
    with torch.no_grad(), mixprec.autocast("cpu", dtype=dtype, enabled=amp):
        acc = (model(test_x).argmax(1) == test_y).float().mean().item()
    last = torch.stack(losses[-20:]).float().mean().item()
    skipped = mixprec.scale_history(scaler).skipped if scaler.is_enabled() else []
    result = {"run": name, "final_loss": last, "test_accuracy": acc,
              "skipped_steps": len(skipped)}  # fmt: skip
    return result, w, scaler, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--plot", metavar="PATH", help="write the failing run's scale history")
    args = parser.parse_args()
    data = digits()

    print("1. fp16 (O1 autocast + GradScaler), as written")
    broken, watch, scaler, model = train("fp16", rms_norm, torch.float16, args.steps, data, True)
    print(f"   {broken}")
    print("\n2. watch_nonfinite: where did the first inf come from, step after step?")
    print("   " + watch.summary().replace("\n", "\n   "))
    print("\n   the scaler's view (scale per update, skipped steps):")
    history = mixprec.scale_history(scaler)
    print("   " + "\n   ".join(str(history).splitlines()[:8]))
    if args.plot:
        history.plot(args.plot)
    print("\n3. explain: which precision did the norm's ops run in, and why?")
    report = mixprec.explain(model, data[0][:4], device_type="cpu", dtype=torch.float16)
    for row in report.rows:
        if row["module"] == "1":
            print(
                f"   {row['op']:<8} {row['category']:<12} {'/'.join(row['inputs']):>9} -> "
                f"{'/'.join(row['outputs']):<5} ({row['reason']})"
            )
    print("   -> x * x and its mean run in fp16 (no list names them; they follow their fp16")
    print("      input). Fix: run the whole norm in fp32 (mixprec.float_function(rms_norm)),")
    print("      or compute in bf16, which has fp32's range.")

    print("\n4. the fixes, against fp32")
    runs = [broken]
    for name, fn, dtype in (("fp16, norm in fp32 (float_function)", rms_norm_fp32,
                             torch.float16),
                            ("bf16", rms_norm, torch.bfloat16),
                            ("fp32", rms_norm, None)):  # fmt: skip
        result = train(name, fn, dtype, args.steps, data)[0]
        runs.append(result)
    print(f"   {'run':<36} {'loss (last 20)':>14} {'test acc':>9} {'skipped':>8}")
    for r in runs:
        print(
            f"   {r['run']:<36} {r['final_loss']:>14.4f} {r['test_accuracy']:>9.3f} "
            f"{r['skipped_steps']:>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
                       "mixprec": mixprec.__version__, "python": platform.python_version(),
                       "device": cpu_name(),
                       "steps": args.steps, "runs": runs,
                       "diagnosis": watch.summary()}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
