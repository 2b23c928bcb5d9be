"""Low-memory training state (issue 25): accuracy, bytes per parameter and step time, per variant.

Two real tasks, both offline, each trained from 3 seeds per variant with the same data order:

- digits: scikit-learn's 8x8 handwritten digits (1797 images, a fixed 80/20 split), an MLP
  64-256-256-10, AdamW with cosine decay; reported: test accuracy and test loss.
- chargpt: a character-level GPT (2 layers, d 64, context 64) on the source text of this Python's
  standard library (the first ``--text-mb`` MB of its .py files in path order; the last 10% held
  out), AdamW with warm-up and cosine decay to 0 over ``--steps`` steps (1000 by default);
  reported: the final validation loss (mean over ``--val-batches`` fixed batches).

Variants: fp32 (O0); O2 (bf16 weights, fp32 masters and states); O3 (bf16 weights and states,
round to nearest: the baseline that should lose); O4 (bf16 weights with stochastic rounding,
8-bit states whose block scales are bounds known before the step: 6 bytes/param); O4-exact
(O4 with ``optimizer_states='8bit'``: each block scaled by its new values' maximum, a second
compiled pass); O4-kahan; O4-bf16states; O2-split (O2's
exact fp32 masters held
as bf16 weight + 16 low bits, fp32 states); and, where torchao imports beside this torch,
torchao's AdamW8bit and _AdamW with its bf16 stochastic rounding on the same bf16 model (norms
fp32, as O4). Bytes per parameter: `mixprec.memory_report` after the last backward.

bf16 matmuls: on CPUs without bf16 units (AVX2) torch's bf16 GEMMs are ~30x slower than fp32, so
the models' linear layers and attention multiply bf16 operands in fp32 and round the result to
bf16 once, which is what a bf16 GEMM with fp32 accumulation computes (and what mixprec's
``kernels='auto'`` chooses on such CPUs). Weights, gradients and states keep their dtypes.

Step time (``--speed``): `mixprec.TrainStep` compiled (inductor) for O2 and O4 on the issue's
model (4 x Linear(512), batch 64, bf16), interleaved rounds, median ms per step; torchao's
optimizers stepped eagerly on the same model (their step compiles itself).

Usage::

    python benchmarks/low_memory.py [--tasks digits,chargpt] [--seeds 3] [--steps 1000]
        [--speed] [--json PATH] [--table PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mixprec

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

VARIANTS = {
    "fp32": ("O0", {}),
    "O2": ("O2", {}),
    "O3": ("O3", {}),
    "O4": ("O4", {}),
    "O4-exact": ("O4", {"optimizer_states": "8bit"}),
    "O4-kahan": ("O4", {"master_weights": "kahan"}),
    "O4-bf16states": ("O4", {"optimizer_states": "bf16"}),
    "O2-split": ("O2", {"master_weights": "split"}),
    "torchao-AdamW8bit-sr": ("torchao", {"eight_bit": True}),
    "torchao-AdamW-bf16-sr": ("torchao", {"eight_bit": False}),
}
#: The training tasks (`--tasks`), in the module docstring's order.
TASKS = ("digits", "chargpt")


def _torchao():
    try:
        import torchao.optim as ao
    except Exception as err:  # not installed, or built for another torch
        return None, f"{type(err).__name__}: {err}"
    return ao, None


# ---------------------------------------------------------------------- models


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of low-precision operands in fp32, rounded once (a bf16 GEMM's arithmetic)."""
    return (a.float() @ b.float()).to(a.dtype)


