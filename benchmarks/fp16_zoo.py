"""A zoo of fp16-unstable models: plain fp16 O1 vs tuned policy vs online healing vs bf16 vs fp32.

Four models built from real architectures, each at the magnitude where fp16 is known to fail
(the weights are scaled at build time, by a calibrating fp32 forward, so that the activation
that fails reaches the magnitude reported for real checkpoints and runs; no downloads):

- ``t5``: two T5 encoder blocks (RMS ``T5LayerNorm``, attention without logit scaling, ReLU
  feed-forward ``wi``/``wo``, no biases). The second block's ``wo`` output peaks at 1e5 in
  fp32: fine-tuning t5-base produced 66,246 there (transformers#5651), and t5 v1.1 / Flan-T5
  more, which is why Transformers keeps ``wo`` in fp32 (``_keep_in_fp32_modules = ["wo"]``).
- ``gpt_long``: a GPT-2 block stack with GPT-2's eager attention (``q @ k^T``, then the
  ``1/sqrt(d)`` scale: the product is formed unscaled, in fp16 under autocast) in the regime of
  attention-logit growth (Dehghani et al. 2023; GPT-2's ``reorder_and_upcast_attn`` exists for
  it). The largest of the T x T unscaled logits passes 65,504 at T=128 and stays below it at
  T=16 (both measured and written to the JSON).
- ``deep_prenorm``: 16 pre-norm blocks whose residual stream grows geometrically with depth
  (each block's writes x1.35 the previous block's, as residual norms grow exponentially in
  GPT-2, Heimersheim & Turner 2023). O1 keeps the residual itself in fp32 (the embedding is
  fp32), but each write is an fp16 matmul output: the last blocks' MLP writes pass 65,504.
- ``primer``: a Primer-style language model whose MLP is user code ``torch.relu(h) ** 2``
  (So et al. 2021's squared ReLU). ``pow`` is on autocast's fp32 list, so the square is
  computed in fp32; its 9e4 then meets the down projection, whose fp16 cast makes it inf.

Variants, each trained with ``mixprec.TrainStep`` (O1, the CUDA op lists on the CPU:
``table=cuda``, ``compile=False`` to keep the run short), AdamW, the same data:

- ``fp16``: plain fp16 O1 with dynamic loss scaling (seed 0);
- ``tuned``: fp16 O1 with ``mixprec.tune_policy(model, 2 batches)``'s policy (seed 0);
- ``heal``: fp16 O1 with ``heal=True`` (seed 0); TrainStep replays the steps a move explains
  (``HealConfig.replay``), so "skipped" counts steps the scaler skipped, of which "replayed"
  ran again after the move;
- ``bf16``, ``fp32``: seeds 0, 1, 2 (weights and data): the seed spread.

Goals checked per model (issue 26): where plain fp16 stalls (scale at its floor, >= 50% of
steps skipped, or a non-finite loss), healing's skipped steps after its last move are <= 2%,
its final loss (mean of the last 10 steps) is within the bf16/fp32 seeds' range (or below it:
better than every seed, which the table says), and it moves
<= 10% of the modules. Separately, ``--peers`` times healthy models (the bench workloads) with
and without ``heal=True`` in interleaved rounds: healing must move nothing and cost < 2%.

fp16 numerics are IEEE on the CPU: the overflows are the ones a GPU has. Timings are not the
point here (fp16 matmuls are slow on CPUs without fp16 units); losses, scales and skips are.

Usage::

    python benchmarks/fp16_zoo.py [--steps 150] [--models t5,gpt_long,deep_prenorm,primer]
        [--peers] [--json PATH] [--txt PATH] [--png PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.bench.report import cpu_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

FP16_MAX = 65504.0
GPU = "table=cuda"  # torch.autocast's CUDA lists: what the same code does on a GPU
VOCAB = 64


# ------------------------------------------------------------------ models


class RMSNorm(nn.Module):
    """T5LayerNorm: scale only, no mean, variance in fp32 (as Transformers computes it)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + 1e-6))


