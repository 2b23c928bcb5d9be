"""`mixprec.tune_policy`: the smallest set of modules to keep in fp32, found on a few batches.

For each batch the model runs once in fp32 (the *shadow*: every module's output, the parameter
gradients, matmul FLOPs per module) and then under the candidate policy in the low dtype, with
the modules chosen so far kept in fp32, a `mixprec.watch_nonfinite` (``ops=True``) naming the
first inf/NaN, and the backward scaled the way a dynamic loss scaler would settle (the largest
power of two from `init_scale` down at which the gradients stay finite). Then, greedily, one
move per round, until nothing is left or the budget of moves is spent:

1. a forward overflow: move the module the watch names (the measured magnitude is that
   module's output in the fp32 shadow, the limit the low dtype's maximum; a module already in
   fp32 that is still named hands the move to its parent, whose own code overflows);
2. a backward overflow at a loss scale of 1 or below (no scale helps): move that module;
3. the model's output further than `act_tol` (relative L2) from the shadow's: move the first
   module, in execution order, whose output is further than `act_tol` from its shadow;
4. the gradients further than `grad_tol` from the shadow's (relative L2 over all parameters):
   move the module owning the parameter with the largest error; when most of that error is
   gradient elements flushed to zero at the settled scale, the move is reported as underflow,
   with the scale that would lift them as the alternative.

Each `TuneMove` records what crossed which limit, the errors before and after the move, and the
speed cost estimate: the module's share of the step's matmul FLOPs (forward and backward, from
``torch.utils.flop_counter``) times ``fp32_slowdown - 1``, the extra matmul time where fp32 runs
that many times slower than the low dtype (8 on V100/T4 tensor cores, about 2 on A100/H100 with
TF32). Dropout and other randomness draw the same numbers in every pass (a forked, seeded RNG),
so the comparison sees only precision; the user's RNG state is left alone.

Cost: per batch, one fp32 forward and backward, then per round one low-precision forward and
backward per scale tried; every pass keeps each module's output for the comparison. Several
host syncs per pass: a tuning tool, not the hot path. The model's weights are not changed (no
optimizer step); its gradients are restored afterwards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mixprec.diagnostics.watch import NonFiniteEvent, watch_nonfinite
from mixprec.dtypes import dtype_name, parse_device_type, resolve_dtype
from mixprec.eager.autocast import autocast
from mixprec.errors import ArgumentValueError, UsageError
from mixprec.levels.keep_fp32 import Fp32Modules
from mixprec.levels.model import amp_hooks
from mixprec.policy.fp32_modules import escalate, select_fp32
from mixprec.policy.policy import Policy, as_policy
from mixprec.step.batch import loss_from

__all__ = ["TuneMove", "TuneReport", "tune_policy"]

_SEED = 1234  # the RNG of every pass (dropout draws the same masks in fp32 and low precision)


@dataclass(frozen=True)
class TuneMove:
    """One module `tune_policy` keeps in fp32, and why.

    Attributes:
        module: its qualified name.
        why: ``'forward overflow'``, ``'backward overflow'``, ``'activation error'``,
            ``'gradient error'`` or ``'gradient underflow'``.
        measured: what crossed the limit: the module's largest output magnitude in the fp32
            shadow (overflows), or its relative error against the shadow.
        limit: the low dtype's largest value, or the error budget.
        detail: the same in words, with what to do instead where there is an alternative.
        error_before, error_after: the model output's relative error against the shadow
            before and after the move (inf: the output was not finite).
        grad_error_before, grad_error_after: the same for the gradients.
        flops: the module's share of the step's matmul FLOPs (forward and backward).
        cost: the estimated step-time increase, ``flops * (fp32_slowdown - 1)`` (matmul time).
    """

    module: str
    why: str
    measured: float
    limit: float
    detail: str
    error_before: float
    error_after: float
    grad_error_before: float
    grad_error_after: float
    flops: float
    cost: float

    def __str__(self) -> str:
        return (
            f"{self.module}: {self.why}: {self.detail}. Output error {_pct(self.error_before)} "
            f"-> {_pct(self.error_after)}, gradient error {_pct(self.grad_error_before)} -> "
            f"{_pct(self.grad_error_after)}; {self.flops:.1%} of the matmul FLOPs, cost about "
            f"+{self.cost:.1%} matmul time"
        )


@dataclass
class TuneReport:
    """What `tune_policy` found: the tuned `policy`, each move, the errors before and after.

    Attributes:
        policy: the input policy with the moved modules kept in fp32 (``policy=`` of
            ``initialize``, ``TrainStep``, the integrations).
        moves: the `TuneMove` s, in the order they were made.
        before, after: ``{'output_error', 'grad_error', 'overflow', 'scale'}`` of the input
            policy and of the tuned one (worst over the batches; the scale is the largest
            that kept the gradients finite, at most `init_scale`).
        underflow: per module whose gradients flush to zero at the settled scale, the advice
            (`mixprec.heal.underflow`), after the moves.
        notes: what could not be met, and why.
        settings: the budgets and assumptions used.
    """

    policy: Policy
    moves: list[TuneMove]
    before: dict[str, Any]
    after: dict[str, Any]
    underflow: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        s = self.settings
        lines = [
            f"tune_policy: {s.get('dtype')} on {s.get('device_type')}, {s.get('batches')} "
            f"batch(es); budgets: output error {_pct(s.get('act_tol', 0))}, gradient error "
            f"{_pct(s.get('grad_tol', 0))}, at most {s.get('max_moves')} moves",
            f"  before: {_state(self.before)}",
            f"  after:  {_state(self.after)}",
            f"  policy: {self.policy}",
        ]
        if not self.moves:
            lines.append("  no module needs fp32: the policy is fine as it is")
        for i, move in enumerate(self.moves, 1):
            lines.append(f"  {i}. {move}")
        lines += [f"  underflow: {u}" for u in self.underflow]
        lines += [f"  note: {n}" for n in self.notes]
        cost = sum(m.cost for m in self.moves)
        if self.moves:
            lines.append(
                f"  speed: the moves put {sum(m.flops for m in self.moves):.1%} of the matmul "
                f"FLOPs in fp32, about +{cost:.1%} matmul time where fp32 runs "
                f"{s.get('fp32_slowdown'):g}x slower than {s.get('dtype')}"
            )
        return "\n".join(lines)

    def to_json(self, indent: int | None = 2) -> str:
        """Everything, as JSON (the policy as its string form)."""
        doc = {"policy": str(self.policy), "moves": [asdict(m) for m in self.moves],
               "before": self.before, "after": self.after, "underflow": self.underflow,
               "notes": self.notes, "settings": self.settings}  # fmt: skip
        return json.dumps(doc, indent=indent, default=str)


def _pct(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x:.2%}"


def _state(s: dict[str, Any]) -> str:
    if s.get("overflow"):
        return f"overflows ({s['overflow']})"
    return (f"output error {_pct(s['output_error'])}, gradient error {_pct(s['grad_error'])} at "
            f"loss scale {s['scale']:g}")  # fmt: skip


def _first_float(value: Any) -> torch.Tensor | None:
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t
    return None


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error of `a` against `ref` (inf where `a` is not finite)."""
    a, ref = a.double(), ref.double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    den = float(ref.norm())
    return float((a - ref).norm()) / den if den > 0 else float((a - ref).norm())


