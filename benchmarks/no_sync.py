"""Full mixprec training steps under torch's sync debug mode: how many host syncs per step?

Each configuration below runs a few warm-up steps (optimizer state is created there, TrainStep
captures its graph there), then a window of steps, one of which overflows (an inf in its input),
with ``torch.cuda.set_sync_debug_mode('warn')`` counting every synchronising CUDA call, then one
more step under ``set_sync_debug_mode('error')``, the literal check: a sync raises there, and its
traceback names the line. Goal: zero syncs per step.

Configurations (fp16, a small MLP with a LayerNorm, cross-entropy):

  sgd-momentum             mixprec.autocast + mixprec.GradScaler + SGD(momentum=0.9),
                           scale -> backward -> unscale_ -> clip_grad_norm_ -> step -> update
  adam-foreach             the same with Adam(foreach=True). Its step counters live on the CPU,
                           which mixprec.scaling.skip documents as one sync per step
                           (expected_syncs_per_step = 1); capturable=True removes it:
  adam-foreach-capturable  Adam(foreach=True, capturable=True)
  adamw-fused              AdamW(fused=True): the optimizer skips inside its own kernel
  O2-initialize            mixprec.initialize(model, SGD momentum, "O2") + scale_loss, clipping
                           the fp32 masters (mixprec.master_params)
  trainstep-O1-adam        mixprec.TrainStep(O1, Adam, clip_grad_norm=1.0): replays a CUDA graph
  trainstep-O2-sgd         mixprec.TrainStep(O2, SGD momentum, clip_grad_norm=1.0)
  watch-attached           sgd-momentum with mixprec.watch_nonfinite(model, attach=scaler)

On a CPU there is nothing to synchronise with and sync debug mode is CUDA-only: every step kind
still runs (a smoke test of the same code), and the sync columns say why they are empty. Each
configuration also reports the skipped updates its scaler recorded: exactly the injected one.

Usage::

    PYTHONPATH=src python benchmarks/no_sync.py [--device auto|cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

KINDS = (
    "sgd-momentum", "adam-foreach", "adam-foreach-capturable", "adamw-fused", "O2-initialize",
    "trainstep-O1-adam", "trainstep-O2-sgd", "watch-attached",
)  # fmt: skip
#: Syncs per step that mixprec documents for a configuration (all others: zero).
EXPECTED = {"adam-foreach": 1}
# torch's words for a sync. Not "synchroniz" alone: set_sync_debug_mode's own warning ("...
# does not yet detect all synchronizing operations") matched that, and the first H100 run
# counted it as a sync of the first configuration (0.17 syncs/step, 1 in 6 steps).
SYNC_TEXT = "called a synchronizing CUDA operation"

Step = Callable[[torch.Tensor, torch.Tensor], Any]


def _model(width: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU(), nn.Linear(width, 10)
    ).to(device)


def _optimizer(kind: str, model: nn.Module, device: str) -> torch.optim.Optimizer:
    params = model.parameters()
    if kind.startswith("adam-foreach"):
        # torch refuses capturable=True for CPU tensors: on a CPU the two Adam rows coincide.
        capturable = kind.endswith("capturable") and device == "cuda"
        return torch.optim.Adam(params, lr=1e-3, foreach=True, capturable=capturable)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "trainstep-O1-adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def build(kind: str, device: str, width: int) -> tuple[Step, Any, Any]:
    """(step(x, y), the object holding the scaler, a context to run the steps in)."""
    model = _model(width, device)
    opt = _optimizer(kind, model, device)
    if kind.startswith("trainstep"):
        level = kind.split("-")[1]
        train_step = mixprec.TrainStep(model, opt, F.cross_entropy, opt_level=level,
                                       dtype="fp16", clip_grad_norm=1.0)  # fmt: skip
        return train_step, train_step, None
    if kind == "O2-initialize":
        model, amp_opt = mixprec.initialize(model, opt, "O2", dtype="fp16")

        def o2_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            amp_opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x.half()).float(), y)
            with mixprec.scale_loss(loss, amp_opt) as scaled:
                scaled.backward()
            torch.nn.utils.clip_grad_norm_(mixprec.master_params(amp_opt), 1.0)
            amp_opt.step()
            return loss.detach()

        return o2_step, amp_opt, None
    scaler = mixprec.GradScaler(device)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast(device, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    watch = mixprec.watch_nonfinite(model, attach=scaler) if kind == "watch-attached" else None
    return step, scaler, watch


def _batches(device: str, width: int, batch: int, n: int, bad: int) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(batch, width, generator=g)
        if i == bad:
            x[0, 0] = float("inf")
        out.append((x.to(device), torch.randint(0, 10, (batch,), generator=g).to(device)))
    return out


def _count_syncs(step: Step, batches: list[tuple]) -> tuple[int, list[str]]:
    """Run `batches` with sync debug mode 'warn'; (syncs, the first few distinct places)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for x, y in batches:
                step(x, y)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if SYNC_TEXT in str(w.message)]
    places = list(dict.fromkeys(f"{w.filename}:{w.lineno}" for w in syncs))[:5]
    return len(syncs), places


