"""FP8 on the GPU: GEMM and layer speed-ups at GPT-2-medium shapes, and GPT-2 training steps.

Three parts, side by side in one run:

1. ``gemm``: the four linear shapes of a GPT-2-medium block (d 1024, tokens = batch x T):
   qkv (d -> 3d), attention projection (d -> d), MLP up (d -> 4d), MLP down (4d -> d). Per
   shape: the bf16 matmul against ``torch._scaled_mm`` on e4m3 operands (tensorwise, fast
   accumulation; and rowwise), the GEMM alone; then a whole layer, forward and backward:
   ``nn.Linear`` in bf16 against ``Fp8Linear`` (quantisation of input, weight and gradient
   included), per recipe; where the quantisation runs compiled (`mixprec.fp8.fused`, CUDA),
   also with it forced eager (``layer_fp8_<recipe>_eager_quantize_ms``).
2. ``step``: GPT-2 small and medium (batch 8, T 1024, AdamW fused), one training step as
   ``mixprec.TrainStep`` in bf16, the same with FP8 layers (per recipe), each with and without
   ``compile``, and torch.amp bf16 + ``torch.compile(model)`` as torch's own route. ms/step
   and peak memory.
3. ``loss``: GPT-2 small trained ``--loss-steps`` steps on a Markov-chain token stream, bf16
   TrainStep against FP8 TrainStep, ``--loss-seeds`` seeds each: the final loss (mean of the
   last 20 steps) of FP8 against bf16's seed-to-seed spread.

Goals (issue 17), evaluated into the JSON's ``goals``: the FP8 GEMM at least 1.3x bf16 on the
large shapes (MLP up and down), the FP8 TrainStep at least 1.15x the bf16 TrainStep on the
GPT-2 medium step, FP8's final loss within bf16's spread.

Timing: after warm-up, `--iters` calls are launched back to back and the device synchronised
once; ms = elapsed / iters, the median of `--rounds` rounds. Peak memory: the step's peak
allocation above what is held between steps.

Usage::

    python benchmarks/fp8_gpu.py [--parts gemm,step,loss] [--recipes tensorwise,delayed,rowwise]
        [--json PATH] [--smoke]

``--smoke`` runs tiny shapes on whatever device there is (the CPU included) in about a minute:
it checks the script, not the speed. On a CPU, compile variants are skipped (each says why) and
TrainStep runs eagerly (its default there compiles the step, minutes per variant); FP8 layers
take the GEMM path `mixprec.fp8.gemm` measures as the faster on the machine (a Xeon whose
``_scaled_mm`` falls back to oneDNN's reference kernel gets emulation).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec._compat import scaled_mm_available
from mixprec.bench.data import token_stream
from mixprec.bench.models import GPT, GPTConfig
from mixprec.bench.report import metadata
from mixprec.fp8 import RECIPES, Fp8Linear, Fp8Recipe, fused

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

GOAL_GEMM, GOAL_STEP = 1.3, 1.15
MEDIUM = GPTConfig(n_layer=24, n_head=16, n_embd=1024)
SMALL = GPTConfig()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], Any], device: str, iters: int, rounds: int, warmup: int = 3) -> float:
    """Median over `rounds` of (time of `iters` back-to-back calls) / iters, in ms."""
    for _ in range(warmup):
        fn()
    _sync(device)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - start) * 1000 / iters)
    return statistics.median(samples)


# ------------------------------------------------------------------ part 1: GEMMs and layers


def gemm_shapes(tokens: int, d: int) -> dict[str, tuple[int, int, int]]:
    """(M, K, N) of a GPT-2 block's linear layers."""
    return {"qkv": (tokens, d, 3 * d), "attn.proj": (tokens, d, d), "mlp.up": (tokens, d, 4 * d),
            "mlp.down": (tokens, 4 * d, d)}  # fmt: skip


def _scaled(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor):
    def run() -> torch.Tensor:
        return torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=True)  # fmt: skip

    return run


def _layer_step(layer: nn.Module, x: torch.Tensor, g: torch.Tensor):
    def run() -> None:
        layer(x).backward(g)

    return run