@dataclass
class _Pass:
    """One run of one batch: module outputs, gradients, the first inf/NaN, the scale."""

    outputs: dict[str, torch.Tensor]
    order: list[str]  # modules in the order their forward finished
    grads: dict[str, torch.Tensor]
    event: NonFiniteEvent | None = None
    scale: float = 1.0
    flops: dict[str, float] = field(default_factory=dict)


class _Tuner:
    def __init__(self, model: nn.Module, batches: list[tuple[Any, ...]], loss: Callable[..., Any],
                 device_type: str, low: torch.dtype, policy: Policy,
                 init_scale: float) -> None:  # fmt: skip
        self.model = model
        self.batches = batches
        self.loss = loss
        self.device_type = device_type
        self.low = low
        self.policy = policy
        self.scales = [init_scale] * len(batches)
        self.init_scale = init_scale
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.owner = {n: n.rpartition(".")[0] for n in self.params}

    def _run(self, batch: tuple[Any, ...], *, low: bool, scale: float, kept: list[str],
             flops: bool = False) -> _Pass:  # fmt: skip
        model = self.model
        outputs: dict[str, torch.Tensor] = {}
        order: list[str] = []

        def hook(name: str) -> Callable[..., None]:
            def post(_m: nn.Module, _a: Any, out: Any) -> None:
                t = _first_float(out)
                if t is not None:
                    outputs[name] = t.detach().float().clone()
                    order.append(name)

            return post

        handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
        fp32 = Fp32Modules(model, self.device_type) if low and kept else None
        if fp32 is not None:
            fp32.set(kept)
        counter = None
        if flops:
            from torch.utils.flop_counter import FlopCounterMode

            counter = FlopCounterMode(display=False)
        for p in self.params.values():
            p.grad = None
        event = None
        try:
            with torch.random.fork_rng(devices=_rng_devices(self.device_type)):
                torch.manual_seed(_SEED)
                watch = watch_nonfinite(model, ops=True) if low else None
                if watch is not None:
                    watch.__enter__()
                try:
                    region = (autocast(self.device_type, dtype=self.low, policy=self.policy)
                              if low else autocast(self.device_type, enabled=False))  # fmt: skip
                    if counter is not None:
                        counter.__enter__()
                    try:
                        with region:
                            loss = self.loss(model, *batch)
                        (loss.float() * scale).backward()
                    finally:
                        if counter is not None:
                            counter.__exit__(None, None, None)
                finally:
                    if watch is not None:
                        event = watch.first
                        watch.__exit__(None, None, None)
        finally:
            for h in handles:
                h.remove()
            if fp32 is not None:
                fp32.remove()
        grads = {n: (p.grad.detach().double() / scale) for n, p in self.params.items()
                 if p.grad is not None}  # fmt: skip
        out = _Pass(outputs, order, grads, event, scale)
        if counter is not None:
            root = type(model).__name__
            counts = counter.get_flop_counts()
            total = float(sum(counts.get("Global", {}).values())) or 1.0
            for name, _ in model.named_modules():
                key = f"{root}.{name}" if name else root
                out.flops[name] = float(sum(counts.get(key, {}).values())) / total
        return out

    def reference(self) -> list[_Pass]:
        return [self._run(b, low=False, scale=1.0, kept=[], flops=i == 0)
                for i, b in enumerate(self.batches)]  # fmt: skip

    def evaluate(self, kept: list[str]) -> list[_Pass]:
        """Each batch in the low dtype with `kept` in fp32, at the largest finite scale."""
        passes = []
        for i, batch in enumerate(self.batches):
            scale = self.scales[i]
            while True:
                run = self._run(batch, low=True, scale=scale, kept=kept)
                e = run.event
                if e is None or e.phase == "forward" or scale <= 1.0:
                    break
                scale /= 2  # a gradient overflow: back off, as the scaler would
            self.scales[i] = scale if run.event is None else self.scales[i]
            passes.append(run)
        return passes


