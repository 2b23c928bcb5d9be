"""Rules: what the eager engine does to one call of one function, per category.

Numerics match torch.autocast's C++ wrappers (``aten/src/ATen/autocast_mode.h``):

- a tensor is *eligible* if it is on the region's device type, floating point and not fp64;
- LOWER / FP32 cast every eligible tensor argument (also inside lists) to the target dtype;
- FP32_OUTPUT passes ``dtype=torch.float32`` when the first argument is eligible and no dtype was
  given, which upcasts inside the kernel instead of materialising an fp32 copy;
- PROMOTE runs in fp32 if any eligible input is fp32, else in the low dtype; torch raises when a
  region's inputs are in the *other* 16-bit dtype (fp16 in a bf16 region, alone or mixed),
  mixprec promotes fp16 mixed with bf16 to fp32 and leaves inputs all in the other 16-bit dtype
  as they are (a cast between fp16 and bf16 loses bits either way);
- calls with ``out=`` are never cast (as in torch).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import _pop_mode, _push_mode

from mixprec._compat import autocast_state_traceable, dynamo_tracing
from mixprec.eager import composites
from mixprec.errors import BannedOpError
from mixprec.policy.categories import OpCategory
from mixprec.policy.entrypoints import op_name

__all__ = [
    "ArgumentSwitch",
    "DecomposeRule",
    "DeviceSwitch",
    "Guarded",
    "MethodCallRule",
    "ReentryRule",
    "Rule",
    "make_rule",
]

Tensor = torch.Tensor
_FP32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_cache_enabled = torch.is_autocast_cache_enabled
_set_enabled = torch.set_autocast_enabled
_enabled = torch.is_autocast_enabled
_FLOATS = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and d.is_floating_point and d is not torch.float64
)  # fmt: skip

# Specialised conversion methods parse their arguments faster than Tensor.to(dtype); they are
# the same op (aten::_to_copy, recorded by autograd).
_CONVERT = {
    torch.bfloat16: torch._C.TensorBase.bfloat16,
    torch.float16: torch._C.TensorBase.half,
    torch.float32: torch._C.TensorBase.float,
}

# Plain functions, not operator.attrgetter: torch.compile traces functions but not attrgetter.
_ON_DEVICE: dict[str, Callable[[Tensor], bool]] = {
    "cuda": lambda t: t.is_cuda,
    "cpu": lambda t: t.is_cpu,
    "xpu": lambda t: t.is_xpu,
    "mps": lambda t: t.is_mps,
}

_BANNED_FIXES = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
        "a sigmoid in low precision followed by log underflows. Use "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss "
        "(sigmoid and loss fused, safe in autocast). To run it in fp32 anyway: "
        "mixprec.Policy().move('binary_cross_entropy', to='fp32')."
    ),
}


def _convert(value: Tensor, dtype: torch.dtype) -> Tensor:
    conv = _CONVERT.get(dtype)
    return conv(value) if conv is not None else value.to(dtype)


def _weight_cache(mode: Any) -> dict | None:
    """The region's weight-cast cache, or None when caching is off or torch.compile traces.

    The switch is torch's autocast cache flag, which a region's ``cache_enabled`` sets (and a
    nested ``torch.autocast(cache_enabled=False)`` clears)."""
    if dynamo_tracing() or not _cache_enabled():
        return None  # dynamo: no tensor may outlive the trace (the graph path runs eagerly)
    return mode.cache


def _cast_one(cache: dict | None, value: Tensor, target: torch.dtype) -> Tensor:
    """Cast one eligible tensor; low-precision casts of fp32 weights go through `cache`.

    Like torch.autocast, only fp32 leaves that require grad (model weights) are cached, once per
    outermost region. Unlike torch, an entry is keyed by the weight *and its version counter*, so
    a weight updated in place inside a region is cast again, and nothing is cached while grad
    mode is off (such a cast has no autograd history).
    """
    conv = _CONVERT.get(target)
    if conv is None:
        return value.to(target)
    if (
        cache is not None
        and target is not _FP32
        and value.dtype is _FP32
        and value.requires_grad
        and value.is_leaf
    ):
        key = id(value)
        hit = cache.get(key)
        if hit is not None and hit[0] is value and hit[1] is target and hit[2] == value._version:
            return hit[3]
        out = conv(value)
        if _grad_enabled() and not value._is_view():
            cache[key] = (value, target, value._version, out)
        return out
    return conv(value)


def _cast_args(
    cache: dict | None,
    args: tuple,
    target: torch.dtype,
    src: frozenset[torch.dtype],
    on_device: Callable[[Tensor], bool],
    keep: frozenset[int | str],
) -> tuple:
    """Cast every eligible tensor in `args` (and in list/tuple arguments) to `target`."""
    out = None
    i = -1
    for a in args:
        i += 1
        if isinstance(a, Tensor):
            if a.dtype in src and on_device(a) and not (keep and i in keep):
                if out is None:
                    out = list(args)
                out[i] = _cast_one(cache, a, target)
        elif type(a) in (list, tuple) and a and isinstance(a[0], Tensor):
            if keep and i in keep:
                continue
            if out is None:
                out = list(args)
            out[i] = type(a)(
                _cast_one(cache, t, target)
                if isinstance(t, Tensor) and t.dtype in src and on_device(t) else t
                for t in a
            )  # fmt: skip
    return args if out is None else tuple(out)


def _cast_kwargs(cache, kwargs, target, src, on_device, keep) -> dict:
    out = None
    for k, v in kwargs.items():
        if isinstance(v, Tensor) and v.dtype in src and on_device(v) and k not in keep:
            if out is None:
                out = dict(kwargs)
            out[k] = _cast_one(cache, v, target)
    return kwargs if out is None else out


class Rule:
    """Apply one category to calls on one device type. Rules are shared and stateless.

    Build rules with :func:`make_rule`; each category is a subclass with its own ``__call__``
    (the hot path). The per-thread weight-cast cache lives on the mode, passed on each call.
    """

    __slots__ = ("category", "device_type", "keep", "low", "on_device", "restore", "src_fp32",
                 "src_low")  # fmt: skip

    category: OpCategory

    def __init__(
        self,
        device_type: str,
        low: torch.dtype,
        keep: tuple[int | str, ...] = (),
        restore: bool = False,
    ) -> None:
        self.device_type = device_type
        self.low = low
        self.keep = frozenset(keep)
        self.restore = restore
        self.on_device = _ON_DEVICE[device_type]
        self.src_low = _FLOATS - {low}
        self.src_fp32 = _FLOATS - {_FP32}

    def __repr__(self) -> str:
        extra = f", keep={sorted(map(str, self.keep))}" if self.keep else ""
        extra += ", restore" if self.restore else ""
        return f"{type(self).__name__}({self.device_type}, {self.low}{extra})"

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        raise NotImplementedError

    def _eligible(self, t: object) -> bool:
        return isinstance(t, Tensor) and t.dtype in _FLOATS and self.on_device(t)

    def _cast_to(self, mode, func, args, kwargs, target, src):
        if dynamo_tracing():
            return self._traced_cast_to(func, args, kwargs, target, src)
        cache = _weight_cache(mode)
        if kwargs:
            if "out" in kwargs:  # out= calls are never autocast (as in torch)
                return func(*args, **kwargs)
            args = _cast_args(cache, args, target, src, self.on_device, self.keep)
            kwargs = _cast_kwargs(cache, kwargs, target, src, self.on_device, self.keep)
            return func(*args, **kwargs)
        return func(*_cast_args(cache, args, target, src, self.on_device, self.keep))

    def _traced_cast_to(self, func, args, kwargs, target, src):
        """`_cast_to` as dynamo traces it, with the same casts: no weight cache (no tensor may
        outlive a trace) and no helper call per argument. Dynamo inlines every Python call it
        meets, at about a millisecond each, and the per-argument helpers of the eager path
        (`_cast_one`, the device check) made the mode most of the time to trace a model."""
        if kwargs and "out" in kwargs:  # out= calls are never autocast (as in torch)
            return func(*args, **kwargs)
        dev, keep = self.device_type, self.keep
        conv = _CONVERT.get(target)
        new = []
        i = -1
        for a in args:
            i += 1
            if keep and i in keep:
                pass
            elif isinstance(a, Tensor):
                if a.dtype in src and a.device.type == dev:
                    a = conv(a) if conv is not None else a.to(target)
            elif type(a) in (list, tuple) and a and isinstance(a[0], Tensor):
                items = []
                for t in a:
                    if isinstance(t, Tensor) and t.dtype in src and t.device.type == dev:
                        t = conv(t) if conv is not None else t.to(target)
                    items.append(t)
                a = type(a)(items)
            new.append(a)
        if not kwargs:
            return func(*new)
        named = {}
        for k, v in kwargs.items():
            if isinstance(v, Tensor) and v.dtype in src and v.device.type == dev and k not in keep:
                v = conv(v) if conv is not None else v.to(target)
            named[k] = v
        return func(*new, **named)


class LowerRule(Rule):
    """LOWER: eligible inputs to the low dtype (weights through the per-region cache)."""

    __slots__ = ()
    category = OpCategory.LOWER

    def __call__(self, mode, func, args, kwargs):
        if dynamo_tracing() and not self.restore:
            return self._traced_cast_to(func, args, kwargs, self.low, self.src_low)
        if kwargs or self.restore or self.keep:
            return self._general(mode, func, args, kwargs)
        # The hot path (F.linear(x, w, b), x @ w, ...): positional tensors only.
        low = self.low
        src = self.src_low
        on_device = self.on_device
        cache = _weight_cache(mode)
        out = None
        i = -1
        for a in args:
            i += 1
            if isinstance(a, Tensor):
                if a.dtype in src and on_device(a):
                    if out is None:
                        out = list(args)
                    out[i] = _cast_one(cache, a, low)
            elif type(a) in (list, tuple):
                return self._general(mode, func, args, kwargs)
        return func(*args) if out is None else func(*out)

    def _general(self, mode, func, args, kwargs):
        if self.restore:
            original = next((a.dtype for a in args if isinstance(a, Tensor)), None)
            out = self._cast_to(mode, func, args, kwargs, self.low, self.src_low)
            if isinstance(out, Tensor) and original is not None and out.dtype is not original:
                out = _convert(out, original)
            return out
        return self._cast_to(mode, func, args, kwargs, self.low, self.src_low)


class Fp32Rule(Rule):
    """FP32: eligible inputs to fp32."""

    __slots__ = ()
    category = OpCategory.FP32

    def __call__(self, mode, func, args, kwargs):
        return self._cast_to(mode, func, args, kwargs, _FP32, self.src_fp32)


class Fp32OutputRule(Rule):
    """FP32_OUTPUT: pass dtype=float32 when the first input is eligible and none was given."""

    __slots__ = ()
    category = OpCategory.FP32_OUTPUT

    def __call__(self, mode, func, args, kwargs):
        if kwargs and ("out" in kwargs or kwargs.get("dtype") is not None):
            return func(*args, **kwargs)
        first = args[0] if args else (kwargs or {}).get("input", (kwargs or {}).get("self"))
        if not self._eligible(first) or any(isinstance(a, torch.dtype) for a in args[1:]):
            return func(*args, **kwargs) if kwargs else func(*args)
        return func(*args, **{**(kwargs or {}), "dtype": _FP32})


class PromoteRule(Rule):
    """PROMOTE: fp32 if any eligible input is fp32 (or fp16 meets bf16), else the low dtype;
    inputs all in the other 16-bit dtype are left as they are."""

    __slots__ = ()
    category = OpCategory.PROMOTE

    def __call__(self, mode, func, args, kwargs):
        widest = None
        values = (*args, *kwargs.values()) if kwargs else args
        # Traced, the eligibility test is written out: each method call dynamo inlines costs
        # about a millisecond (see `_traced_cast_to`).
        dev = self.device_type if dynamo_tracing() else None
        for v in values:
            for t in v if type(v) in (list, tuple) else (v,):
                if (
                    isinstance(t, Tensor) and t.dtype in _FLOATS and t.device.type == dev
                    if dev is not None
                    else self._eligible(t)
                ):
                    if t.dtype is _FP32 or (widest is not None and t.dtype is not widest):
                        widest = _FP32  # torch raises on fp16 + bf16; fp32 holds both exactly
                        break
                    widest = t.dtype
            if widest is _FP32:
                break
        if widest is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        if widest is not _FP32 and widest is not self.low and widest.itemsize == self.low.itemsize:
            # All in the other 16-bit dtype (fp16 in a bf16 region): either cast loses bits
            # (fp16 -> bf16 drops mantissa, bf16 -> fp16 range), so the call keeps its dtype.
            # torch's dispatcher would raise on it ("Unexpected floating ScalarType"): off.
            return _without_torch_autocast(self.device_type, func, args, kwargs)
        target = _FP32 if widest is _FP32 else self.low
        src = self.src_fp32 if target is _FP32 else self.src_low
        return self._cast_to(mode, func, args, kwargs, target, src)


class BannedRule(Rule):
    """BANNED: refuse calls with a tensor on the region's device, naming the fix."""

    __slots__ = ()
    category = OpCategory.BANNED

    def __call__(self, mode, func, args, kwargs):
        values = (*args, *kwargs.values()) if kwargs else args
        if any(isinstance(v, Tensor) and self.on_device(v) for v in values):
            name = op_name(func) or getattr(func, "__name__", repr(func))
            fix = _BANNED_FIXES.get(
                name,
                f"The policy bans {name!r} in autocast regions on {self.device_type}. Call it "
                f"outside the region, or move it: policy.move({name!r}, to='fp32').",
            )
            raise BannedOpError(f"{name} was called inside a mixprec.autocast region. {fix}")
        return func(*args, **kwargs) if kwargs else func(*args)


