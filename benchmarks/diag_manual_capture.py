"""Which ingredient of the hand-written whole-step CUDA graph breaks its replays (GPU only).

`graph_step.py`'s "manual" rows (torch.autocast + torch.amp.GradScaler + a fused optimizer, the
whole step captured with ``torch.cuda.graph``) ended in an illegal memory access on the first
H100 and H200 runs (torch 2.11), bf16 included, while TrainStep's captures of the same models
replayed. This script captures the seed MLP's step (3 Linear layers, bf16) several ways, each
in its own process (a CUDA error poisons its context), all at once, and prints one line per
way: ``ok`` after 20 replays, or the error.

    python benchmarks/diag_manual_capture.py [--width 1024] [--batch 256] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

WAYS = {
    "as-graph_step": "autocast cache on, fused SGD, zero_grad(set_to_none) inside the body",
    "no-autocast-cache": "as-graph_step with torch.autocast(cache_enabled=False)",
    "fp32": "no autocast at all",
    "foreach-sgd": "as-graph_step with SGD(foreach=True) instead of fused",
    "no-step": "forward and backward only (no optimizer step)",
    "grads-kept": "as-graph_step, grads zeroed in place (set_to_none=False), never freed",
    "default-stream-capture": "as-graph_step, captured on torch.cuda.graph's own stream",
}


def _one(way: str, width: int, batch: int) -> str:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    dev = "cuda"
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)]).to(dev)
    x = torch.randn(batch, width, device=dev)
    y = torch.randn(batch, width, device=dev)
    kw = {"foreach": True} if way == "foreach-sgd" else {"fused": True}
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, **kw)
    cache = way != "no-autocast-cache"
    none = way != "grads-kept"

    def body() -> torch.Tensor:
        opt.zero_grad(set_to_none=none)
        if way == "fp32":
            out = model(x)
        else:
            with torch.autocast(dev, dtype=torch.bfloat16, cache_enabled=cache):
                out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        if way != "no-step":
            opt.step()
        return loss.detach()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=none)
    stream = None if way == "default-stream-capture" else side
    with torch.cuda.graph(graph, stream=stream):
        static = body()
    torch.cuda.synchronize()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return f"ok (loss {float(static):.6f} after 20 replays)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=1024, help="the MLP's width (default 1024)")
    ap.add_argument("--batch", type=int, default=256, help="rows per batch (default 256)")
    ap.add_argument("--json", help="write {way: result} here")
    ap.add_argument("--way", choices=sorted(WAYS), help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.way:
        try:
            print(_one(args.way, args.width, args.batch))
        except Exception as err:  # the child reports any failure as its one line
            print(f"failed: {type(err).__name__}: {str(err).splitlines()[0]}")
        return 0
    procs = {
        way: subprocess.Popen([sys.executable, __file__, "--way", way, "--width", str(args.width),
                               "--batch", str(args.batch)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for way in WAYS
    }  # fmt: skip
    results = {}
    for way, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith(("ok", "failed"))]
        results[way] = lines[-1] if lines else f"died (exit {proc.returncode}): {out[-300:]}"
        print(f"{way:24s} {results[way]}   [{WAYS[way]}]", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
