"""`mixprec.watch_nonfinite`: find the first module, phase and op where a value became inf/NaN.

How it stays off the host: every checked tensor is reduced on its device to one number, its
largest magnitude (``vector_norm(t, inf)``, which is itself inf/NaN exactly when the tensor holds
one). Those numbers are queued; at the next step boundary (the model's next forward), they are
folded into a small per-step record on the device by a fixed handful of kernels: index of the
first non-finite value, of the first non-finite module-level value, the largest magnitude before
it and whether it was a NaN. Nothing is read back until you ask (`first`, `events`,
`magnitudes`) or an attached GradScaler reports a skipped step (which it reads anyway, once every
``check_every`` updates).

What is checked:
- *forward*: every module's floating outputs (post-hook);
- *input-grad*: the gradient w.r.t. each module's floating inputs (a hook on the input tensor;
  when several nested modules share an input, the innermost one is named);
- *param-grad*: each parameter's incoming gradient (scaled, as backward produces it);
- with ``ops=True`` also every aten op's floating output inside the model's forward and inside
  backward (a dispatch mode), which names the op: ``convolution``, ``addmm``,
  ``convolution_backward``, ...

Cost: one reduction kernel per checked tensor (a read of the tensor; with ``ops=True`` one per
op output, roughly doubling a small model's step time), a few kernels per step, a Python hook
per module call. No host-device synchronisation until a read. Measured by
``benchmarks/watch_overhead.py``. Use it to find a problem, not for every run: the hooks make
the step uncapturable (``TrainStep`` runs eagerly while a watch is active), and the dispatch mode
of ``ops=True`` is eager-only (not under ``torch.compile``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mixprec.errors import ArgumentTypeError, ArgumentValueError, UsageError

__all__ = ["NonFiniteEvent", "advice", "watch_nonfinite", "watcher_of"]

_INF = math.inf
_ACTIVE: weakref.WeakKeyDictionary[torch.nn.Module, watch_nonfinite] = weakref.WeakKeyDictionary()

#: Phases, in the words `NonFiniteEvent.phase` uses.
FORWARD, INPUT_GRAD, PARAM_GRAD, BACKWARD_OP = "forward", "input-grad", "param-grad", "backward"


def watcher_of(model: torch.nn.Module) -> watch_nonfinite | None:
    """The active watch on `model` (``TrainStep`` asks, to run eagerly while one is active)."""
    return _ACTIVE.get(model)


@dataclass(frozen=True)
class NonFiniteEvent:
    """The first non-finite value of one step.

    Attributes:
        module: qualified name of the module (``''`` is the root), or None when only an op in
            backward outside any watched module was seen.
        phase: ``'forward'`` (a module's or op's output), ``'input-grad'`` (gradient w.r.t. the
            module's input), ``'param-grad'`` (a parameter's gradient).
        op: the aten op that produced it (``ops=True``); None when not known.
        kind: ``'inf'`` or ``'nan'``.
        step: the watch's step (forward pass) index, from 0.
        max_before: the largest finite magnitude among the values checked before it in that step
            (close to the dtype's maximum, 65504 for fp16, means an overflow; small means a
            NaN from an invalid op such as 0/0 or sqrt of a negative).
        param: the parameter's qualified name, for ``'param-grad'``.
    """

    module: str | None
    phase: str
    op: str | None
    kind: str
    step: int
    max_before: float
    param: str | None = None

    def __str__(self) -> str:
        if self.param is not None:
            where = f"parameter {self.param!r}"
        elif self.module is not None:
            where = f"module {self.module!r}" if self.module else "the model itself (root module)"
        else:
            where = "an op outside the model's modules"
        what = {FORWARD: "forward output", INPUT_GRAD: "gradient w.r.t. the input",
                PARAM_GRAD: "parameter gradient", BACKWARD_OP: "backward"}[self.phase]  # fmt: skip
        op = f" (op {self.op})" if self.op else ""
        return (
            f"step {self.step}: first {self.kind} in the {what} of {where}{op}; largest finite "
            f"magnitude before it: {self.max_before:.4g}"
        )


# FP8 tensors: saturated by construction (no inf), and reductions over them are not supported;
# the tensors they were quantised from are checked instead.
_FP8_DTYPES = frozenset(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name)
)  # fmt: skip


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
            and t.dtype not in _FP8_DTYPES]  # fmt: skip


_aten = torch.ops.aten
# Ops whose output is finite whenever their input is (and views, which alias a checked tensor):
# skipping them saves a read of the tensor without ever missing the op that made an inf.
_CANNOT_OVERFLOW = frozenset({
    _aten.relu, _aten.threshold_backward, _aten.max_pool2d_with_indices,
    _aten.max_pool2d_with_indices_backward, _aten.clone, _aten.detach, _aten.alias,
    _aten.zeros_like, _aten.ones_like, _aten.empty_like, _aten.lift_fresh,
})  # fmt: skip


def _writes_inf(args: tuple, kwargs: dict | None) -> bool:
    """Whether an op is given an infinite Python number to write (``masked_fill(mask,
    -inf)``, ``full(..., -inf)``): its infinities are intended, not an overflow."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, float) and math.isinf(value):
            return True
    return False