class Attention(nn.Module):
    """Multi-head self-attention written out (Transformers' eager attention): ``q @ k^T`` is
    formed first, then scaled by `scale` (T5: 1, no scaling; GPT-2: 1/sqrt(head dim))."""

    def __init__(self, d: int, heads: int, scale: float, causal: bool, bias: bool) -> None:
        super().__init__()
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, d, bias=bias)
        self.v = nn.Linear(d, d, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)
        self.heads, self.scale, self.causal = heads, scale, causal

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, -1).transpose(1, 2)
        return q @ k.transpose(-2, -1)  # unscaled, as GPT-2's and T5's eager attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        att = self.logits(x) * self.scale
        if self.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        v = self.v(x).view(b, t, self.heads, -1).transpose(1, 2)
        y = att.softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class T5FF(nn.Module):
    """T5DenseReluDense: wi -> relu -> dropout -> wo."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.wi = nn.Linear(d, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(self.dropout(torch.relu(self.wi(x))))


class T5Block(nn.Module):
    def __init__(self, d: int, heads: int, d_ff: int) -> None:
        super().__init__()
        self.ln_att = RMSNorm(d)
        self.att = Attention(d, heads, scale=1.0, causal=False, bias=False)
        self.ln_ff = RMSNorm(d)
        self.ff = T5FF(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.ln_att(x))
        return x + self.ff(self.ln_ff(x))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads, scale=(d // heads) ** -0.5, causal=True, bias=True)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = mlp if mlp is not None else MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class MLP(nn.Module):
    """GPT-2's MLP: c_fc -> GELU -> c_proj."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class SquaredReLU(nn.Module):
    """Primer's MLP with the user's own squared ReLU: ``torch.relu(h) ** 2``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c_fc(x)) ** 2  # user code: pow runs in fp32 under autocast
        return self.c_proj(h)


class LM(nn.Module):
    """Token embedding (+ learned positions) -> blocks -> final norm -> head."""

    def __init__(self, d: int, t: int, blocks: list[nn.Module], norm: nn.Module) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Embedding(t, d)
        self.blocks = nn.ModuleList(blocks)
        self.ln_f = norm
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------ calibration


def _peak(model: nn.Module, module: nn.Module, tokens: torch.Tensor,
          fn: Callable[[nn.Module, Any], torch.Tensor] | None = None) -> float:  # fmt: skip
    """The largest |value| `module` produces (or ``fn(module, its input)``) in an fp32 forward."""
    seen: list[float] = []

    def hook(m: nn.Module, args: Any, out: Any) -> None:
        value = fn(m, args[0]) if fn is not None else out
        seen.append(float(value.detach().abs().max()))

    handle = module.register_forward_hook(hook)
    with torch.no_grad():
        model.eval()
        model(tokens)
        model.train()
    handle.remove()
    return max(seen)


def _peaks(model: nn.Module, modules: list[nn.Module], tokens: torch.Tensor) -> list[float]:
    """The largest |output| of each of `modules` in one fp32 forward."""
    seen = [0.0] * len(modules)
    handles = [
        m.register_forward_hook(
            lambda _m, _a, out, i=i: seen.__setitem__(i, float(out.detach().abs().max()))
        )
        for i, m in enumerate(modules)
    ]
    with torch.no_grad():
        model.eval()
        model(tokens)
        model.train()
    for h in handles:
        h.remove()
    return seen


def _scale_to(model: nn.Module, module: nn.Module, weight: torch.Tensor, target: float,
              tokens: torch.Tensor) -> float:  # fmt: skip
    """Scale `weight` so that `module`'s output peaks at `target` in fp32; the peak it has."""
    for _ in range(3):  # the peak is not exactly linear in the scale (norms, residuals)
        peak = _peak(model, module, tokens)
        with torch.no_grad():
            weight.mul_(target / peak)
    return _peak(model, module, tokens)


@dataclass
class Zoo:
    name: str
    what: str
    build: Callable[[int], tuple[nn.Module, dict[str, Any]]]
    t: int
    batch: int
    task: str  # "map": targets are a fixed permutation of the tokens; "next": next token


def _tokens(t: int, batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, VOCAB, (batch, t), generator=g)


