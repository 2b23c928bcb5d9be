"""FP8 training against bf16 over a few hundred steps: is FP8's loss within bf16's seed spread?

For each task (the seed MLP at a small width on a regression teacher, and the GPT-2-like decoder
``GPTConfig.tiny()`` on a Markov-chain token stream), every mode trains from the same seeds on
the same batches:

  bf16         mixprec O1 in bf16 (the reference)
  fp8 <name>   O1 in bf16 with the FP8 recipe <name> (tensorwise, delayed, rowwise, and
               true-delayed: delayed with overflow='saturate') on the
               layers of the default rule (every linear layer with sizes multiple of 16 except
               the first and the last)

A run's *final loss* is the mean training loss of its last 20 steps. bf16's seed-to-seed
spread is the range (max - min) of its final losses over the seeds; a recipe passes when the
mean of its final losses is within that spread of bf16's mean. Each seed changes the model's
initialisation and the batches.

Usage::

    python benchmarks/fp8_training.py [--tasks mlp,gpt] [--steps 300] [--seeds 3]
        [--recipes tensorwise,delayed,true-delayed,rowwise] [--json PATH] [--smoke]

``--smoke`` runs 20 steps and 2 seeds (seconds; checks that the script works). The default
takes a few minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.data import token_stream
from mixprec.bench.models import GPT, GPTConfig, seed_mlp
from mixprec.bench.report import metadata
from mixprec.fp8 import RECIPES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

TAIL = 20  # steps averaged into a run's final loss


def _mlp_task(seed: int, steps: int):
    g = torch.Generator().manual_seed(1000 + seed)
    teacher = torch.randn(256, 16, generator=torch.Generator().manual_seed(0)) / 16
    xs = [torch.randn(64, 256, generator=g) for _ in range(steps)]
    data = [(x, torch.tanh(x @ teacher)) for x in xs]
    torch.manual_seed(seed)
    model = nn.Sequential(seed_mlp(256, 4), nn.Linear(256, 16))

    def loss_of(m: nn.Module, batch) -> torch.Tensor:
        return F.mse_loss(m(batch[0]).float(), batch[1])

    return model, data, loss_of, 1e-3


def _gpt_task(seed: int, steps: int):
    cfg = GPTConfig.tiny()
    data = token_stream(cfg.vocab_size, 8, cfg.block_size + 1, steps, seed=seed)
    torch.manual_seed(seed)
    model = GPT(cfg)

    def loss_of(m: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = m(tokens[:, :-1]).float()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return model, data, loss_of, 3e-3


TASKS = {"mlp": _mlp_task, "gpt": _gpt_task}
#: Modes beyond the named recipes: true delayed scaling (no current-amax pass before a cast).
EXTRA = {"true-delayed": mixprec.Fp8Recipe.named("delayed").replace(overflow="saturate")}


def _recipe(name: str) -> mixprec.Fp8Recipe:
    return EXTRA.get(name) or mixprec.Fp8Recipe.named(name)


def run(task: str, mode: str, seed: int, steps: int) -> dict:
    """Train one (task, mode, seed); return its loss curve and final loss."""
    model, data, loss_of, lr = TASKS[task](seed, steps)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    fp8 = None if mode == "bf16" else _recipe(mode.split()[-1])
    model, opt = mixprec.initialize(model, opt, "O1", dtype="bf16",
                                    **({"fp8": fp8} if fp8 else {}))  # fmt: skip
    losses = []
    start = time.perf_counter()
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, batch)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    tail = losses[-min(TAIL, len(losses)) :]
    finite = all(v == v and abs(v) != float("inf") for v in losses)
    return {"task": task, "mode": mode, "seed": seed, "steps": steps, "final_loss": sum(tail) /
            len(tail), "first_loss": losses[0], "finite": finite, "seconds": seconds,
            "curve": losses[:: max(1, steps // 50)]}  # fmt: skip


def summarize(records: list[dict]) -> list[dict]:
    """Per task and mode: mean/min/max final loss, and whether it is within bf16's spread."""
    out = []
    for task in dict.fromkeys(r["task"] for r in records):
        ref = [r["final_loss"] for r in records if r["task"] == task and r["mode"] == "bf16"]
        ref_mean, spread = statistics.fmean(ref), max(ref) - min(ref)
        for mode in dict.fromkeys(r["mode"] for r in records if r["task"] == task):
            mine = [r for r in records if r["task"] == task and r["mode"] == mode]
            finals = [r["final_loss"] for r in mine]
            mean = statistics.fmean(finals)
            out.append({
                "task": task, "mode": mode, "seeds": len(mine), "final_mean": mean,
                "final_min": min(finals), "final_max": max(finals),
                "bf16_mean": ref_mean, "bf16_spread": spread,
                "diff_vs_bf16": mean - ref_mean,
                "within_bf16_spread": abs(mean - ref_mean) <= spread,
                "all_finite": all(r["finite"] for r in mine),
                "seconds_per_run": statistics.fmean(r["seconds"] for r in mine),
            })  # fmt: skip
    return out