def _widens(func: Any, args: tuple, out: Any) -> bool:
    """Whether `func` is a cast into a dtype whose range holds its source's (fp16 or bf16 to
    fp32, the cast before an fp32 softmax): it cannot overflow, so an infinity in its output
    was already in its input (a -inf attention mask), made by an op the watch saw before."""
    if func is _aten._to_copy.default:
        src, dst = args[0] if args else None, out
    elif func._overloadpacket is _aten.copy_:
        src, dst = args[1] if len(args) > 1 else None, out
    else:
        return False
    if not (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor)):
        return False
    if not (src.is_floating_point() and dst.is_floating_point()):
        return False
    if src.dtype in _FP8_DTYPES or dst.dtype in _FP8_DTYPES:
        return False
    return torch.finfo(dst.dtype).max >= torch.finfo(src.dtype).max


class _OpChecks(TorchDispatchMode):
    """Checks each aten op's output inside a watched forward or inside backward."""

    def __init__(self, watch: watch_nonfinite) -> None:
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._overloadpacket in _CANNOT_OVERFLOW:
            return out
        if _writes_inf(args, kwargs):
            return out  # an infinity on purpose: a -inf attention mask (masked_fill, full)
        if _widens(func, args, out):
            return out  # such a mask cast up for softmax: not where an infinity is made
        w = self.watch
        if w._modules:
            module, phase = w._modules[-1], FORWARD
        elif (node := torch._C._current_autograd_node()) is not None:
            if node.name().endswith("AccumulateGrad"):
                return out  # `.grad += g`: the incoming g is checked by the param-grad hook
            module, phase = None, BACKWARD_OP
        else:
            return out  # loss, optimizer, scaler: outside what the watch explains
        name = func._overloadpacket.__name__
        for t in _floats(out):
            w._check(t, module, phase, name, op_level=True)
        return out