def build_t5(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    d, t = 32, 16
    model = LM(d, t, [T5Block(d, 2, 128) for _ in range(2)], RMSNorm(d))
    probe = _tokens(t, 8, 999)
    peaks = {}
    for i, target in enumerate((2.0e4, 1.0e5)):  # block 0 fits fp16, block 1 does not
        ff = model.blocks[i].ff
        peaks[f"blocks.{i}.ff.wo"] = _scale_to(model, ff.wo, ff.wo.weight, target, probe)
    return model, {"fp32 peak of wo outputs": peaks}


def build_gpt_long(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    d, t = 32, 128
    model = LM(d, t, [GPTBlock(d, 2) for _ in range(2)], nn.LayerNorm(d))
    attn = model.blocks[1].attn
    long = _tokens(t, 2, 999)

    def logit(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m.logits(x)

    target = 1.1 * FP16_MAX
    for _ in range(3):  # q and k alike: the logits grow with the square of their scale
        factor = (target / _peak(model, attn, long, logit)) ** 0.5
        with torch.no_grad():
            attn.q.weight.mul_(factor)
            attn.k.weight.mul_(factor)
    peak = _peak(model, attn, long, logit)
    short = _peak(model, attn, long[:, :16], logit)
    return model, {"fp32 peak of unscaled q.k logits": {"T=128": peak, "T=16": short}}


def build_deep(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    d, t, n = 16, 16, 16
    model = LM(d, t, [GPTBlock(d, 1) for _ in range(n)], nn.LayerNorm(d))
    probe = _tokens(t, 8, 999)
    projs = [block.mlp.c_proj for block in model.blocks]
    with torch.no_grad():
        for proj in projs:
            proj.bias.zero_()
    for _ in range(3):  # each block writes 1.35x the previous one (one forward per round)
        peaks = _peaks(model, projs, probe)
        with torch.no_grad():
            for i, (proj, peak) in enumerate(zip(projs, peaks, strict=True)):
                # the last two blocks' writes pass fp16's 65,504 (72k and 97k)
                proj.weight.mul_(1.1 * FP16_MAX * 1.35 ** (i - (n - 2)) / peak)
    peaks = _peaks(model, projs, probe)
    last = {f"blocks.{i}.mlp.c_proj": peaks[i] for i in range(n - 4, n)}
    return model, {"fp32 peak of MLP writes (last 4)": last}


def build_primer(seed: int) -> tuple[nn.Module, dict[str, Any]]:
    torch.manual_seed(seed)
    d, t = 32, 16
    blocks = [GPTBlock(d, 2, mlp=SquaredReLU(d)) for _ in range(2)]
    model = LM(d, t, blocks, nn.LayerNorm(d))
    probe = _tokens(t, 8, 999)
    fc = model.blocks[1].mlp.c_fc
    peak = _scale_to(model, fc, fc.weight, 300.0, probe)  # squared: 9e4
    return model, {"fp32 peak of the second block's relu(h)**2": peak**2}


ZOO = {
    z.name: z
    for z in (
        Zoo("t5", "T5 encoder, 2 blocks, wo peaks at 1e5 (t5-base fine-tuning: 66,246)",
            build_t5, 16, 8, "map"),
        Zoo("gpt_long", "GPT-2 eager attention, q.k past fp16 at T=128 (not at T=16)",
            build_gpt_long, 128, 2, "next"),
        Zoo("deep_prenorm", "16 pre-norm blocks, writes grow 1.35x per block",
            build_deep, 16, 4, "map"),
        Zoo("primer", "Primer squared ReLU in user code (relu(h)**2 peaks at 9e4)",
            build_primer, 16, 8, "map"),
    )
}  # fmt: skip


def batches(zoo: Zoo, seed: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The task: targets are a fixed permutation of each token ("map"), or of the previous
    token in a sequence that follows the permutation with 10% noise ("next")."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        if zoo.task == "map":
            x = torch.randint(0, VOCAB, (zoo.batch, zoo.t), generator=g)
            out.append((x, perm[x]))
            continue
        x = torch.empty(zoo.batch, zoo.t + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (zoo.batch,), generator=g)
        for i in range(zoo.t):
            noise = torch.rand(zoo.batch, generator=g) < 0.1
            rand = torch.randint(0, VOCAB, (zoo.batch,), generator=g)
            x[:, i + 1] = torch.where(noise, rand, perm[x[:, i]])
        out.append((x[:, :-1], x[:, 1:]))
    return out


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten())


# ------------------------------------------------------------------ runs


def run(zoo: Zoo, variant: str, seed: int, steps: int) -> dict[str, Any]:
    model, magnitudes = zoo.build(seed)
    data = batches(zoo, seed, steps)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kw: dict[str, Any] = {"compile": False}
    report = None
    if variant == "fp32":
        kw.update(opt_level="O0")
    elif variant == "bf16":
        kw.update(dtype="bf16", policy=GPU)
    else:
        kw.update(dtype="fp16", policy=GPU)
        if variant == "heal":
            kw["heal"] = True
        elif variant == "tuned":
            t0 = time.perf_counter()
            report = mixprec.tune_policy(model, data[:2], lm_loss, policy=GPU)
            tune_s = time.perf_counter() - t0
            kw["policy"] = report.policy
    step = mixprec.TrainStep(model, opt, lm_loss, **kw)
    modules = len([n for n, _ in step.model.named_modules() if n])
    losses, t0 = [], time.perf_counter()
    for x, y in data:
        losses.append(step(x, y))
    losses = [float(v) for v in torch.stack(losses).tolist()]  # one read at the end
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"model": zoo.name, "variant": variant, "seed": seed,
                           "losses": losses, "seconds": seconds, "modules": modules,
                           "magnitudes": magnitudes}  # fmt: skip
    scaler = step.scaler
    if scaler is not None:
        history = mixprec.scale_history(scaler)
        out["scales"] = [r["scale"] for r in history.rows]
        out["skipped"] = history.skipped
    healer = step.healer
    moved = []
    if healer is not None:
        moved = [m.as_dict() | {"text": str(m)} for m in healer.moves]
        out["heal"] = {"moves": moved, "diagnoses": healer.diagnoses, "notes": healer.notes,
                       "replayed": healer.replayed}  # fmt: skip
    if report is not None:
        out["tuned"] = {"policy": str(report.policy), "report": str(report), "seconds": tune_s,
                        "moves": [m.module for m in report.moves]}  # fmt: skip
    return out


def summarise(runs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per model: the goals of issue 26, measured."""
    out = {}
    for name in dict.fromkeys(r["model"] for r in runs):
        mine = {(r["variant"], r["seed"]): r for r in runs if r["model"] == name}

        def final(r: dict[str, Any]) -> float:
            tail = r["losses"][-10:]
            return sum(tail) / len(tail) if all(map(math.isfinite, tail)) else math.nan

        spread = [final(r) for (v, _), r in mine.items() if v in ("bf16", "fp32")]
        seeds = sorted({s for (v, s) in mine if v in ("bf16", "fp32")})
        lo, hi = min(spread), max(spread)
        row: dict[str, Any] = {"seed_range": [lo, hi], "seeds": seeds}
        for variant in ("fp16", "tuned", "heal"):
            r = mine.get((variant, 0))
            if r is None:
                continue
            skipped = r.get("skipped", [])
            scales = r.get("scales", [])
            stalled = (len(skipped) >= steps / 2 or (scales and scales[-1] < 1.0)
                       or not math.isfinite(final(r)))  # fmt: skip
            entry = {"final_loss": final(r), "skipped": len(skipped),
                     "skipped_fraction": len(skipped) / steps, "final_scale": scales[-1]
                     if scales else None, "stalled": bool(stalled),
                     "within_seed_range": bool(lo <= final(r) <= hi),
                     "below_seed_range": bool(final(r) < lo)}  # fmt: skip
            if variant == "heal":
                moves = r["heal"]["moves"]
                last = max((m["update"] for m in moves), default=-1)
                after = [s for s in skipped if s > last]
                entry.update(moves=[m["module"] for m in moves], moved_fraction=len(moves)
                             / r["modules"], skipped_after_last_move=len(after),
                             skipped_fraction_after=len(after) / max(1, steps - last - 1),
                             last_move_update=last,
                             replayed=r["heal"].get("replayed", 0))  # fmt: skip
            if variant == "tuned":
                entry["moves"] = r["tuned"]["moves"]
                entry["moved_fraction"] = len(entry["moves"]) / r["modules"]
            row[variant] = entry
        fp16, heal = row.get("fp16"), row.get("heal")
        if fp16 and heal:
            row["goal_met"] = (not fp16["stalled"]) or (
                heal["skipped_fraction_after"] <= 0.02
                and (heal["within_seed_range"] or heal["below_seed_range"])
                and heal["moved_fraction"] <= 0.10)  # fmt: skip
        out[name] = row
    return out


def peers(rounds: int, steps: int) -> list[dict[str, Any]]:
    """Healthy models (the bench workloads' small sizes): step time with and without heal."""
    from mixprec.bench.workloads import WORKLOADS

    rows = []
    for name in ("mlp", "gpt2"):
        workload = WORKLOADS[name]
        size = workload.reduced[1]
        times: dict[bool, list[float]] = {False: [], True: []}
        moved = []
        steps_of: dict[bool, Any] = {}
        for heal in (False, True):
            model, batch = workload.build(size.params, "cpu")
            loss_fn = workload.loss

            def compute(m: nn.Module, *b: Any, loss_fn: Any = loss_fn) -> torch.Tensor:
                return loss_fn(m(b[0]), b)

            steps_of[heal] = mixprec.TrainStep(model, workload.optimizer(model, "cpu"),
                                               compute_loss=compute, dtype="fp16", policy=GPU,
                                               heal=heal, compile=False)  # fmt: skip
            for _ in range(20):  # warm up: optimizer state, the scale's first skips
                steps_of[heal](*batch)
        for _ in range(rounds):
            for heal in (False, True):
                t0 = time.perf_counter()
                for _ in range(steps):
                    steps_of[heal](*batch)
                steps_of[heal].scaler.scale_tensor.item()
                times[heal].append((time.perf_counter() - t0) / steps)
        moved = [m.module for m in steps_of[True].healer.moves]
        off, on = statistics.median(times[False]), statistics.median(times[True])
        ratios = [b / a for a, b in zip(times[False], times[True], strict=True)]
        rows.append({"model": name, "size": size.description, "ms_off": off * 1e3,
                     "ms_on": on * 1e3, "ratio_median": statistics.median(ratios), "ratios": ratios,
                     "moves": moved, "diagnoses": steps_of[True].healer.diagnoses})  # fmt: skip
    return rows


# ------------------------------------------------------------------ output


def table(summary: dict[str, Any], peer_rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<13} {'variant':<6} {'final loss':>10} {'skipped':>8} {'scale':>9} "
             f"{'moves':<40} notes"]  # fmt: skip
    for name, row in summary.items():
        lo, hi = row["seed_range"]
        for variant in ("fp16", "tuned", "heal"):
            e = row.get(variant)
            if e is None:
                continue
            scale = "-" if e["final_scale"] is None else f"{e['final_scale']:.3g}"
            notes = []
            if e["stalled"]:
                notes.append("stalled")
            if variant == "heal":
                notes.append(f"{e['replayed']} of the skipped replayed; "
                             f"{e['skipped_after_last_move']} skipped after the last move "
                             f"({e['skipped_fraction_after']:.1%}), {e['moved_fraction']:.1%} "
                             f"of modules")  # fmt: skip
            notes.append("within seed range" if e["within_seed_range"] else
                         "below seed range (better than every seed)" if e["below_seed_range"]
                         else "OUTSIDE seeds")  # fmt: skip
            moves = "+".join(e.get("moves", [])) or "-"
            lines.append(f"{name:<13} {variant:<6} {e['final_loss']:>10.4f} {e['skipped']:>8} "
                         f"{scale:>9} {moves[:40]:<40} {'; '.join(notes)}")  # fmt: skip
        seeds = row.get("seeds", [0, 1, 2])
        which = f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else f"{seeds[0]}"
        lines.append(f"{name:<13} {'bf16/fp32 seeds ' + which + ': final loss in ['}{lo:.4f}, "
                     f"{hi:.4f}]; goal met: {row.get('goal_met')}")  # fmt: skip
    if peer_rows:
        lines += ["", "healthy models, heal=True vs off (median of interleaved rounds):"]
        for p in peer_rows:
            lines.append(f"  {p['model']} ({p['size']}): {p['ms_off']:.2f} -> {p['ms_on']:.2f} "
                         f"ms/step, ratio {p['ratio_median']:.3f}, moves {p['moves'] or 'none'}, "
                         f"diagnoses {p['diagnoses']}")  # fmt: skip
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: str) -> None:
    from mixprec._optional import require_matplotlib

    plt = require_matplotlib()
    names = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.2 * len(names)), squeeze=False)
    colors = {"fp16": "tab:red", "tuned": "tab:green", "heal": "tab:blue", "bf16": "tab:orange",
              "fp32": "black"}  # fmt: skip
    for row, name in enumerate(names):
        loss_ax, scale_ax = axes[row]
        for r in (r for r in runs if r["model"] == name):
            label = r["variant"] if r["seed"] == 0 else None
            style = "-" if r["variant"] in ("fp16", "tuned", "heal") else ":"
            ys = [v if math.isfinite(v) else float("nan") for v in r["losses"]]
            loss_ax.plot(ys, style, color=colors[r["variant"]], label=label, lw=1)
            if r.get("scales") and r["variant"] != "bf16":
                scale_ax.semilogy(r["scales"], color=colors[r["variant"]], label=label, lw=1)
            for m in r.get("heal", {}).get("moves", []):
                for ax in (loss_ax, scale_ax):
                    ax.axvline(m["update"], color="tab:blue", alpha=0.3, lw=0.8)
        loss_ax.set_title(f"{name}: loss (non-finite steps left out)")
        scale_ax.set_title(f"{name}: loss scale (blue lines: healing's moves)")
        loss_ax.legend(fontsize=7)
        scale_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150,
                        help="training steps per run (default: 150)")  # fmt: skip
    parser.add_argument("--models", default=",".join(ZOO),
                        help=f"comma-separated, from: {', '.join(ZOO)} (default: all)")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3,
                        help="bf16 and fp32 runs per model, seeds 0.. (their spread is the "
                        "accuracy band; default: 3)")  # fmt: skip
    parser.add_argument("--peers", action="store_true",
                        help="also time healthy models with heal on and off")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved timing rounds of --peers (default: 7)")  # fmt: skip
    parser.add_argument(
        "--json",
        default="benchmarks/results/fp16_zoo_cpu.json",
        metavar="PATH",
        help="every run's losses, scales and moves (default: %(default)s)",
    )
    parser.add_argument(
        "--txt",
        default="benchmarks/results/fp16_zoo_cpu.txt",
        metavar="PATH",
        help="the table (default: %(default)s)",
    )
    parser.add_argument(
        "--png",
        default="benchmarks/results/fp16_zoo_cpu.png",
        metavar="PATH",
        help="loss and loss scale per model (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    models = comma_list(parser, "--models", args.models, list(ZOO))
    torch.set_num_threads(min(2, torch.get_num_threads()))
    runs = []
    started = time.perf_counter()
    for name in models:
        zoo = ZOO[name]
        plan = [("fp16", 0), ("tuned", 0), ("heal", 0)]
        plan += [(v, s) for v in ("bf16", "fp32") for s in range(args.seeds)]
        for variant, seed in plan:
            r = run(zoo, variant, seed, args.steps)
            runs.append(r)
            print(
                f"{name:<13} {variant:<6} seed {seed}: final {r['losses'][-1]:.4f}, "
                f"skipped {len(r.get('skipped', []))}, {r['seconds']:.1f} s",
                flush=True,
            )
    summary = summarise(runs, args.steps)
    peer_rows = peers(args.rounds, 10) if args.peers else []
    text = table(summary, peer_rows)
    print(text)
    meta = {"command": " ".join(["python", *sys.argv]), "cpu": cpu_name(),
            "torch": torch.__version__, "mixprec": mixprec.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(),
            "steps": args.steps, "wall_s": time.perf_counter() - started,
            "models": {n: ZOO[n].what for n in models}}  # fmt: skip
    with open(args.json, "w") as fh:
        json.dump({"meta": meta, "summary": summary, "peers": peer_rows, "runs": runs}, fh,
                  indent=1)  # fmt: skip
    with open(args.txt, "w") as fh:
        fh.write(f"{meta['command']}\nCPU: {meta['cpu']}, torch {meta['torch']}, "
                 f"{meta['threads']} threads, {meta['wall_s']:.0f} s\n\n{text}\n")  # fmt: skip
    plot(runs, args.png)


if __name__ == "__main__":
    main()