def top_ops(fn: Callable[[], Any], device: str, iters: int = 5, top: int = 12) -> list[dict]:
    """`fn`'s operations under torch.profiler, most self device time first (CPU off CUDA):
    where an FP8 layer's time goes (the H200 run's layer took 8-25x bf16's time while its
    GEMMs ran 1.45-1.64x faster: quantisation, path choice or host syncs?)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    # Self times: a wrapper's total repeats its children's.
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
    return [{"op": e.key, "calls_per_step": e.count / iters,
             "self_device_us_per_step": getattr(e, "self_device_time_total", 0.0) / iters,
             "self_cpu_us_per_step": e.self_cpu_time_total / iters}
            for e in events[:top]]  # fmt: skip


def bench_gemm(device: str, tokens: int, d: int, recipes: list[str], iters: int, rounds: int):
    rows = []
    e4m3 = torch.float8_e4m3fn
    for name, (m, k, n) in gemm_shapes(tokens, d).items():
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        flop = 2 * m * k * n
        bf16 = time_ms(lambda x=x, w=w: torch.mm(x, w.t()), device, iters, rounds)
        xq, wq = x.to(e4m3), w.to(e4m3)
        one = torch.ones((), device=device)
        fp8 = time_ms(_scaled(xq, wq, one, one), device, iters, rounds)
        rowwise = None  # torch 2.11's CPU kernel takes per-tensor scales only
        if scaled_mm_available(torch.device(device), rowwise=True):
            rows_a, cols_b = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)
            rowwise = time_ms(_scaled(xq, wq, rows_a, cols_b), device, iters, rounds)
        row = {"shape": name, "m": m, "k": k, "n": n, "bf16_ms": bf16, "fp8_ms": fp8,
               "fp8_rowwise_ms": rowwise, "gemm_speedup": bf16 / fp8,
               "gemm_speedup_rowwise": bf16 / rowwise if rowwise else None,
               "bf16_tflops": flop / bf16 / 1e9, "fp8_tflops": flop / fp8 / 1e9}  # fmt: skip
        # A whole layer, forward + backward (input grad and weight grad), in bf16 and in FP8.
        dense = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        xg = x.clone().requires_grad_(True)
        g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        layer_step = _layer_step(dense, xg, g)
        row["layer_bf16_ms"] = time_ms(layer_step, device, iters, rounds)
        for recipe in recipes:
            fp8_layer = Fp8Linear.from_linear(dense, Fp8Recipe.named(recipe), "benchmark")
            ms = time_ms(_layer_step(fp8_layer, xg, g), device, iters, rounds)
            row[f"layer_fp8_{recipe}_ms"] = ms
            row[f"layer_speedup_{recipe}"] = row["layer_bf16_ms"] / ms
            row[f"layer_fp8_{recipe}_quantize"] = fused.quantize_mode() + (
                " (compiled)" if fused.use_compiled(xg) else " (eager)")  # fmt: skip
            row[f"layer_fp8_{recipe}_quantize_failures"] = len(fused.failures())
            if name == "qkv" and recipe == recipes[0]:
                row[f"layer_fp8_{recipe}_profile"] = top_ops(_layer_step(fp8_layer, xg, g), device)
            if fused.use_compiled(xg):  # the eager quantisation too, for comparison
                mode = fused.quantize_mode()
                fused.set_quantize_mode("eager")
                try:
                    ms = time_ms(_layer_step(fp8_layer, xg, g), device, iters, rounds)
                finally:
                    fused.set_quantize_mode(mode)
                row[f"layer_fp8_{recipe}_eager_quantize_ms"] = ms
                row[f"layer_speedup_{recipe}_eager_quantize"] = row["layer_bf16_ms"] / ms
        rows.append(row)
        print(f"gemm {name}: bf16 {bf16:.3f} ms, fp8 {fp8:.3f} ms ({bf16 / fp8:.2f}x), layer "
              + ", ".join(f"{r} {row[f'layer_speedup_{r}']:.2f}x" for r in recipes),
              file=sys.stderr)  # fmt: skip
    return rows


# ------------------------------------------------------------------ part 2: training steps


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_step(variant: str, cfg: GPTConfig, device: str, level: str, seed: int = 0):
    """(step(tokens) -> loss, model) for one variant."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    fused = device == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    if variant == "torch.amp+compile":
        compiled = torch.compile(model)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = _lm_loss(compiled, tokens)
            loss.backward()
            opt.step()
            return loss.detach()

        return step, model
    fp8 = variant.split()[1] if variant.startswith("fp8") else None
    kw: dict[str, Any] = {"fp8": fp8} if fp8 else {}
    if variant.endswith("+compile"):
        kw["compile"] = True
    elif device != "cuda":  # TrainStep compiles a CPU step by default: minutes per variant
        kw["compile"] = False
    train = mixprec.TrainStep(model, opt, compute_loss=_lm_loss, opt_level=level, dtype="bf16",
                              **kw)  # fmt: skip
    return train, model


#: Which rows the step part runs: the captured steps, their compiled versions, or both.
STEP_KINDS = ("all", "captured", "compiled")