class watch_nonfinite:
    """Watch a model for the first inf/NaN, per step, without a host sync per check.

    Args:
        model: the module to watch (all its submodules and parameters).
        ops: also check every aten op output (names the op; about one more reduction per op).
            `True`: from entering the watch to leaving it, every op of this thread (forward and
            backward) goes through the checking dispatch mode. ``"forward"``: only while the
            model's own forward runs (backward is checked per module and parameter, not per
            op): what healing uses, since its watches span training steps and must not leave
            a dispatch mode on other code (``torch.compile`` included).
        attach: a `mixprec.GradScaler` or `mixprec.TrainStep`: each overflowing update it reports
            (every ``check_every`` updates, when it reads its counters anyway) is diagnosed and
            appended to `skips`; on exit the scaler reports the updates since its last report
            (one host sync), so every skip while the watch was on is there.
        history: steps whose records stay on the device for `events`/`skips`.
        fp8_error: while the watch is active, FP8 layers (`mixprec.to_fp8`) also record the
            relative error of each output against fp32 (one fp32 matmul per layer and
            forward); `fp8()` reports it with the layers' scales and amaxes.

    Example::

        with mixprec.watch_nonfinite(model) as watch:
            with mixprec.autocast("cuda", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
        print(watch.first)  # step 0: first inf in the forward output of module 'layer3.1.conv2'

    A step is one forward of `model` (with its backward); gradient accumulation over k
    micro-batches makes k steps per optimizer update.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        ops: bool | str = True,
        attach: Any = None,
        history: int = 256,
        fp8_error: bool = False,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch_nonfinite needs a torch.nn.Module, got {type(model).__name__}.")
        if not (isinstance(history, int) and history >= 1):
            raise ArgumentValueError(f"watch_nonfinite history={history!r} must be an int >= 1.")
        if ops not in (True, False, "forward"):
            raise ArgumentValueError(
                f"watch_nonfinite ops={ops!r} is not valid. Valid: True (every op while the "
                f"watch is active), 'forward' (ops of the model's forward only) or False."
            )
        self.model = model
        self.ops = ops
        self.history = history
        self.skips: list[tuple[Any, NonFiniteEvent | None]] = []
        self._scaler = _scaler_of(attach)
        self._handles: list[Any] = []
        self._modules: list[str] = []
        self._pending: list[torch.Tensor] = []
        # Per queued check: module, phase, op, module-level (not an op), parameter name.
        self._meta: list[tuple[str | None, str, str | None, bool, str | None]] = []
        self._input_owner: dict[int, str] = {}
        # Event layouts seen so far -> (layout, positions of its module-level events); steps
        # usually repeat one layout, so each step stores a reference, not a copy.
        self._interned: dict[tuple, tuple[tuple, tuple[int, ...]]] = {}
        self._step_meta: list[tuple] = []  # per folded step: its interned (layout, positions)
        self._step_update: list[int] = []  # per folded step: the scaler's update index
        self._device: torch.device | None = None
        self._ring: torch.Tensor | None = None  # (history, 4): idx, module idx, peak, is-nan
        self._first: torch.Tensor | None = None  # (5,): step, idx, module idx, peak, is-nan
        self._last: torch.Tensor | None = None  # last step's magnitudes
        self._ring_read: tuple[int, list[list[float]]] | None = None  # (steps folded, ring)
        self._op_mode: _OpChecks | None = None
        self._remove_listener: Callable[[], None] | None = None
        self._update_at_start = 0
        self._fp8_error = fp8_error
        self._fp8_was: list[tuple[Any, bool]] = []

    # ------------------------------------------------------------------ enter / exit
    def __enter__(self) -> watch_nonfinite:
        if self.model in _ACTIVE:
            raise UsageError("this model is already watched; exit the other watch_nonfinite first.")
        _ACTIVE[self.model] = self
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(self._pre(name)))
            self._handles.append(module.register_forward_hook(self._post(name), always_call=True))
        for pname, p in self.model.named_parameters():
            if p.requires_grad:
                owner = pname.rpartition(".")[0]
                self._handles.append(p.register_hook(self._param_hook(owner, pname)))
        if self.ops is True:
            self._op_mode = _OpChecks(self)
            self._op_mode.__enter__()
        if self._scaler is not None:
            self._remove_listener = self._scaler.add_skip_listener(self._on_skip)
        if self._fp8_error:
            from mixprec.fp8.convert import fp8_layers

            self._fp8_was = [(m, m.measure_error) for _, m in fp8_layers(self.model)]
            for m, _ in self._fp8_was:
                m.measure_error = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._fold()
        if self._op_mode is not None:
            self._op_mode.__exit__(*exc)
            self._op_mode = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._remove_listener is not None:
            # The last updates' skips wait for the scaler's next report (every check_every
            # updates): have them reported now, while this watch still listens (one sync).
            self._scaler.report_skips_now()
            self._remove_listener()
            self._remove_listener = None
        _ACTIVE.pop(self.model, None)
        for m, was in self._fp8_was:
            m.measure_error = was
        self._fp8_was = []

    def fp8(self) -> Any:
        """The model's FP8 layers: scales in use, amaxes, and (with ``fp8_error=True``) the
        relative error of the last output against fp32. A `mixprec.Fp8Report`; one host sync."""
        from mixprec.fp8.report import fp8_report

        return fp8_report(self.model)

    def __repr__(self) -> str:
        return f"<watch_nonfinite {type(self.model).__name__} steps={len(self._step_meta)}>"

    @property
    def steps(self) -> int:
        """Steps recorded so far (a step is folded at the next forward, or at a read); no sync."""
        return len(self._step_meta)

    # ------------------------------------------------------------------ hooks
    def _pre(self, name: str) -> Callable[..., None]:
        def pre(_module: torch.nn.Module, args: tuple) -> None:
            if not self._modules and name == "":
                self._fold()  # a new forward of the root: the previous step is complete
                if self.ops == "forward" and self._op_mode is None:
                    self._op_mode = _OpChecks(self)  # for the root's forward only
                    self._op_mode.__enter__()
            self._modules.append(name)
            for t in _floats(args):
                if t.requires_grad:
                    first = id(t) not in self._input_owner
                    self._input_owner[id(t)] = name  # the innermost module wins
                    if first:
                        t.register_hook(self._input_hook(id(t)))

        return pre

    def _post(self, name: str) -> Callable[..., None]:
        def post(_module: torch.nn.Module, _args: tuple, out: Any) -> None:
            if self._modules:
                self._modules.pop()
            if not self._modules and self.ops == "forward" and self._op_mode is not None:
                self._op_mode.__exit__(None, None, None)  # runs even when the forward raised
                self._op_mode = None
            for t in _floats(out):
                self._check(t, name, FORWARD, None)

        return post

    def _input_hook(self, key: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._check(grad, self._input_owner.get(key), INPUT_GRAD, None)

        return hook

    def _param_hook(self, owner: str, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._check(grad, owner, PARAM_GRAD, None, param=name)

        return hook

    def _check(self, t: torch.Tensor, module: str | None, phase: str, op: str | None,
               op_level: bool = False, param: str | None = None) -> None:  # fmt: skip
        if not self._handles:
            return  # a hook on a tensor that outlived the watch
        if self._device is None:
            self._device = t.device
        elif t.device != self._device:
            t = t.to(self._device, non_blocking=True)
        if not t.numel() or t.is_complex():
            return
        if not self._pending and self._scaler is not None:
            self._update_at_start = self._scaler.host_updates  # the update this step feeds
        # inf norm = max |x|, inf/NaN exactly when t holds one: one reduction, no host read.
        self._pending.append(torch.linalg.vector_norm(t.detach(), _INF, dtype=torch.float32))
        self._meta.append((module, phase, op, not op_level, param))

    # ------------------------------------------------------------------ folding (device)
    def _fold(self) -> None:
        """Reduce the queued magnitudes of the finished step to its record (no host sync)."""
        if not self._pending:
            self._input_owner.clear()
            return
        dev = self._device
        a = torch.stack(self._pending)
        meta = tuple(self._meta)
        key = self._interned.get(meta)
        if key is None:
            key = self._interned[meta] = (meta, tuple(i for i, m in enumerate(meta) if m[3]))
        positions = key[1]
        # Module-level magnitudes on their own: which module shows a backward op's inf.
        am = torch.stack([self._pending[i] for i in positions]) if positions else None
        self._pending, self._meta = [], []
        self._input_owner.clear()
        step = len(self._step_meta)
        self._step_meta.append(key)
        self._step_update.append(self._update_at_start if self._scaler is not None else step)
        if self._ring is None:
            self._ring = torch.full((self.history, 4), -1.0, dtype=torch.float64, device=dev)
            self._first = torch.full((5,), -1.0, dtype=torch.float64, device=dev)
        bad = ~torch.isfinite(a)
        has = bad.any()
        idx = torch.argmax(bad.to(torch.uint8))  # the first non-finite (0 when none)
        if am is not None:
            mbad = ~torch.isfinite(am)
            midx = torch.where(mbad.any(), torch.argmax(mbad.to(torch.uint8)), -1)
        else:
            midx = torch.full((), -1, dtype=torch.int64, device=dev)
        n = torch.arange(a.numel(), device=dev)
        peak = torch.where(n < idx, a, 0.0).max()
        record = torch.stack([
            torch.where(has, idx, -1).double(), midx.double(), peak.double(),
            torch.isnan(a.index_select(0, idx.view(1))[0]).double(),
        ])  # fmt: skip
        self._ring[step % self.history] = record
        first = self._first
        take = has & (first[0] < 0)
        at = torch.full((1,), float(step), dtype=torch.float64, device=dev)
        first.copy_(torch.where(take, torch.cat([at, record]), first))
        self._last = a

    # ------------------------------------------------------------------ reading (syncs)
    def _event(self, step: int, rec: list[float]) -> NonFiniteEvent | None:
        idx, midx, peak, isnan = rec
        if idx < 0:
            return None
        meta, positions = self._step_meta[step]
        module, phase, op, _, param = meta[int(idx)]
        if module is None and midx >= 0:  # an op in backward: name the module that shows it
            module, phase, _, _, param = meta[positions[int(midx)]]
        if phase == BACKWARD_OP:
            phase = INPUT_GRAD
        return NonFiniteEvent(module, phase, op, "nan" if isnan else "inf", step, peak, param)

    @property
    def first(self) -> NonFiniteEvent | None:
        """The first non-finite value since the watch started; None if there was none.

        Cost: one host-device sync.
        """
        self._fold()
        if self._first is None:
            return None
        rec = self._first.tolist()
        if rec[0] < 0:
            return None
        return self._event(int(rec[0]), rec[1:])

    def _read_ring(self) -> list[list[float]] | None:
        """Fold, then the per-step records on the host: one sync, reused until the next fold."""
        self._fold()
        if self._ring is None:
            return None
        steps = len(self._step_meta)
        if self._ring_read is None or self._ring_read[0] != steps:
            self._ring_read = (steps, self._ring.tolist())
        return self._ring_read[1]

    def events(self) -> list[NonFiniteEvent]:
        """The first non-finite value of each of the last `history` steps that had one. Syncs."""
        ring = self._read_ring()
        if ring is None:
            return []
        steps = len(self._step_meta)
        out = []
        for step in range(max(0, steps - self.history), steps):
            event = self._event(step, ring[step % self.history])
            if event is not None:
                out.append(event)
        return out

    def summary(self) -> str:
        """Where the retained steps' first non-finite values were, most frequent first. Syncs.

        Ends with a suggested fix for the most frequent entry (see :func:`advice`).
        """
        events = self.events()
        if not events:
            return f"no inf/NaN in {len(self._step_meta)} steps"
        groups: dict[tuple, list[NonFiniteEvent]] = {}
        for e in events:
            groups.setdefault((e.module, e.phase, e.op, e.param, e.kind), []).append(e)
        lines = [f"{len(events)} of {min(len(self._step_meta), self.history)} steps had inf/NaN:"]
        for (_, _, _, _, _), group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            e = group[0]
            text = str(e).split(": ", 1)[1]
            steps = [g.step for g in group]
            span = f"steps {steps[0]}..{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
            lines.append(f"  {len(group):>5} x {text} ({span})")
        top = max(groups.values(), key=len)
        lines.append("suggested: " + advice(top[0], len(top), len(self._step_meta)))
        return "\n".join(lines)

    def magnitudes(self) -> list[dict[str, Any]]:
        """Largest magnitude per checked value of the last step (headroom below fp16's 65504).

        Module-level values only, in execution order. Cost: one host-device sync.
        """
        self._fold()
        if self._last is None:
            return []
        values = self._last.tolist()
        meta = self._step_meta[-1][0]
        return [{"module": m[0], "phase": m[1], "param": m[4], "max_abs": v}
                for m, v in zip(meta, values, strict=True) if m[3]]  # fmt: skip

    def event_at_update(self, update: int) -> NonFiniteEvent | None:
        """The first inf/NaN of the step that fed the attached scaler's update `update` (from 0).

        None when that step saw none or is no longer retained. Reads the per-step records once
        per fold (a sync), so asking about several updates of one batch costs one read.
        """
        ring = self._read_ring()
        steps = len(self._step_meta) if ring is not None else 0
        for step in range(max(0, steps - self.history), steps):
            if self._step_update[step] == update:
                event = self._event(step, ring[step % self.history])
                if event is not None:
                    return event
        return None

    def _on_skip(self, event: Any) -> None:
        # Called by the attached scaler while it reads its counters (already a sync point), once
        # per skipped update of the batch: the ring is read once for all of them.
        self.skips.append((event, self.event_at_update(event.step)))


def advice(event: NonFiniteEvent, count: int = 1, steps: int = 1) -> str:
    """What to do about `event`, seen on `count` of `steps` steps: the rules of thumb, as text.

    - NaN after only small values: an invalid operation (0/0, inf - inf, sqrt or log of a
      negative), not a range problem.
    - Forward values past the range: no loss scale helps (the forward is not scaled); run the op
      in fp32 or use bf16, whose range is fp32's.
    - Gradients, on a few steps: the scaler finding its ceiling, as designed.
    - Gradients on most steps: the scale cannot settle; something else is wrong.
    """
    where = event.param or event.module or "the model"
    op = f" ({event.op})" if event.op else ""
    if event.kind == "nan" and event.max_before < 1e4:
        return (
            f"the NaN in {where}{op} comes after values of at most {event.max_before:.3g}: an "
            "invalid operation (0/0, inf - inf, sqrt or log of a negative), not a range problem; "
            "guard that op (clamp, eps) rather than change precision."
        )
    if event.phase == FORWARD and event.op in ("_to_copy", "copy_") and event.module:
        # A cast down made the inf: what it cast was computed in fp32 (an op autocast keeps
        # in fp32, such as pow, or user code) and is past fp16 before this module reads it.
        return (
            f"values reaching {where!r} are past the low dtype's range (fp16: 65504) where "
            f"they are cast down for it ({event.op}, after a largest finite "
            f"{event.max_before:.3g}): they were computed in fp32 before it, and no loss scale "
            f"can fix a forward value. Keep it in fp32, Policy().keep_fp32({where!r}), or "
            "rescale what feeds it (mixprec.float_function on the function that computes it "
            "keeps that in fp32 too); or train in bf16, which has fp32's range."
        )
    if event.phase == FORWARD:
        keep = f"Policy().keep_fp32({where!r}), " if event.module else ""
        return (
            f"the forward of {where!r}{op} exceeds the low dtype's range (fp16: 65504), which no "
            f"loss scale can fix. Run it in fp32: {keep}decorate the function that computes it "
            "with mixprec.float_function, or move its op, Policy().move("
            f"{event.op or '<op>'!r}, to='fp32'); or train in bf16, which has fp32's range."
        )
    if count * 2 <= steps or count <= 3:
        return (
            f"gradient overflows on {count} of {steps} steps: the loss scaler finding its "
            "ceiling and backing off, as designed; nothing to fix."
        )
    return (
        f"gradients of {where}{op} overflow on {count} of {steps} steps: the scale cannot "
        "settle. Look for exploding activations or a too high learning rate; lower init_scale "
        "or set max_scale; or train in bf16."
    )


def _scaler_of(attach: Any) -> Any:
    if attach is None:
        return None
    from mixprec.scaling.scaler import GradScaler

    if isinstance(attach, GradScaler):
        return attach
    scaler = getattr(attach, "scaler", None)  # TrainStep, AmpOptimizer
    if isinstance(scaler, GradScaler):
        return scaler
    raise ArgumentTypeError(
        f"watch_nonfinite(attach=...) takes a mixprec.GradScaler, or a TrainStep/AmpOptimizer "
        f"that has one; got {type(attach).__name__}"
        + (" without a loss scaler (bf16 and O3 do not scale)." if scaler is None else ".")
    )
