"""FP8 on the CPU, side by side in one run: the kernels under mixprec's FP8 layers, the GEMM
path each shape gets, and whole training steps against mixprec's emulation path.

Parts (every time is the best of `--rounds` interleaved rounds: the variants of a part run one
after the other in each round, so load from other processes hits them alike, and only adds
time; only ratios within a part are meant to be compared):

1. ``kernels``: on an activation-sized tensor, the amax as ``vector_norm(t, inf)`` (mixprec's
   before) and as ``aminmax`` (now, on the CPU); FP8 -> fp32 as ``.float()`` and by table lookup
   (mixprec.fp8.gemm.decode); the amax read from FP8 bytes (true delayed scaling).
2. ``gemm``: per (M, K, N) of the step below, ``torch._scaled_mm`` against emulation, and the
   path `mixprec.fp8.gemm` chooses (measured afresh, with what the decision cost).
3. ``step``: one O1 bf16 training step (forward, backward, AdamW) of the seed MLP with FP8
   layers: the path mixprec chooses (``auto``), emulation (``emulate=True``), ``_scaled_mm``
   forced, and bf16 without FP8; recipes tensorwise, delayed, true delayed. Emulation is timed
   twice, as two variants: their ratio is the noise of the machine.
4. ``accumulation``: one FP8 layer (4 width -> 16 width), 4 micro-batches of batch/16 rows, with
   the weight's cast cached across them (mixprec's default) and dropped before every forward.
5. ``outlier``: the issue-27 probe: a delayed FP8 layer sees calm batches, one outlier batch
   (1e6x) and calm batches again; the output's error against fp32 after the outlier, with the
   window max (Transformer Engine's) and with mixprec's bounded history (max_growth 4).

Usage::

    python benchmarks/fp8_cpu.py [--threads 1] [--rounds 7] [--json PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.models import seed_mlp
from mixprec.bench.report import metadata
from mixprec.fp8 import Fp8Linear, gemm
from mixprec.fp8.numerics import fp8_amax

E4M3 = torch.float8_e4m3fn


def interleaved(variants: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
                inner: int = 1) -> dict[str, float]:  # fmt: skip
    """Best ms per call of each variant over `rounds`, the variants alternating within every
    round (load from other processes only adds time: the best round is the least disturbed)."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:  # each first in turn
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) * 1e3 / inner)
    MEDIANS.clear()
    MEDIANS.update({k: statistics.median(v) for k, v in samples.items()})
    return {k: min(v) for k, v in samples.items()}


#: The median of each variant's rounds, from the last `interleaved` call (written beside the
#: best times, to show how much the machine's load moved them).
MEDIANS: dict[str, float] = {}


def bench_kernels(rounds: int, rows: int, cols: int) -> dict[str, Any]:
    t = torch.randn(rows, cols, dtype=torch.bfloat16)
    q = (t.float() * 100).clamp(-448, 448).to(E4M3)
    ms = interleaved({
        "amax vector_norm": lambda: torch.linalg.vector_norm(t, math.inf),
        "amax aminmax": lambda: torch.aminmax(t),
        "fp8 to fp32 .float()": lambda: q.float(),
        "fp8 to fp32 table": lambda: gemm.decode(q),
        "amax from fp8 bytes": lambda: fp8_amax(q),
    }, rounds, inner=5)  # fmt: skip
    return {"shape": [rows, cols], "ms": ms,
            "amax speed-up": ms["amax vector_norm"] / ms["amax aminmax"],
            "decode speed-up": ms["fp8 to fp32 .float()"] / ms["fp8 to fp32 table"]}  # fmt: skip