def _error_mode(step: Step, x: torch.Tensor, y: torch.Tensor) -> str:
    """One step under sync debug mode 'error': 'no sync', or where the first sync raised."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(x, y)
    except RuntimeError as err:
        if SYNC_TEXT not in str(err):
            raise
        frames = traceback.extract_tb(err.__traceback__)[-4:]
        return "raised at " + " <- ".join(f"{f.filename}:{f.lineno} {f.name}"
                                          for f in reversed(frames))  # fmt: skip
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return "no sync"


def check(kind: str, device: str, width: int, batch: int, warmup: int, window: int) -> dict:
    """Warm up, then count syncs over a window with one overflowing step (see the docstring)."""
    row: dict[str, Any] = {"kind": kind, "device": device, "warmup_steps": warmup,
                           "window_steps": window, "expected_syncs_per_step":
                           EXPECTED.get(kind, 0), "status": "ok", "reason": ""}  # fmt: skip
    step, holder, watch = build(kind, device, width)
    batches = _batches(device, width, batch, warmup + window + 1, bad=warmup + 1)
    if watch is not None:
        watch.__enter__()
    try:
        for x, y in batches[:warmup]:
            step(x, y)
        if device == "cuda":
            syncs, places = _count_syncs(step, batches[warmup:-1])
            row.update(syncs=syncs, syncs_per_step=syncs / window, sync_places=places,
                       error_mode=_error_mode(step, *batches[-1]))  # fmt: skip
        else:
            for x, y in batches[warmup:]:
                step(x, y)
            row.update(syncs=None, syncs_per_step=None,
                       why_no_count="sync debug mode is CUDA-only; on a CPU there is no "
                       "device to synchronise with")  # fmt: skip
        if isinstance(holder, mixprec.TrainStep):
            row.update(captured=holder.captured, trainstep_reason=holder.reason)
        skipped = mixprec.scale_history(holder).skipped
        row["skipped_updates"] = len(skipped)
        if len(skipped) != 1:
            row.update(status="failed", reason=f"expected 1 skipped update (the injected "
                       f"overflow), the scaler recorded {len(skipped)}")  # fmt: skip
    finally:
        if watch is not None:
            watch.__exit__(None, None, None)
            row["watch_first"] = str(watch.first) if watch.first is not None else None
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: cuda where available, else cpu; on a CPU the steps run but no syncs are "
        "counted (default: %(default)s)",
    )
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, from: "
                        + ", ".join(KINDS))  # fmt: skip
    parser.add_argument("--width", type=int, default=None, help="MLP width (512 GPU, 32 CPU)")
    parser.add_argument(
        "--batch", type=int, default=64, help="rows per step's batch (default: %(default)s)"
    )
    parser.add_argument("--warmup", type=int, default=4, help="steps before the window (4)")
    parser.add_argument("--window", type=int, default=6, help="steps counted (6)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the metadata and one row per configuration (syncs per step and where, "
        "skipped updates, status) as JSON",
    )
    args = parser.parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" \
        else args.device  # fmt: skip
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    kinds = comma_list(parser, "--kinds", args.kinds, KINDS)
    width = args.width or (512 if device == "cuda" else 32)
    rows = []
    for kind in kinds:
        try:
            rows.append(check(kind, device, width, args.batch, args.warmup, args.window))
        except Exception as err:  # one configuration failing must not hide the others
            rows.append({"kind": kind, "device": device, "status": "failed",
                         "reason": f"{type(err).__name__}: {err}"[:500],
                         "traceback": traceback.format_exc()[-2000:]})  # fmt: skip
        r = rows[-1]
        per = r.get("syncs_per_step")
        print(f"{kind:24s} {r['status']:7s} syncs/step "
              f"{'-' if per is None else f'{per:.2f}'} (expected {EXPECTED.get(kind, 0)})  "
              f"skipped {r.get('skipped_updates', '-')}  {r.get('error_mode', '')}"
              f"{r['reason']}", flush=True)  # fmt: skip
    where = torch.cuda.get_device_name() if device == "cuda" else cpu_name()
    if args.json:
        meta = {"command": "python " + " ".join(sys.argv), "device": where,
                "torch": torch.__version__, "mixprec": mixprec.__version__,
                "python": platform.python_version(), "width": width,
                "batch": args.batch}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