def _rng_devices(device_type: str) -> list[int]:
    if device_type == "cuda" and torch.cuda.is_available():
        return [torch.cuda.current_device()]
    return []


def _summary(runs: list[_Pass], refs: list[_Pass]) -> dict[str, Any]:
    overflow = next((str(r.event) for r in runs if r.event is not None), None)
    out_err, grad_err = 0.0, 0.0
    for run, ref in zip(runs, refs, strict=True):
        if "" in run.outputs and "" in ref.outputs:
            out_err = max(out_err, _rel(run.outputs[""], ref.outputs[""]))
        num = sum(float((run.grads[n] - g).pow(2).sum()) for n, g in ref.grads.items()
                  if n in run.grads)  # fmt: skip
        den = sum(float(g.pow(2).sum()) for g in ref.grads.values())
        grad_err = max(grad_err, math.sqrt(num / den) if den > 0 else math.sqrt(num))
    if overflow is not None:
        out_err = grad_err = math.inf
    scale = min(r.scale for r in runs)
    return {"output_error": out_err, "grad_error": grad_err, "overflow": overflow,
            "scale": scale}  # fmt: skip


def _inside(name: str, kept: Iterable[str]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in kept)


_Move = tuple[str, str, float, float, str]  # module, why, measured, limit, detail