def step_variants(recipes: list[str], kind: str = "all") -> list[str]:
    """The step part's rows: `kind` ``captured`` keeps the TrainSteps without compile (what the
    GPT-2 medium goal compares, in about a minute on a GPU), ``compiled`` the others (each
    compiles GPT-2: minutes)."""
    out = ["bf16 TrainStep", "bf16 TrainStep+compile", "torch.amp+compile"]
    for r in recipes:
        out += [f"fp8 {r} TrainStep", f"fp8 {r} TrainStep+compile"]
    if kind == "captured":
        return [v for v in out if "compile" not in v]
    if kind == "compiled":
        return [v for v in out if "compile" in v]
    return out


def bench_step(device: str, configs: dict[str, GPTConfig], batch: int, recipes: list[str],
               level: str, iters: int, rounds: int, smoke: bool = False,
               kind: str = "all") -> list[dict]:  # fmt: skip
    rows = []
    for cfg_name, cfg in configs.items():
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), device=device)
        for variant in step_variants(recipes, kind):
            row: dict[str, Any] = {"model": cfg_name, "variant": variant, "level": level}
            if "compile" in variant and device != "cuda":
                row["skipped"] = "compile variants run on CUDA only (minutes to compile on a CPU)"
                rows.append(row)
                continue
            try:
                step, _ = build_step(variant, cfg, device, level)
                # Warm up first: optimizer state, FP8 scales and a captured graph's pool are held
                # between steps; the peak reported is the step's own, above that.
                for _ in range(2 if smoke else 4):
                    step(tokens)
                if device == "cuda":
                    torch.cuda.synchronize()
                    gc.collect()  # an earlier variant's objects, if a cycle still holds them
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                    held = torch.cuda.memory_allocated()
                row["ms"] = time_ms(lambda s=step, t=tokens: s(t), device, iters, rounds, warmup=0)
                if device == "cuda":
                    row["peak_mib"] = (torch.cuda.max_memory_allocated() - held) / 2**20
                row["captured"] = bool(getattr(step, "captured", False))
            except Exception as err:  # a variant that cannot run says why; the others go on
                row["skipped"] = f"{type(err).__name__}: {err}".splitlines()[0][:300]
            rows.append(row)
            print(f"step {cfg_name} {variant}: {row.get('ms', row.get('skipped'))}",
                  file=sys.stderr)  # fmt: skip
    for row in rows:
        base = next((r for r in rows if r["model"] == row["model"]
                     and r["variant"] == ("bf16 TrainStep+compile" if "compile" in row["variant"]
                                          else "bf16 TrainStep") and "ms" in r), None)  # fmt: skip
        if base is not None and "ms" in row:
            row["speedup_vs_bf16_trainstep"] = base["ms"] / row["ms"]
    return rows


# ------------------------------------------------------------------ part 3: loss curves