def bench_gemm(rounds: int, shapes: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k).to(E4M3)
        b = torch.randn(n, k).to(E4M3).t()
        one = torch.ones(())
        ms = interleaved({
            "scaled_mm": lambda a=a, b=b, s=one: gemm.scaled(a, b, s, s, torch.bfloat16),
            "emulate": lambda a=a, b=b, s=one: gemm.emulated(a, b, s, s, torch.bfloat16),
        }, rounds)  # fmt: skip
        gemm.set_gemm_path(None)  # decide afresh, and time the decision
        start = time.perf_counter()
        path = gemm.gemm_path(a, b, False, torch.bfloat16)
        decide_ms = (time.perf_counter() - start) * 1e3
        (choice,) = gemm.gemm_choices().values()
        chosen = ms[path]
        out.append({"m": m, "k": k, "n": n, "ms": ms, "chosen": path, "decision": str(choice),
                    "decision_ms": decide_ms, "chosen / emulate": chosen / ms["emulate"],
                    "scaled_mm / emulate": ms["scaled_mm"] / ms["emulate"]})  # fmt: skip
        print(f"gemm {m}x{k}x{n}: {ms}, chose {path} in {decide_ms:.1f} ms", file=sys.stderr)
    gemm.set_gemm_path(None)
    return out


def _mlp(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(seed_mlp(width, depth), nn.Linear(width, 16))


def _step_fn(recipe: mixprec.Fp8Recipe | None, width: int, depth: int, batch: int,
             micro: int = 1):  # fmt: skip
    model = _mlp(width, depth)
    kw = {"fp8": recipe} if recipe is not None else {}
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1",
                                    dtype="bf16", **kw)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(batch, width, generator=g) for _ in range(micro)]
    ys = [torch.randn(batch, 16, generator=g) for _ in range(micro)]

    def step() -> None:
        opt.zero_grad()
        for x, y in zip(xs, ys, strict=True):
            with mixprec.scale_loss(F.mse_loss(model(x).float(), y) / micro, opt) as scaled:
                scaled.backward()
        opt.step()

    return step, model


def bench_step(rounds: int, width: int, depth: int, batch: int) -> list[dict[str, Any]]:
    recipes = {
        "tensorwise": mixprec.Fp8Recipe.named("tensorwise"),
        "delayed": mixprec.Fp8Recipe.named("delayed"),
        "true delayed": mixprec.Fp8Recipe.named("delayed").replace(overflow="saturate"),
    }
    rows = []
    for name, recipe in recipes.items():
        emulated = recipe.replace(emulate=True, name=recipe.name)
        forced, _ = _step_fn(recipe, width, depth, batch)

        def scaled_mm(step: Callable[[], None] = forced) -> None:
            with gemm.use_path("scaled_mm"):
                step()

        variants = {
            "bf16 (no FP8)": _step_fn(None, width, depth, batch)[0],
            "auto": _step_fn(recipe, width, depth, batch)[0],
            "emulate": _step_fn(emulated, width, depth, batch)[0],
            "scaled_mm": scaled_mm,
            # The same as "emulate", measured again: how far two identical variants differ on
            # this machine (the noise any other ratio here carries).
            "emulate, again": _step_fn(emulated, width, depth, batch)[0],
        }
        ms = interleaved(variants, rounds, warmup=2)
        auto_paths = sorted({c.path for c in gemm.gemm_choices().values()})
        row = {"recipe": name, "ms": ms, "median ms": dict(MEDIANS), "auto chose": auto_paths,
               "auto / emulate": ms["auto"] / ms["emulate"],
               "emulate again / emulate (noise)": ms["emulate, again"] / ms["emulate"],
               "median: auto / emulate": MEDIANS["auto"] / MEDIANS["emulate"],
               "median: emulate again / emulate": MEDIANS["emulate, again"] / MEDIANS["emulate"],
               "median: scaled_mm / emulate": MEDIANS["scaled_mm"] / MEDIANS["emulate"],
               "scaled_mm / emulate": ms["scaled_mm"] / ms["emulate"],
               "auto / bf16": ms["auto"] / ms["bf16 (no FP8)"]}  # fmt: skip
        rows.append(row)
        print(f"step {name}: {ms}", file=sys.stderr)
    return rows


