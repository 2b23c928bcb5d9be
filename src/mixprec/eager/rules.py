"""Rules: what the eager engine does to one call, per category. Also the compiled dispatch table.

A `DispatchTable` is a resolved policy turned into a ``{function object: rule}`` dict, so the hot
path of the mode is one dict lookup. Bindings are entered up front, by op name; anything else
(Python wrappers, ``torch.ops`` overloads, decorated user functions) is classified the first time
it is seen and memoised.

Numerics match torch.autocast's C++ wrappers (``aten/src/ATen/autocast_mode.h``):

- a tensor is *eligible* if it is on the region's device type, floating point and not fp64;
- LOWER / FP32 cast every eligible tensor argument (also inside lists) to the target dtype;
- FP32_OUTPUT passes ``dtype=torch.float32`` when the first argument is eligible and no dtype was
  given, which upcasts inside the kernel instead of materialising an fp32 copy;
- PROMOTE runs in fp32 if any eligible input is fp32, else in the low dtype; torch raises when a
  region mixes fp16 and bf16 inputs, mixprec promotes such calls to fp32 instead;
- calls with ``out=`` are never cast (as in torch).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import _pop_mode, _push_mode

from mixprec.errors import BannedOpError
from mixprec.policy.categories import OpCategory
from mixprec.policy.entrypoints import entry_points, op_name
from mixprec.policy.policy import CATEGORY_ATTR, Policy, ResolvedPolicy
from mixprec.eager import composites

__all__ = ["DispatchTable", "Region", "Rule", "dispatch_table"]

Tensor = torch.Tensor
_FP32 = torch.float32
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
    return _CONVERT[dtype](value) if dtype in _CONVERT else value.to(dtype)


class Rule:
    """Apply one category to calls on one device type. Rules are shared and stateless.

    The per-thread weight-cast cache lives on the mode; a rule receives the mode on each call.
    """

    __slots__ = (
        "category", "device_type", "keep", "low", "on_device", "restore", "src_fp32", "src_low",
    )  # fmt: skip

    def __init__(
        self,
        category: OpCategory,
        device_type: str,
        low: torch.dtype,
        keep: tuple[int | str, ...] = (),
        restore: bool = False,
    ) -> None:
        self.category = category
        self.restore = restore
        self.device_type = device_type
        self.low = low
        self.keep = frozenset(keep)
        self.on_device = _ON_DEVICE[device_type]
        self.src_low = _FLOATS - {low}
        self.src_fp32 = _FLOATS - {_FP32}

    def __repr__(self) -> str:
        keep = f", keep={sorted(map(str, self.keep))}" if self.keep else ""
        return f"Rule({self.category.value}, {self.device_type}, {self.low}{keep})"

    # ---- the hot path ----

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        if kwargs and "out" in kwargs:
            return func(*args, **kwargs)
        if self.restore:
            return self._call_restoring(mode, func, args, kwargs)
        cat = self.category
        if cat is OpCategory.LOWER:
            args, kwargs = self._cast(mode, args, kwargs, self.low, self.src_low)
        elif cat is OpCategory.FP32:
            args, kwargs = self._cast(mode, args, kwargs, _FP32, self.src_fp32)
        elif cat is OpCategory.FP32_OUTPUT:
            kwargs = self._fp32_output(args, kwargs)
        elif cat is OpCategory.PROMOTE:
            target = self._promote_target(args, kwargs)
            if target is not None:
                src = self.src_fp32 if target is _FP32 else self.src_low
                args, kwargs = self._cast(mode, args, kwargs, target, src)
        elif cat is OpCategory.BANNED:
            self._refuse(func, args, kwargs)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _call_restoring(self, mode, func, args, kwargs):
        original = next((a.dtype for a in args if isinstance(a, Tensor)), None)
        args, kwargs = self._cast(mode, args, kwargs, self.low, self.src_low)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if isinstance(out, Tensor) and original is not None and out.dtype is not original:
            out = _convert(out, original)
        return out

    def _cast(self, mode, args, kwargs, target, src):
        on_device = self.on_device
        keep = self.keep
        out = None
        for i, a in enumerate(args):
            if keep and i in keep:
                continue
            if isinstance(a, Tensor):
                if a.dtype in src and on_device(a):
                    if out is None:
                        out = list(args)
                    out[i] = mode.cast(a, target)
            elif type(a) in (list, tuple) and a and isinstance(a[0], Tensor):
                new = [
                    mode.cast(t, target) if isinstance(t, Tensor) and t.dtype in src
                    and on_device(t) else t
                    for t in a
                ]  # fmt: skip
                if out is None:
                    out = list(args)
                out[i] = type(a)(new)
        if out is not None:
            args = tuple(out)
        if kwargs:
            kw = None
            for k, v in kwargs.items():
                if isinstance(v, Tensor) and v.dtype in src and on_device(v) and k not in keep:
                    if kw is None:
                        kw = dict(kwargs)
                    kw[k] = mode.cast(v, target)
            if kw is not None:
                kwargs = kw
        return args, kwargs

    def _eligible(self, t: object) -> bool:
        return isinstance(t, Tensor) and t.dtype in _FLOATS and self.on_device(t)

    def _fp32_output(self, args: tuple, kwargs: dict | None) -> dict | None:
        first = args[0] if args else (kwargs or {}).get("input", (kwargs or {}).get("self"))
        if not self._eligible(first):
            return kwargs
        if kwargs and kwargs.get("dtype") is not None:
            return kwargs
        if any(isinstance(a, torch.dtype) for a in args[1:]):
            return kwargs  # an explicit positional dtype is respected
        new = dict(kwargs) if kwargs else {}
        new["dtype"] = _FP32
        return new

    def _promote_target(self, args: tuple, kwargs: dict | None) -> torch.dtype | None:
        widest = None
        values: list[Any] = list(args)
        if kwargs:
            values.extend(kwargs.values())
        for v in values:
            items = v if type(v) in (list, tuple) else (v,)
            for t in items:
                if self._eligible(t):
                    if t.dtype is _FP32:
                        return _FP32
                    if widest is None:
                        widest = t.dtype
                    elif t.dtype is not widest:
                        return _FP32  # fp16 mixed with bf16: torch raises; fp32 is exact
        return None if widest is None else self.low

    def _refuse(self, func: Callable[..., Any], args: tuple, kwargs: dict | None) -> None:
        values = list(args) + list((kwargs or {}).values())
        if not any(isinstance(v, Tensor) and self.on_device(v) for v in values):
            return
        name = op_name(func) or getattr(func, "__name__", repr(func))
        fix = _BANNED_FIXES.get(
            name,
            f"The policy bans {name!r} in autocast regions on {self.device_type}. Call it "
            f"outside the region, or move it: policy.move({name!r}, to='fp32').",
        )
        raise BannedOpError(f"{name} was called inside a mixprec.autocast region. {fix}")


class CallableRule(Rule):
    """A category applied to a dispatchable callable: cast its inputs, run its body unobserved.

    The body runs with autocast off (like ``custom_fwd(cast_inputs=...)``): the user declared the
    whole function's precision, so its inner ops are not re-decided one by one.
    """

    __slots__ = ()


class ReentryRule:
    """Run a Python-level torch function's body under the mode, so its inner ops get the policy."""

    __slots__ = ("copy",)

    def __init__(self, func: types.FunctionType) -> None:
        self.copy = composites.reentrant_copy(func)

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        active = mode.reentered
        if active:
            top_func, top_args = active[-1]
            if top_func is func and len(top_args) == len(args) and all(
                a is b for a, b in zip(top_args, args)
            ):
                # The wrapper bounced back to the mode with the very same arguments from inside
                # its own copy (a dispatch pattern the copy could not unwind): run it opaquely
                # rather than recurse forever. Genuine recursion (new arguments) re-enters.
                return func(*args, **kwargs) if kwargs else func(*args)
        active.append((func, args))
        _push_mode(mode)
        try:
            return self.copy(*args, **kwargs) if kwargs else self.copy(*args)
        finally:
            _pop_mode()
            active.pop()