_RULE_CLASSES: dict[OpCategory, type[Rule]] = {
    cls.category: cls for cls in (LowerRule, Fp32Rule, Fp32OutputRule, PromoteRule, BannedRule)
}


def make_rule(
    category: OpCategory,
    device_type: str,
    low: torch.dtype,
    keep: tuple[int | str, ...] = (),
    restore: bool = False,
) -> Rule:
    """The rule applying `category` on `device_type` (PASSTHROUGH has no rule)."""
    return _RULE_CLASSES[category](device_type, low, keep, restore)


def _without_torch_autocast(dev: str, func: Callable[..., Any], args: tuple, kwargs: dict | None):
    """Call `func` with torch's dispatcher-level autocast off for `dev` (see `Guarded`)."""
    if dynamo_tracing() and not autocast_state_traceable():
        # torch 2.11's dynamo traces torch.autocast but not the setter below.
        with torch.autocast(dev, enabled=False):
            return func(*args, **kwargs) if kwargs else func(*args)
    was = _enabled(dev)  # False under a Guarded rule, which restores True itself
    _set_enabled(dev, False)
    try:
        return func(*args, **kwargs) if kwargs else func(*args)
    finally:
        _set_enabled(dev, was)


class Guarded:
    """Run a call with torch's own (dispatcher-level) autocast off for one device type.

    A mixprec region switches torch's autocast state on, so that model code sees it; torch's
    dispatcher then applies *its* lists to every aten op below the mode. Where the policy agrees
    with torch's list for the device, that second pass finds the inputs already cast and does
    nothing. Where they differ (an edited policy, another base table, a user function whose
    body must run with autocast off, a composite mixprec deliberately runs in its input dtype),
    the call runs under this guard, so the decision stays the policy's.

    Cost: two C calls around the call (about 0.3 us); traced by torch.compile as two state
    changes, no graph break.
    """

    __slots__ = ("device_type", "inner")

    def __init__(self, inner: Any, device_type: str) -> None:
        self.inner = inner  # a rule, or None: pass the call through
        self.device_type = device_type

    def __repr__(self) -> str:
        return f"Guarded({self.inner!r}, {self.device_type})"

    @property
    def category(self) -> OpCategory:
        return getattr(self.inner, "category", OpCategory.PASSTHROUGH)

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        dev = self.device_type
        if dynamo_tracing() and not autocast_state_traceable():
            # torch 2.11's dynamo traces torch.autocast but not the setter below.
            with torch.autocast(dev, enabled=False):
                if self.inner is None:
                    return func(*args, **kwargs) if kwargs else func(*args)
                return self.inner(mode, func, args, kwargs)
        _set_enabled(dev, False)
        try:
            if self.inner is None:
                return func(*args, **kwargs) if kwargs else func(*args)
            return self.inner(mode, func, args, kwargs)
        finally:
            _set_enabled(dev, True)