def render(rows: list[dict]) -> str:
    lines = [f"{'task':<5} {'mode':<16} {'final loss mean [min..max]':<32} {'vs bf16':>9} "
             f"{'bf16 spread':>11}  within  s/run"]  # fmt: skip
    for r in rows:
        span = f"{r['final_mean']:.4f} [{r['final_min']:.4f}..{r['final_max']:.4f}]"
        lines.append(f"{r['task']:<5} {r['mode']:<16} {span:<32} {r['diff_vs_bf16']:>+9.4f} "
                     f"{r['bf16_spread']:>11.4f}  {'yes' if r['within_bf16_spread'] else 'NO':<6}"
                     f"  {r['seconds_per_run']:.1f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tasks",
        default="mlp,gpt",
        help=f"comma-separated tasks, from: {', '.join(TASKS)} (mlp: the seed MLP on a "
        "regression teacher; gpt: GPTConfig.tiny() on a Markov-chain token stream; "
        "default: %(default)s)",
    )
    parser.add_argument(
        "--recipes",
        default="tensorwise,delayed,true-delayed,rowwise",
        help="comma-separated FP8 recipes, each trained as a mode beside bf16, from: "
        f"{', '.join([*RECIPES, *EXTRA])} (default: %(default)s)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=300,
        help=f"training steps per run; the final loss is the mean of the last {TAIL} "
        "(default: %(default)s; 20 with --smoke)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="seeds per task and mode (0, 1, ...; each changes the initialisation and the "
        "batches) (default: %(default)s; 2 with --smoke)",
    )
    parser.add_argument("--json", default=None, help="write records and summary here")
    parser.add_argument("--smoke", action="store_true", help="20 steps, 2 seeds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.seeds = 20, 2
    tasks = comma_list(parser, "--tasks", args.tasks, list(TASKS))
    # Recipe names are read case-insensitively (as Fp8Recipe.named does).
    recipes = comma_list(parser, "--recipes", args.recipes.lower(), [*RECIPES, *EXTRA])
    modes = ["bf16"] + [f"fp8 {r}" for r in recipes]
    torch.set_num_threads(max(1, torch.get_num_threads()))
    records = []
    for task in tasks:
        for seed in range(args.seeds):
            for mode in modes:
                records.append(run(task, mode, seed, args.steps))
                r = records[-1]
                print(f"{task} {mode} seed {seed}: final {r['final_loss']:.4f} "
                      f"({r['seconds']:.1f} s)", file=sys.stderr)  # fmt: skip
    rows = summarize(records)
    print(render(rows))
    if args.json:
        meta = metadata("cpu")
        meta.update(command=" ".join(["python", "benchmarks/fp8_training.py", *sys.argv[1:]]),
                    steps=args.steps, seeds=args.seeds, tail=TAIL)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": rows, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