class ArgumentSwitch:
    """A composite whose inner op depends on its arguments (``pad``): decide per call."""

    __slots__ = ("resolve", "rules")

    def __init__(
        self, resolve: Callable[[tuple, Any], str | None], rules: dict[str, Rule]
    ) -> None:
        self.resolve = resolve
        self.rules = rules  # inner op name -> rule (names the table does not list pass)

    def __call__(self, mode: Any, func: Callable[..., Any], args: tuple, kwargs: dict | None):
        rule = self.rules.get(self.resolve(args, kwargs or {}) or "")
        if rule is None:
            return func(*args, **kwargs) if kwargs else func(*args)
        return rule(mode, func, args, kwargs)


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


_MISS = object()


class DispatchTable:
    """A resolved policy per enabled device type, compiled to ``{function: rule}``.

    ``table.memo.get(func, MISS)`` answers a rule, None (pass through) or MISS (call `classify`).
    """

    MISS = _MISS

    def __init__(self, resolved: tuple[ResolvedPolicy, ...]) -> None:
        self.resolved = resolved
        self.memo: dict[Any, Any] = {}
        self._rules: dict[tuple[Any, ...], Rule] = {}
        self._ruled_names: set[str] = set()
        per_func: dict[Any, dict[str, Rule]] = {}
        for rp in resolved:
            for name, cat in rp.ops.items():
                if cat is OpCategory.PASSTHROUGH:
                    continue
                self._ruled_names.add(name)
                rule = self._rule(
                    rp, cat, keep=rp.keep.get(name, ()), restore=name in rp.restore
                )
                for fn in entry_points(name):
                    per_func.setdefault(fn, {})[rp.device_type] = rule
            for name, via in rp.dynamic.items():
                self._ruled_names.add(name)
                if via.decompose is not None:
                    special: Any = DecomposeRule(via.decompose)
                else:
                    inner_rules = {
                        inner: self._rule(rp, cat)
                        for inner, cat in rp.ops.items()
                        if cat is not OpCategory.PASSTHROUGH
                    }
                    special = ArgumentSwitch(via.resolve, inner_rules)  # type: ignore[arg-type]
                for fn in entry_points(name):
                    per_func.setdefault(fn, {})[rp.device_type] = special
        for fn, by_dev in per_func.items():
            self.memo[fn] = self._combine(by_dev)
        self._reentry_names: frozenset[str] | None = None

    def _rule(
        self,
        rp: ResolvedPolicy,
        cat: OpCategory,
        cls: type[Rule] = Rule,
        keep: tuple[int | str, ...] = (),
        restore: bool = False,
    ) -> Rule:
        key = (rp.device_type, cat, cls, keep, restore)
        rule = self._rules.get(key)
        if rule is None:
            rule = cls(cat, rp.device_type, rp.dtype, keep, restore)
            self._rules[key] = rule
        return rule

    @staticmethod
    def _combine(by_dev: dict[str, Rule]) -> Any:
        if len(by_dev) == 1:
            return next(iter(by_dev.values()))
        return DeviceSwitch(by_dev)

    def classify(self, func: Any) -> Any:
        """Find (and memoise) the rule for a function not entered up front; None = pass."""
        rule = self._classify(func)
        try:
            self.memo[func] = rule
        except TypeError:  # unhashable callables are classified on every call
            pass
        return rule

    def _classify(self, func: Any) -> Any:
        by_dev: dict[str, Rule] = {}
        name = op_name(func)
        declared = getattr(func, CATEGORY_ATTR, None)
        for rp in self.resolved:
            cat = None
            try:
                cat = rp.functions.get(func)
            except TypeError:
                pass
            if cat is None and name is not None:
                cat = rp.ops.get(name)
            if cat is None and declared is not None:
                cat = declared
            if cat is not None and cat is not OpCategory.PASSTHROUGH:
                cls = Rule if name is not None else CallableRule
                by_dev[rp.device_type] = self._rule(rp, cat, cls)
        if by_dev:
            return self._combine(by_dev)
        if composites.is_python_function(func) and self.resolved:
            if self._reentry_names is None:
                self._reentry_names = composites.transparent_names(frozenset(self._ruled_names))
            if composites.needs_reentry(func, self._reentry_names):
                return ReentryRule(func)
        return None


#: One enabled device type of a region: (device type, low dtype, policy).
Region = tuple[str, torch.dtype, Policy]


@functools.lru_cache(maxsize=64)
def dispatch_table(regions: tuple[Region, ...]) -> DispatchTable:
    """The compiled table for a set of enabled device types (cached: regions share tables)."""
    return DispatchTable(tuple(policy.resolve(dev, dtype) for dev, dtype, policy in regions))