class ReentryRule:
    """Run a Python-level torch function's body under the mode, so its inner ops get the policy."""

    __slots__ = ("copy", "opaque_to_dynamo", "outer")

    def __init__(self, func: types.FunctionType, outer: Any = None) -> None:
        self.copy = composites.reentrant_copy(func)
        # Dynamo does not trace the bodies of torch/functional.py's wrappers (torch.norm,
        # chain_matmul, tensordot: they call builtins it cannot follow) and records the original
        # as one call instead; `outer` is the rule of the op the wrapper is named after, if any.
        self.opaque_to_dynamo = func.__module__ == "torch.functional"
        self.outer = outer

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        if dynamo_tracing():
            if self.opaque_to_dynamo:
                if self.outer is not None:
                    return self.outer(mode, func, args, kwargs)
                return func(*args, **kwargs) if kwargs else func(*args)
            # No bookkeeping in a trace: the bounce guard only matters for eager recursion.
            _push_mode(mode)
            try:
                return self.copy(*args, **kwargs) if kwargs else self.copy(*args)
            finally:
                _pop_mode()
        active = mode.reentered
        if active:
            top_func, top_args = active[-1]
            if (
                top_func is func
                and len(top_args) == len(args)
                and all(a is b for a, b in zip(top_args, args, strict=True))
            ):
                # The wrapper bounced back to the mode with the very same arguments from inside
                # its own copy (a dispatch pattern the copy could not unwind): run it opaquely
                # rather than recurse forever. Genuine recursion (new arguments) re-enters.
                return func(*args, **kwargs) if kwargs else func(*args)
        active.append((func, args))
        composites.refresh_globals(self.copy)  # module globals patched since: seen, as torch does
        _push_mode(mode)
        try:
            return self.copy(*args, **kwargs) if kwargs else self.copy(*args)
        finally:
            _pop_mode()
            active.pop()