def bench_loss(device: str, cfg: GPTConfig, batch: int, steps: int, seeds: int,
               recipes: list[str], level: str) -> list[dict]:  # fmt: skip
    rows = []
    for seed in range(seeds):
        data = [t.to(device) for t in token_stream(cfg.vocab_size, batch, cfg.block_size + 1,
                                                   steps, seed=seed)]  # fmt: skip
        for variant in ["bf16 TrainStep"] + [f"fp8 {r} TrainStep" for r in recipes]:
            step, _ = build_step(variant, cfg, device, level, seed=seed)
            losses = torch.stack([step(t) for t in data]).float().cpu().tolist()
            tail = losses[-min(20, max(1, steps // 2)) :]
            rows.append({"variant": variant, "seed": seed, "final_loss": sum(tail) / len(tail),
                         "curve": losses[:: max(1, steps // 50)]})  # fmt: skip
            print(f"loss {variant} seed {seed}: {rows[-1]['final_loss']:.4f}", file=sys.stderr)
    return rows


def goals(gemm: list[dict], step: list[dict], loss: list[dict]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    large = [r["gemm_speedup"] for r in gemm if r["shape"] in ("mlp.up", "mlp.down")]
    if large:
        out["gemm_speedup_large_min"] = min(large)
        out["gemm_goal_met"] = min(large) >= GOAL_GEMM
    medium = [r for r in step if r["model"] == "gpt2-medium" and "speedup_vs_bf16_trainstep" in r
              and r["variant"].startswith("fp8")]  # fmt: skip
    if medium:
        best = max(medium, key=lambda r: r["speedup_vs_bf16_trainstep"])
        out["medium_step_best"] = {k: best[k] for k in ("variant", "speedup_vs_bf16_trainstep")}
        out["medium_step_goal_met"] = best["speedup_vs_bf16_trainstep"] >= GOAL_STEP
    ref = [r["final_loss"] for r in loss if r["variant"] == "bf16 TrainStep"]
    if ref:
        mean, spread = statistics.fmean(ref), max(ref) - min(ref)
        out["bf16_final_loss_mean"], out["bf16_final_loss_spread"] = mean, spread
        others = [r["variant"] for r in loss if r["variant"] != "bf16 TrainStep"]
        outside = 0
        for variant in dict.fromkeys(others):
            mine = statistics.fmean(r["final_loss"] for r in loss if r["variant"] == variant)
            out[f"loss_within_spread[{variant}]"] = within = abs(mine - mean) <= spread
            outside += not within
        out["loss_outside_spread"] = outside
    return out


#: The parts `--parts` selects, in the order they run.
PARTS = ("gemm", "step", "loss")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run, from: {', '.join(PARTS)} (default: all)",
    )
    parser.add_argument(
        "--recipes",
        default="tensorwise,delayed,rowwise",
        help=f"comma-separated FP8 recipes of every part, from: {', '.join(RECIPES)} "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda where available, else cpu (default: %(default)s)",
    )
    parser.add_argument(
        "--level",
        default="O2",
        choices=["O1", "O2"],
        help="opt level of the TrainSteps of the step and loss parts (default: %(default)s)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="sequences of 1024 tokens per batch: the step and loss parts' batch, and "
        "batch x 1024 rows in the gemm part (default: %(default)s; ignored with --smoke)",
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=20,
        help="calls launched back to back per timing round; the step part uses half "
        "(default: %(default)s; ignored with --smoke)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="timing rounds; the median is reported (default: %(default)s; ignored with --smoke)",
    )
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=300,
        help="GPT-2 small training steps per run of the loss part (default: %(default)s; "
        "ignored with --smoke)",
    )
    parser.add_argument(
        "--loss-seeds",
        type=int,
        default=2,
        help="seeds per variant in the loss part (default: %(default)s; ignored with --smoke)",
    )
    parser.add_argument(
        "--json",
        default=None,
        metavar="PATH",
        help="write the run's metadata, the rows of every part and the goals as JSON",
    )
    parser.add_argument(
        "--models",
        default="gpt2-small,gpt2-medium",
        help="comma-separated models of the step part, from: gpt2-small, gpt2-medium "
        "(default: both; the goal is gpt2-medium's)",
    )
    parser.add_argument(
        "--step-variants",
        default="all",
        choices=STEP_KINDS,
        help="the step part's rows: captured (the TrainSteps without compile, which the goal "
        "compares), compiled (the +compile rows: each compiles GPT-2, minutes) or all "
        "(default: %(default)s)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    args = parser.parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available()
                                                        else "cpu")  # fmt: skip
    # Recipe names are read case-insensitively (as Fp8Recipe.named does).
    recipes = comma_list(parser, "--recipes", args.recipes.lower(), list(RECIPES))
    parts = set(comma_list(parser, "--parts", args.parts, PARTS))
    models = comma_list(parser, "--models", args.models, ["gpt2-small", "gpt2-medium"])
    if args.smoke:
        tiny = GPTConfig.tiny()
        configs = {"gpt2-small": tiny, "gpt2-medium": GPTConfig(512, 64, 2, 4, 128)}
        tokens, d, batch, iters, rounds = 64, 64, 2, 1, 1
        loss_cfg, loss_steps, seeds = tiny, 6, 2
        if device == "cpu":
            # One thread: on a CPU shared with other jobs, two threads waiting on each other at
            # every op made a tiny step 5x slower (the smoke run has a 2-minute budget).
            torch.set_num_threads(1)
    else:
        configs = {"gpt2-small": SMALL, "gpt2-medium": MEDIUM}
        tokens, d, batch = args.batch * 1024, 1024, args.batch
        iters, rounds = args.iters, args.rounds
        loss_cfg, loss_steps, seeds = SMALL, args.loss_steps, args.loss_seeds
    gemm = bench_gemm(device, tokens, d, recipes, iters, rounds) if "gemm" in parts else []
    configs = {name: cfg for name, cfg in configs.items() if name in models}
    step = (bench_step(device, configs, batch, recipes, args.level, max(1, iters // 2), rounds,
                       args.smoke, args.step_variants) if "step" in parts else [])  # fmt: skip
    loss = (bench_loss(device, loss_cfg, batch, loss_steps, seeds, recipes, args.level)
            if "loss" in parts else [])  # fmt: skip
    meta = {**metadata(device), "smoke": args.smoke, "level": args.level,
            "command": " ".join(["python", "benchmarks/fp8_gpu.py", *sys.argv[1:]])}  # fmt: skip
    result = {"meta": meta, "gemm": gemm, "step": step, "loss": loss,
              "goals": goals(gemm, step, loss)}  # fmt: skip
    if args.smoke:
        result["goals"]["note"] = "smoke run: tiny shapes; its timings say nothing about FP8 speed"
    print(json.dumps(result["goals"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
