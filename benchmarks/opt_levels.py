"""Opt levels O0-O3 against torch.amp on a GPT-2-small-like model, side by side in one run.

For each variant: median ms per training step (AdamW, cross-entropy on random tokens), the peak
memory of a step above the memory held between steps (activations and temporaries), the memory
held between steps (weights, masters, gradients, optimizer state), the peak itself (held +
activations: ``peak_MiB`` in the JSON) and the final loss.
Expectations: O2 uses less activation memory than O1 (its activations are born low precision and
it keeps no per-step fp32->low weight copies), and O3 is the speed floor.

On a GPU: GPT-2 small (12 layers, d 768, T 1024, batch 8), fp16 with loss scaling for
torch.amp/O1/O2. On a CPU: a tiny configuration in bf16 (memory columns are not measured).

Usage::

    python benchmarks/opt_levels.py [--device cuda|cpu] [--dtype fp16|bf16] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig


def _variant(name: str, device: str, dtype: torch.dtype, cfg: GPTConfig):
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if name == "torch.amp":
        scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)

        def step(tokens):
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=dtype):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        return step
    level = name.split()[-1]
    model, amp_opt = mixprec.initialize(model, opt, level, dtype=dtype)

    def step(tokens):
        amp_opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(tokens).float().flatten(0, 1), tokens.flatten())
        with mixprec.scale_loss(loss, amp_opt) as scaled:
            scaled.backward()
        amp_opt.step()
        return loss

    return step


def _measure(name, device, dtype, cfg, batch, steps, warmup) -> dict:
    step = _variant(name, device, dtype, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        loss = step(tokens)
    sync()
    held = peak = None
    if device == "cuda":
        gc.collect()  # an earlier level's objects in a reference cycle must not count here
        torch.cuda.empty_cache()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(tokens)
        sync()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    row = {
        "variant": name, "ms_per_step": statistics.median(times) * 1e3,
        "loss": float(loss.item()),
        "held_MiB": None if held is None else held / 2**20,
        "activation_peak_MiB": None if peak is None else (peak - held) / 2**20,
        "peak_MiB": None if peak is None else peak / 2**20,
    }  # fmt: skip
    del step
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cuda", "cpu"],
                        help="cuda (GPT-2 small, memory measured) or cpu (a tiny GPT, no memory "
                        "columns) (default: cuda where available, else cpu)")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="fp16 or bf16 (default: fp16 on CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (20 GPU, 10 CPU)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--batch", type=int, default=None, help="sequences (8 GPU, 4 CPU)")
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the metadata and one row per variant (ms/step, memory, loss, speed-up "
        "against torch.amp) as JSON",
    )
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda was requested but CUDA is not available")
    dtype = mixprec.dtypes.parse_dtype(args.dtype or ("fp16" if gpu else "bf16"), low_only=True)
    cfg = GPTConfig() if gpu else GPTConfig.tiny()
    batch = args.batch or (8 if gpu else 4)
    steps = args.steps or (20 if gpu else 10)
    names = ["torch.amp", "mixprec O0", "mixprec O1", "mixprec O2", "mixprec O3"]
    rows = [_measure(n, args.device, dtype, cfg, batch, steps, args.warmup) for n in names]
    ref = rows[0]["ms_per_step"]
    device = torch.cuda.get_device_name() if gpu else platform.processor() or "cpu"
    print(f"torch {torch.__version__}, {device}, GPT {cfg.n_layer}x{cfg.n_embd}, T "
          f"{cfg.block_size}, batch {batch}, {mixprec.dtypes.dtype_name(dtype)}")  # fmt: skip
    print(f"  {'variant':14s} {'ms/step':>9s} {'vs torch.amp':>13s} {'held MiB':>9s} "
          f"{'act. MiB':>9s} {'loss':>8s}")  # fmt: skip
    for r in rows:
        r["speedup_vs_torch_amp"] = ref / r["ms_per_step"]

        def mib(v):
            return "-" if v is None else f"{v:.0f}"

        print(
            f"  {r['variant']:14s} {r['ms_per_step']:9.2f} {r['speedup_vs_torch_amp']:12.2f}x "
            f"{mib(r['held_MiB']):>9s} {mib(r['activation_peak_MiB']):>9s} {r['loss']:8.4f}"
        )
    if args.json:
        meta = {"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                "python": platform.python_version(), "device": device,
                "dtype": mixprec.dtypes.dtype_name(dtype), "batch": batch,
                "model": f"GPT {cfg.n_layer}x{cfg.n_embd}, T {cfg.block_size}"}  # fmt: skip
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=2)
    with contextlib.suppress(Exception):
        o1, o2 = rows[2]["activation_peak_MiB"], rows[3]["activation_peak_MiB"]
        if o1 is not None and o2 is not None:
            print(f"  O2 activation memory {o2:.0f} MiB vs O1 {o1:.0f} MiB: "
                  f"{'less' if o2 < o1 else 'NOT less'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