class ArgumentSwitch:
    """A composite whose inner op depends on its arguments (``pad``): decide per call."""

    __slots__ = ("other", "resolve", "rules")

    def __init__(
        self,
        resolve: Callable[[tuple, Any], str | None],
        rules: dict[str, Any],
        other: Any = None,
    ) -> None:
        self.resolve = resolve
        self.rules = rules  # inner op name -> rule
        self.other = other  # the rule for calls whose inner op the table does not list, or None

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        rule = self.rules.get(self.resolve(args, kwargs or {}) or "", self.other)
        if rule is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return rule(mode, func, args, kwargs)


class MethodCallRule:
    """Pass a Python-level Tensor method through; in a dynamo trace, as a method call.

    For methods whose bodies dynamo cannot inline when handed over as plain functions
    (``composites.super_calling_methods``: ``Tensor.unflatten`` calls ``super()``): without it,
    any compiled function reaching one inside a region (``nn.MultiheadAttention`` does) fell back
    to eager as a whole.
    """

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"MethodCallRule({self.name!r})"

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        if dynamo_tracing():
            return getattr(args[0], self.name)(*args[1:], **(kwargs or {}))
        return func(*args, **kwargs) if kwargs else func(*args)


class DecomposeRule:
    """Run a Python re-statement of a C++ composite under the mode (see `Via.decompose`)."""

    __slots__ = ("body",)

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body = body

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        if kwargs and "out" in kwargs:
            return func(*args, **kwargs)
        _push_mode(mode)
        try:
            return self.body(*args, **kwargs) if kwargs else self.body(*args)
        finally:
            _pop_mode()


class DeviceSwitch:
    """Regions enabled on several device types: pick the rule of the first tensor's device."""

    __slots__ = ("rules",)

    def __init__(self, rules: dict[str, Rule]) -> None:
        self.rules = rules

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        for v in list(args) + list((kwargs or {}).values()):
            items = v if type(v) in (list, tuple) else (v,)
            for t in items:
                if isinstance(t, Tensor):
                    rule = self.rules.get(t.device.type)
                    if rule is not None:
                        return rule(mode, func, args, kwargs)
                    return func(*args, **kwargs) if kwargs else func(*args)
        return func(*args, **kwargs) if kwargs else func(*args)