def _next_move(
    model: nn.Module,
    runs: list[_Pass],
    refs: list[_Pass],
    kept: list[str],
    act_tol: float,
    grad_tol: float,
    low: torch.dtype,
) -> _Move | str | None:
    """The next module to keep, with why/measured/limit/detail; a string: why nothing can be
    moved; None: all budgets are met."""
    top = torch.finfo(low).max
    low_name = dtype_name(low)
    for run, ref in zip(runs, refs, strict=True):
        e = run.event
        if e is None:
            continue
        if e.module is None:
            return f"an op outside the model's modules produced inf/NaN ({e}); nothing to move"
        target, escalated = escalate(model, e.module, kept)
        if not target:
            return (f"the model's own forward (outside its submodules) produced the first "
                    f"inf/NaN ({e}); put that code in a submodule so it can be kept in "
                    f"fp32")  # fmt: skip
        op = f" in op {e.op}" if e.op else ""
        if e.phase == "forward":
            peak = float(ref.outputs[e.module].abs().max()) if e.module in ref.outputs else 0.0
            if escalated:
                detail = (f"its submodule {e.module!r} is in fp32 and still produced the first "
                          f"{e.kind}{op}: the overflow is in {target!r}'s own code around "
                          f"it")  # fmt: skip
            elif peak > top:
                detail = (f"its output reaches {peak:.3g} in the fp32 shadow, past {low_name}'s "
                          f"{top:.6g}: it becomes {e.kind}{op}")  # fmt: skip
            else:
                detail = (f"the first {e.kind} appears inside it{op} (its output peaks at "
                          f"{peak:.3g} in fp32, but an intermediate value passes {low_name}'s "
                          f"{top:.6g})")  # fmt: skip
            return target, "forward overflow", peak, top, detail
        detail = (f"its {e.phase.replace('-', ' ')} gradient became {e.kind}{op} at loss scale "
                  f"{run.scale:g}: the gradients overflow unscaled, which no scale "
                  f"fixes")  # fmt: skip
        return target, "backward overflow", math.inf, top, detail
    s = _summary(runs, refs)
    if s["output_error"] > act_tol:
        for run, ref in zip(runs, refs, strict=True):
            for name in run.order:
                if not name or _inside(name, kept) or name not in ref.outputs:
                    continue
                err = _rel(run.outputs[name], ref.outputs[name])
                if err > act_tol:
                    return (name, "activation error", err, act_tol,
                            f"its output is {_pct(err)} from the fp32 shadow's, the first module "
                            f"past the {_pct(act_tol)} budget in execution order")  # fmt: skip
    if s["grad_error"] > grad_tol:
        worst, worst_err, flushed = None, 0.0, 0.0
        for run, ref in zip(runs, refs, strict=True):
            for pname, g in ref.grads.items():
                owner = pname.rpartition(".")[0]
                if pname not in run.grads or not owner or _inside(owner, kept):
                    continue
                err = _rel(run.grads[pname], g)
                if err > worst_err:
                    lost = ((run.grads[pname] == 0) & (g != 0)).double().mean()
                    worst, worst_err, flushed = pname, err, float(lost)
        if worst is not None and worst_err > grad_tol:
            owner = worst.rpartition(".")[0]
            scale = min(r.scale for r in runs)
            if flushed > 0.01:
                return (owner, "gradient underflow", worst_err, grad_tol,
                        f"{flushed:.1%} of {worst!r}'s gradient flushes to zero in "
                        f"{low_name} at loss scale {scale:g} ({_pct(worst_err)} error); a "
                        f"higher scale would lift it where the other gradients allow one "
                        f"(min_loss_scale), fp32 lifts it always")  # fmt: skip
            return (owner, "gradient error", worst_err, grad_tol,
                    f"{worst!r}'s gradient is {_pct(worst_err)} from the fp32 shadow's "
                    f"(the largest error among the parameters)")  # fmt: skip
    return None