class Linear(nn.Linear):
    """nn.Linear whose product runs in fp32 on the stored values, returned in the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(Linear(64, 256), nn.ReLU(), Linear(256, 256), nn.ReLU(),
                                 Linear(256, 10))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = Linear(d, 3 * d), Linear(d, d)
        self.fc, self.out = Linear(d, 4 * d), Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x).to(x.dtype)
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = _mm(q, k.transpose(-1, -2)).float() / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1).to(x.dtype)
        y = _mm(att, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x).to(x.dtype))))


class CharGPT(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 2, heads: int = 4,
                 ctx: int = 64) -> None:  # fmt: skip
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).to(x.dtype))


# ---------------------------------------------------------------------- data


def _digits():
    from mixprec.bench.data import digits_arrays  # scikit-learn's digits, read from its file

    pixels, y = digits_arrays()
    x = pixels / 16.0
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = (x - x.mean(0)) / (x.std(0) + 1e-3), y
    x, y = x[perm], y[perm]
    n = int(0.8 * len(x))
    return (x[:n], y[:n]), (x[n:], y[n:])


def _stdlib_text(megabytes: float) -> tuple[torch.Tensor, torch.Tensor, str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    chunks, size, limit = [], 0, int(megabytes * 2**20)
    for path in files:
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    raw = b"".join(chunks)[:limit]
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    n = int(0.9 * len(data))
    return (
        data[:n],
        data[n:],
        f"{root} ({len(files)} .py files read in path order, {len(raw):,} bytes)",
    )


# ---------------------------------------------------------------------- training


def _setup(variant: str, model: nn.Module, lr: float, wd: float, seed: int):
    level, kw = VARIANTS[variant]
    if level == "torchao":
        ao, why = _torchao()
        if ao is None:
            raise RuntimeError(why)
        cls = ao.AdamW8bit if kw["eight_bit"] else ao._AdamW

        def factory(params):
            return cls(params, lr=lr, weight_decay=wd, bf16_stochastic_round=True)

        # The same bf16 model as O4 (normalization layers fp32), torchao's optimizer on it.
        return mixprec.initialize(model, factory, "O3", keep_batchnorm_fp32=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    if "master_weights" in kw or level == "O4":
        kw = {**kw, "seed": seed}
    return mixprec.initialize(model, opt, level, dtype="bf16", **kw)


def _schedule(opt, steps: int, warmup: int):
    def factor(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (i - warmup) / max(1, steps - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _step(model, opt, loss_fn) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    with mixprec.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss


def run_digits(variant: str, seed: int, epochs: int) -> dict:
    (xtr, ytr), (xte, yte) = _digits()
    torch.manual_seed(seed)
    model, opt = _setup(variant, MLP(), lr=3e-3, wd=1e-2, seed=seed)
    batch = 64
    steps = epochs * math.ceil(len(xtr) / batch)
    sched = _schedule(opt, steps, warmup=steps // 20)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(xtr), batch):
            idx = perm[i : i + batch]
            _step(model, opt, lambda m, i=idx: F.cross_entropy(m(xtr[i]).float(), ytr[i]))
            sched.step()
    elapsed = time.perf_counter() - start
    report = _report(model, opt, lambda m: F.cross_entropy(m(xtr[:batch]).float(), ytr[:batch]))
    with torch.no_grad():
        logits = model(xte).float()
    return {
        "test_accuracy": (logits.argmax(-1) == yte).float().mean().item(),
        "test_loss": F.cross_entropy(logits, yte).item(),
        "ms_per_step": 1e3 * elapsed / steps,
        "memory": report.as_dict(),
    }


def run_chargpt(variant: str, seed: int, steps: int, text, val_batches: int) -> dict:
    train, val = text
    ctx, batch = 64, 16
    torch.manual_seed(seed)
    model, opt = _setup(variant, CharGPT(ctx=ctx), lr=3e-3, wd=0.1, seed=seed)
    sched = _schedule(opt, steps, warmup=steps // 20)
    g = torch.Generator().manual_seed(seed)

    def batch_of(data, starts):
        x = torch.stack([data[s : s + ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + 1 + ctx] for s in starts])
        return x, y

    def loss_of(m, x, y):
        return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())

    start = time.perf_counter()
    for _ in range(steps):
        x, y = batch_of(train, torch.randint(0, len(train) - ctx - 1, (batch,), generator=g))
        _step(model, opt, lambda m, x=x, y=y: loss_of(m, x, y))
        sched.step()
    elapsed = time.perf_counter() - start
    report = _report(model, opt, lambda m: loss_of(m, x, y))
    vg = torch.Generator().manual_seed(1234)  # the same validation batches for every run
    losses = []
    with torch.no_grad():
        for _ in range(val_batches):
            vx, vy = batch_of(val, torch.randint(0, len(val) - ctx - 1, (64,), generator=vg))
            losses.append(loss_of(model, vx, vy).item())
    return {
        "val_loss": statistics.fmean(losses),
        "ms_per_step": 1e3 * elapsed / steps,
        "memory": report.as_dict(),
    }


def _report(model, opt, loss_fn):
    """memory_report after a backward (gradients held), before the step."""
    opt.zero_grad(set_to_none=True)
    with mixprec.scale_loss(loss_fn(model), opt) as scaled:
        scaled.backward()
    return mixprec.memory_report(model, opt)


# ---------------------------------------------------------------------- speed


def speed(rounds: int, steps: int) -> dict:
    """Median ms per compiled TrainStep (O2, O4, O4-exact) and per eager torchao step,
    interleaved."""

    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])

    x, y = torch.randn(64, 512), torch.randn(64, 512)
    runners = {}
    for name in ("O2", "O4", "O4-exact"):
        model = mlp()
        level, kw = VARIANTS[name]
        step = mixprec.TrainStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                 F.mse_loss, opt_level=level, **kw)  # fmt: skip
        start = time.perf_counter()
        for _ in range(3):  # the eager first step, then compile
            step(x, y)
        runners[name] = (lambda s=step: s(x, y), time.perf_counter() - start, step)
    ao, _ = _torchao()
    if ao is not None:
        for name, cls in (("torchao-AdamW8bit-sr", ao.AdamW8bit),
                          ("torchao-AdamW-bf16-sr", ao._AdamW)):  # fmt: skip
            model = mlp()
            model, opt = mixprec.initialize(
                model, lambda p, cls=cls: cls(p, lr=1e-3, bf16_stochastic_round=True), "O3",
                keep_batchnorm_fp32=True)  # fmt: skip

            def eager(model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                with mixprec.scale_loss(F.mse_loss(model(x), y), opt) as scaled:
                    scaled.backward()
                opt.step()

            start = time.perf_counter()
            for _ in range(3):
                eager()
            runners[name] = (eager, time.perf_counter() - start, None)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for name, (fn, _, _) in runners.items():
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append(1e3 * (time.perf_counter() - start) / steps)
    out = {}
    for name, (_, warm, step) in runners.items():
        out[name] = {
            "median_ms": statistics.median(times[name]),
            "rounds_ms": [round(t, 3) for t in times[name]],
            "warmup_s": round(warm, 1),
            "compiled": None if step is None else step.compiled,
            "reason": None if step is None else step.reason,
        }
    for name in ("O4", "O4-exact"):
        if "O2" not in out or name not in out:
            continue
        out[f"{name}_over_O2"] = out[name]["median_ms"] / out["O2"]["median_ms"]
        # Each round's time over the O2 time measured just before it: the machine's speed
        # drifts between rounds (O2's rounds spanned 12.6-18.0 ms in one run on the shared
        # development CPU), and pairing neighbours takes the slow part of that drift out.
        pairs = zip(times["O2"], times[name], strict=True)
        out[f"{name}_over_O2_rounds"] = [round(b / a, 4) for a, b in pairs]
    return out


# ---------------------------------------------------------------------- memory per level

LEVELS = {
    "fp32 (O0)": ("O0", {}),
    "O1": ("O1", {}),
    "O2": ("O2", {}),
    "O3": ("O3", {}),
    "O4 (stochastic, 8-bit)": ("O4", {}),
    "O4, master_weights='kahan'": ("O4", {"master_weights": "kahan"}),
    "O4, optimizer_states='bf16'": ("O4", {"optimizer_states": "bf16"}),
    "O4, optimizer_states='fp32'": ("O4", {"optimizer_states": "fp32"}),
    "O2, master_weights='split'": ("O2", {"master_weights": "split"}),
    "O2, optimizer_states='8bit'": ("O2", {"optimizer_states": "8bit"}),
    "O1, optimizer_states='8bit'": ("O1", {"optimizer_states": "8bit"}),
}


def memory_table() -> str:
    """Bytes per parameter by component, per level, for the issue's model (4 x Linear(512),
    AdamW, bf16), after a backward (gradients held), from `mixprec.memory_report`."""
    from mixprec.optim.report import COMPONENTS

    rows = []
    for name, (level, kw) in LEVELS.items():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])
        model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters()), level,
                                        dtype="bf16", **kw)  # fmt: skip
        x = torch.randn(8, 512)
        for _ in range(2):  # a step (state exists), then a backward: the largest point
            opt.zero_grad(set_to_none=True)
            with mixprec.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            if _ == 0:
                opt.step()
        rows.append((name, mixprec.memory_report(model, opt)))
    used = [c for c in COMPONENTS if any(r.bytes.get(c) for _, r in rows)]
    lines = ["| level | " + " | ".join(used) + " | total |",
             "|---|" + "---|" * (len(used) + 1)]  # fmt: skip
    for name, r in rows:
        cells = [f"{r.per_param(c):.3f}" if r.bytes.get(c) else "" for c in used]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | **{r.per_param():.3f}** |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main


def _summary(results: dict) -> dict:
    out = {}
    for task, by_variant in results.items():
        metric = "test_accuracy" if task == "digits" else "val_loss"
        out[task] = {}
        for variant, runs in by_variant.items():
            if not runs or "error" in runs[0]:
                out[task][variant] = runs[0] if runs else {}
                continue
            values = [r[metric] for r in runs]
            out[task][variant] = {
                metric: values,
                "mean": statistics.fmean(values),
                "spread": max(values) - min(values),
                "bytes_per_param": runs[0]["memory"]["total_bytes_per_param"],
                "ms_per_step_eager": statistics.fmean(r["ms_per_step"] for r in runs),
            }
    return out


def table(meta: dict, summary: dict, speeds: dict | None) -> str:
    lines = [
        "# Low-memory training state (issue 25)",
        "",
        f"Command: `{meta['command']}`  ",
        f"CPU: {meta['cpu']} ({meta['threads']} threads; {meta['load']})  ",
        f"torch {meta['torch']}, Python {meta['python']}; torchao: {meta['torchao']}",
        "",
    ]
    for task, rows in summary.items():
        metric = "test accuracy" if task == "digits" else "validation loss"
        fp32 = rows.get("fp32", {})
        lines += [f"## {task} ({metric}, {meta['seeds']} seeds)", "",
                  f"| variant | {metric} mean | spread (max-min) | vs fp32 mean | bytes/param "
                  f"| eager ms/step |", "|---|---|---|---|---|---|"]  # fmt: skip
        for variant, row in rows.items():
            if "mean" not in row:
                lines.append(f"| {variant} | {row.get('error', 'not run')} | | | | |")
                continue
            rel = (row["mean"] / fp32["mean"] - 1) * 100 if fp32.get("mean") else float("nan")
            lines.append(
                f"| {variant} | {row['mean']:.4f} | {row['spread']:.4f} | {rel:+.2f}% | "
                f"{row['bytes_per_param']:.2f} | {row['ms_per_step_eager']:.1f} |"
            )
        lines.append("")
    if speeds:
        lines += ["## Step time (4 x Linear(512), batch 64, bf16)", "",
                  "| variant | median ms/step | how |", "|---|---|---|"]  # fmt: skip
        for name, row in speeds.items():
            if isinstance(row, dict):
                how = "TrainStep compiled (inductor)" if row["compiled"] else "eager loop"
                lines.append(f"| {name} | {row['median_ms']:.2f} | {how} |")
        for name in ("O4", "O4-exact"):
            if f"{name}_over_O2" not in speeds:
                continue
            lines += ["", f"{name} / O2 step time: {speeds[f'{name}_over_O2']:.3f}"]
            rounds = speeds.get(f"{name}_over_O2_rounds")
            if rounds:
                lines[-1] += (
                    f" (ratio of the medians; round by round: median "
                    f"{statistics.median(rounds):.3f}, {min(rounds):.3f}-{max(rounds):.3f})"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tasks",
        default=",".join(TASKS),
        help=f"comma-separated, from: {', '.join(TASKS)}; '' to run --speed only "
        "(default: %(default)s)",
    )
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from: {', '.join(VARIANTS)}; the torchao ones are dropped where "
        "torchao does not import (default: all)",
    )
    ap.add_argument(
        "--seeds", type=int, default=3, help="seeds per task and variant (default: %(default)s)"
    )
    ap.add_argument(
        "--steps", type=int, default=1000, help="chargpt optimizer steps (default: %(default)s)"
    )
    ap.add_argument("--epochs", type=int, default=30, help="digits epochs (default: %(default)s)")
    ap.add_argument(
        "--text-mb",
        type=float,
        default=4.0,
        help="MiB of the standard library's .py source that chargpt reads; the last 10%% is "
        "held out for validation (default: %(default)s)",
    )
    ap.add_argument(
        "--val-batches",
        type=int,
        default=20,
        help="fixed validation batches (64 sequences each) averaged into chargpt's validation "
        "loss (default: %(default)s)",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument(
        "--speed",
        action="store_true",
        help="also time the step: TrainStep compiled for O2 and O4, and torchao's optimizers "
        "eagerly, on 4 x Linear(512), batch 64",
    )
    ap.add_argument(
        "--speed-rounds",
        type=int,
        default=7,
        help="interleaved rounds of --speed; the median ms/step is reported (default: %(default)s)",
    )
    ap.add_argument(
        "--speed-steps",
        type=int,
        default=10,
        help="steps per variant and round of --speed (default: %(default)s)",
    )
    ap.add_argument(
        "--json",
        metavar="PATH",
        help="write the metadata, summary, step times and every run as JSON (with --merge: "
        "the merged result)",
    )
    ap.add_argument(
        "--table",
        metavar="PATH",
        help="also write the printed Markdown tables to PATH (with --merge: the merged ones)",
    )
    ap.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="combine the JSON files of separate runs (tasks, speed) into one",
    )
    ap.add_argument(
        "--memory-table",
        action="store_true",
        help="print the bytes/param table per level (docs/memory.md) and exit",
    )
    args = ap.parse_args(argv)
    if args.memory_table:
        print(memory_table())
        return 0
    if args.merge:
        return _merge(args.merge, args.json, args.table)
    variants = comma_list(ap, "--variants", args.variants, list(VARIANTS))
    tasks = comma_list(ap, "--tasks", args.tasks, TASKS, none="--speed only")
    torch.set_num_threads(args.threads)
    ao, why = _torchao()
    if ao is None:
        variants = [v for v in variants if not v.startswith("torchao")]
    text = None
    results: dict = {}
    for task in tasks:
        if task == "chargpt":
            train, val, source = _stdlib_text(args.text_mb)
            text = (train, val)
        results[task] = {}
        for variant in variants:
            runs = []
            for seed in range(args.seeds):
                try:
                    if task == "digits":
                        runs.append(run_digits(variant, seed, args.epochs))
                    else:
                        runs.append(run_chargpt(variant, seed, args.steps, text,
                                                args.val_batches))  # fmt: skip
                except Exception as err:  # a variant that cannot run here says why
                    runs = [{"error": f"{type(err).__name__}: {err}"[:300]}]
                    break
            results[task][variant] = runs
            got = [r.get("test_accuracy", r.get("val_loss")) for r in runs if "error" not in r]
            print(task, variant, got or runs, flush=True)
    speeds = speed(args.speed_rounds, args.speed_steps) if args.speed else None
    meta = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "cpu": _cpu(),
        "threads": args.threads,
        "load": f"load average {os.getloadavg()[0]:.1f} at the end: the machine was shared",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torchao": getattr(ao, "__version__", None) or _ao_version()
        if ao
        else f"unavailable ({why})",
        "seeds": args.seeds,
        "chargpt_text": source if text is not None else None,
    }
    summary = _summary(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "speed": speeds, "runs": results}, f,
                      indent=1)  # fmt: skip
    text_table = table(meta, summary, speeds)
    if args.table:
        Path(args.table).write_text(text_table)
    print(text_table)
    return 0


def _merge(paths: list[str], out_json: str | None, out_table: str | None) -> int:
    """One JSON and table from several runs (each run's command is kept)."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    runs: dict = {}
    speeds = None
    for part in parts:
        for task, variants in (part.get("runs") or {}).items():  # per task: runs add variants
            runs.setdefault(task, {}).update(variants)
        speeds = part.get("speed") or speeds
    meta = dict(parts[0]["meta"])
    meta["command"] = " && ".join(p["meta"]["command"] for p in parts)
    meta["load"] = "; ".join(p["meta"]["load"] for p in parts)
    meta["chargpt_text"] = next((p["meta"]["chargpt_text"] for p in parts
                                 if p["meta"].get("chargpt_text")), None)  # fmt: skip
    summary = _summary(runs)
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "speed": speeds, "runs": runs}, f,
                      indent=1)  # fmt: skip
    text_table = table(meta, summary, speeds)
    if out_table:
        Path(out_table).write_text(text_table)
    print(text_table)
    return 0


def _ao_version() -> str:
    try:
        import torchao

        return torchao.__version__
    except Exception:
        return "?"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