def bench_accumulation(rounds: int, width: int, rows: int) -> dict[str, Any]:
    """One FP8 layer (width -> 4 width), 4 micro-batches of `rows` rows: the weight's cast
    cached (mixprec's default) and dropped before every forward; forward+backward, and
    forward alone (inference over several batches)."""
    torch.manual_seed(0)
    layer = Fp8Linear(width, 4 * width, recipe="tensorwise")
    xs = [torch.randn(rows, width, requires_grad=True) for _ in range(4)]

    def micro_batches(drop: bool, backward: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.set_grad_enabled(backward):
                for x in xs:
                    if drop:
                        layer._weight_cache = None
                    out = layer(x)
                    if backward:
                        out.sum().backward()

        return run

    ms = interleaved({
        "fwd+bwd, cast cached": micro_batches(False, True),
        "fwd+bwd, cast every micro-batch": micro_batches(True, True),
        "fwd, cast cached": micro_batches(False, False),
        "fwd, cast every micro-batch": micro_batches(True, False),
    }, rounds)  # fmt: skip
    cached = ms["fwd+bwd, cast cached"] / ms["fwd+bwd, cast every micro-batch"]
    forward = ms["fwd, cast cached"] / ms["fwd, cast every micro-batch"]
    return {"layer": [width, 4 * width], "micro_batches": 4, "rows": rows, "ms": ms,
            "fwd+bwd cached / uncached": cached, "fwd cached / uncached": forward}  # fmt: skip


def bench_outlier() -> list[dict[str, Any]]:
    rows = []
    for name, growth in (("window max (TE)", float("inf")), ("bounded (max_growth 4)", 4.0)):
        torch.manual_seed(2)
        layer = Fp8Linear(
            64, 64, bias=False, recipe=mixprec.Fp8Recipe.named("delayed").replace(max_growth=growth)
        )
        layer.measure_error = True
        errors = []
        for step in range(22):
            x = torch.randn(64, 64, generator=torch.Generator().manual_seed(step))
            layer(x * (1e6 if step == 4 else 1.0))
            errors.append(layer.fp8_error.item())
            mixprec.fp8_update([layer])
        rows.append({"history": name, "error before": max(errors[:4]), "error at outlier":
                     errors[4], "errors after": errors[5:],
                     "steps after with error > 10%": sum(e > 0.1 for e in errors[5:])})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=31,
        help="interleaved timing rounds per measurement; the best round is reported "
        "(default: %(default)s; 2 with --smoke)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=256,
        help="hidden width of the step part's MLP; also sizes the gemm shapes, the kernels' "
        "tensor and the accumulation layer (default: %(default)s; 32 with --smoke)",
    )
    parser.add_argument(
        "--depth",
        type=int,
        default=4,
        help="Linear(width, width) layers of the step part's MLP (default: %(default)s; "
        "2 with --smoke)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=256,
        help="rows per batch of the step part; also sizes the gemm shapes, the kernels' tensor "
        "and the accumulation micro-batches (batch/16 rows) (default: %(default)s; "
        "16 with --smoke)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write every part's results, the run's metadata and the summary as JSON",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 2 rounds")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, width, depth, batch = args.rounds, args.width, args.depth, args.batch
    if args.smoke:
        rounds, width, depth, batch = 2, 32, 2, 16
    shapes = [(batch, width, width), (batch, width, 4 * width), (batch, 4 * width, width),
              (width, batch, width)]  # fmt: skip
    result = {
        "meta": {**metadata("cpu"), "torch_threads": torch.get_num_threads(),
                 "command": " ".join(["python", "benchmarks/fp8_cpu.py", *sys.argv[1:]])},
        "kernels": bench_kernels(rounds, 4 * batch, 4 * width),
        "gemm": bench_gemm(rounds, shapes),
        "step": bench_step(rounds, width, depth, batch),
        "accumulation": bench_accumulation(rounds, 4 * width, batch // 16),
        "outlier": bench_outlier(),
    }  # fmt: skip
    summary = {
        "amax speed-up": result["kernels"]["amax speed-up"],
        "decode speed-up": result["kernels"]["decode speed-up"],
        "gemm chosen / emulate (max)": max(r["chosen / emulate"] for r in result["gemm"]),
        "step auto / emulate (max)": max(r["auto / emulate"] for r in result["step"]),
        "step auto / emulate, medians (max)": max(
            r["median: auto / emulate"] for r in result["step"]
        ),
        "step emulate again / emulate, medians (max |1 - x|)": max(
            abs(1 - r["median: emulate again / emulate"]) for r in result["step"]
        ),
        "accumulation fwd+bwd cached / uncached": result["accumulation"][
            "fwd+bwd cached / uncached"
        ],
    }
    result["summary"] = summary
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
