"""What the framework integrations cost per step, side by side in one process.

- Lightning: ``Trainer.fit`` with ``MixprecPrecision`` against Lightning's own ``MixedPrecision``
  (same model, data and steps; bf16 on a CPU, fp16 with a scaler on a GPU);
- telemetry: a hand-written mixprec fp16 loop with and without ``mixprec.AmpMetrics``
  (``record_loss`` + ``step`` every step, a read every 50).

Rounds are interleaved and the median ratio is reported with its interquartile range; absolute
times on a shared CPU mean little, the ratios are the result.

    python benchmarks/integrations_overhead.py --rounds 7 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

import mixprec


def _model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _lightning_fit(plugin, device: str, width: int, steps: int) -> float:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model(width)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    x = torch.randn(steps * 64, width)
    y = torch.randint(0, 10, (steps * 64,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=steps, accelerator=device, plugins=[plugin], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)  # fmt: skip
        start = time.perf_counter()
        trainer.fit(Module(), loader)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _hand_loop(device: str, width: int, steps: int, metrics: bool) -> float:
    model = _model(width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, amp = mixprec.initialize(model, opt, "O1", dtype="fp16")
    meter = mixprec.AmpMetrics(amp, every=50) if metrics else None
    x = torch.randn(64, width, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    start = time.perf_counter()
    for _ in range(steps):
        amp.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with mixprec.scale_loss(loss, amp) as scaled:
            scaled.backward()
        amp.step()
        if meter is not None:
            meter.record_loss(loss)
            meter.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="interleaved rounds, each timing the four runs once; the median ratio and its "
        "interquartile range are reported (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="training steps (batch 64) per timed run (default: %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=256,
        help="width of the model's 4 Linear + LayerNorm + GELU blocks (default: %(default)s)",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the device, sizes and each ratio's median and quartiles as JSON",
    )
    args = parser.parse_args()
    from lightning.pytorch.plugins.precision import MixedPrecision

    from mixprec.integrations.lightning import MixprecPrecision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    prec, dtype = ("16-mixed", "fp16") if device == "cuda" else ("bf16-mixed", "bf16")
    ratios: dict[str, list[float]] = {"lightning O1 / Lightning MixedPrecision": [],
                                      "fp16 loop with AmpMetrics / without": []}  # fmt: skip
    _lightning_fit(MixedPrecision(prec, device), device, args.width, 5)  # warm-up, untimed
    for r in range(args.rounds):
        # Alternate which runs first, so that neither always gets the warmer caches.
        runs = {
            "theirs": lambda: _lightning_fit(MixedPrecision(prec, device), device, args.width,
                                             args.steps),
            "ours": lambda: _lightning_fit(MixprecPrecision("O1", dtype, device=device), device,
                                           args.width, args.steps),
            "plain": lambda: _hand_loop(device, args.width, args.steps, metrics=False),
            "metered": lambda: _hand_loop(device, args.width, args.steps, metrics=True),
        }  # fmt: skip
        order = list(runs) if r % 2 == 0 else ["ours", "theirs", "metered", "plain"]
        t = {name: runs[name]() for name in order}
        ratios["lightning O1 / Lightning MixedPrecision"].append(t["ours"] / t["theirs"])
        ratios["fp16 loop with AmpMetrics / without"].append(t["metered"] / t["plain"])
    report = {"device": device, "torch": torch.__version__, "dtype": dtype, "rounds": args.rounds,
              "steps": args.steps, "width": args.width, "ratios": {}}  # fmt: skip
    for name, values in ratios.items():
        q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        report["ratios"][name] = {"median": statistics.median(values), "q1": q[0], "q3": q[2]}
        print(f"{name:45s} {statistics.median(values):.3f}x (IQR {q[0]:.3f}-{q[2]:.3f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