def tune_policy(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    compute_loss: Callable[..., torch.Tensor] | None = None,
    dtype: str | torch.dtype = "fp16",
    policy: Policy | str | None = None,
    device_type: str | None = None,
    act_tol: float = 0.05,
    grad_tol: float = 0.1,
    max_fraction: float = 0.1,
    init_scale: float = 2.0**16,
    fp32_slowdown: float = 8.0,
) -> TuneReport:
    """Find the smallest set of modules to keep in fp32 so that the low dtype trains like fp32.

    Runs each batch in fp32 and under the policy in `dtype`, and moves modules to fp32 one at a
    time (forward overflows first, then backward overflows, then the error budgets) until
    nothing overflows and the errors are within budget, or the budget of moves is spent. See
    `mixprec.heal.tune` for the rules and the cost estimate.

    Args:
        model: an fp32 model, not initialized yet (its weights are not changed).
        batches: a few batches (a list; each a tuple whose last element is the target, as for
            ``TrainStep``).
        loss_fn: ``loss_fn(model(*inputs), target)``; or `compute_loss`.
        compute_loss: ``compute_loss(model, *batch) -> loss`` instead of `loss_fn`.
        dtype: the low dtype (``'fp16'``; ``'bf16'`` works too, for its precision).
        policy: the policy to start from (default torch.autocast's lists); its fp32 modules
            are kept.
        device_type: the region's device (default: the model's).
        act_tol: the model output's relative L2 error budget against fp32.
        grad_tol: the gradients' relative L2 error budget against fp32.
        max_fraction: at most this fraction of the modules is moved (at least one).
        init_scale: the largest loss scale tried for the backward.
        fp32_slowdown: how many times slower fp32 matmuls run than `dtype`'s, for the cost
            estimate (8: V100, T4; about 2: A100 and H100 with TF32).

    Returns:
        A `TuneReport`: ``report.policy`` to train with, ``print(report)`` for every move.

    Raises:
        ArgumentValueError: no batch, or a tolerance or budget out of range (a ValueError).
        UsageError: a model already initialized, or not exactly one of loss_fn and compute_loss
            (a RuntimeError).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"tune_policy needs an nn.Module, got {type(model).__name__}.")
    if amp_hooks(model) is not None:
        raise UsageError(
            "tune_policy needs the plain fp32 model: this one was prepared by "
            "mixprec.initialize, whose own region would be measured instead. Tune first, then "
            "initialize with policy=report.policy."
        )
    for name, value, lo, hi in (("act_tol", act_tol, 0, math.inf), ("grad_tol", grad_tol, 0,
                                math.inf), ("max_fraction", max_fraction, 0, 1),
                                ("fp32_slowdown", fp32_slowdown, 1, math.inf),
                                ("init_scale", init_scale, 0, math.inf)):  # fmt: skip
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)
                and lo < value <= hi and math.isfinite(value)):  # fmt: skip
            raise ArgumentValueError(
                f"tune_policy {name}={value!r} must be a number in ({lo}, {hi}]."
            )
    batch_list = [b if isinstance(b, tuple) else tuple(b) if isinstance(b, list) else (b,)
                  for b in batches]  # fmt: skip
    if not batch_list:
        raise ArgumentValueError("tune_policy needs at least one batch (a list of a few batches).")
    if (loss_fn is None) == (compute_loss is None):
        raise UsageError(
            "tune_policy needs exactly one of loss_fn (loss_fn(model(*inputs), target)) and "
            "compute_loss (compute_loss(model, *batch) -> loss)."
        )
    start = as_policy(policy)
    if device_type is None:
        first = next(iter(model.parameters()), None)
        device_type = first.device.type if first is not None else "cpu"
    device_type = parse_device_type(device_type)
    low = resolve_dtype(device_type, dtype, start.compute).dtype
    tuner = _Tuner(model, batch_list, loss_from(loss_fn, compute_loss), device_type, low, start,
                   float(init_scale))  # fmt: skip
    saved = {n: p.grad for n, p in model.named_parameters()}
    try:
        refs = tuner.reference()
        flops = refs[0].flops
        kept = select_fp32(model, start.fp32_modules)
        modules = len([n for n, _ in model.named_modules() if n])
        max_moves = max(1, int(max_fraction * modules))
        runs = tuner.evaluate(kept)
        before = _summary(runs, refs)
        moves: list[TuneMove] = []
        notes: list[str] = []
        while True:
            found = _next_move(model, runs, refs, kept, act_tol, grad_tol, low)
            if found is None:
                break
            if isinstance(found, str):
                notes.append(found)
                break
            if len(moves) >= max_moves:
                notes.append(
                    f"{found[0]!r} would be next ({found[1]}: {found[4]}), but {len(moves)} "
                    f"moves are the budget (max_fraction={max_fraction:g} of {modules} "
                    f"modules): train in bf16, or allow more moves"
                )
                break
            target, why, measured, limit, detail = found
            was = _summary(runs, refs)
            kept = [k for k in kept if not k.startswith(target + ".")] + [target]
            runs = tuner.evaluate(kept)
            now = _summary(runs, refs)
            share = flops.get(target, 0.0)
            moves.append(TuneMove(target, why, measured, limit, detail, was["output_error"],
                                  now["output_error"], was["grad_error"], now["grad_error"],
                                  share, share * (fp32_slowdown - 1)))  # fmt: skip
        after = _summary(runs, refs)
        underflow = _underflow(runs, refs, kept, low)
    finally:
        for n, p in model.named_parameters():
            p.grad = saved.get(n)
    moved = [m.module for m in moves]
    tuned = start.keep_fp32(*moved) if moved else start
    settings = {"dtype": dtype_name(low), "device_type": device_type, "batches": len(batch_list),
                "act_tol": act_tol, "grad_tol": grad_tol, "max_moves": max_moves,
                "max_fraction": max_fraction, "init_scale": init_scale,
                "fp32_slowdown": fp32_slowdown}  # fmt: skip
    return TuneReport(tuned, moves, before, after, underflow, notes, settings)


def _underflow(
    runs: list[_Pass], refs: list[_Pass], kept: list[str], low: torch.dtype
) -> list[str]:
    """Modules whose gradients still flush to zero at the settled scale (over 1% of their
    elements nonzero in fp32 are zero here), with the advice of `mixprec.heal.underflow`."""
    from mixprec.heal.underflow import advise

    lost: dict[str, list[float]] = {}
    for run, ref in zip(runs, refs, strict=True):
        for pname, g in ref.grads.items():
            if pname in run.grads:
                frac = float(((run.grads[pname] == 0) & (g != 0)).double().mean())
                lost.setdefault(pname.rpartition(".")[0], []).append(frac)
    scale = min(r.scale for r in runs)
    out = []
    for module, fracs in lost.items():
        worst = max(fracs)
        if worst > 0.01 and not _inside(module, kept):
            out.append(advise(module, worst, scale, low, overflow_at_2x=False))
    return out
