"""`mixprec.explain`: run one forward under the policy and report what ran in which precision.

The report is built by the engine itself, not by re-deriving the policy: `explain` installs a
recording subclass of the autocast mode, which applies the very same rules as
``mixprec.autocast`` and also notes, per call, the module it ran in, the rule's category and
reason, the dtypes in and out and every cast the rule made (seen by handing the rule a spy in
place of the function, so the spy receives the arguments *after* casting). A dispatch-level
counter below it attributes matmul/convolution FLOPs to the dtype they ran in.

Cost: several times a plain forward (Python work per call); meant for one example batch, not for
training. Numerics are untouched: the rules and the casts are those of ``mixprec.autocast``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import _pop_mode, _push_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mixprec.diagnostics.explain_report import _FP32_NAME, ExplainReport
from mixprec.dtypes import dtype_name, parse_device_type
from mixprec.eager.autocast import autocast
from mixprec.eager.mode import AutocastMode, find_mode
from mixprec.eager.rules import (
    ArgumentSwitch,
    DecomposeRule,
    DeviceSwitch,
    Guarded,
    ReentryRule,
    Rule,
)
from mixprec.errors import MixprecError, UsageError
from mixprec.fp8.convert import fp8_layers
from mixprec.fp8.recipe import format_name
from mixprec.fp8.report import fp8_report
from mixprec.levels.keep_fp32 import Fp32Modules
from mixprec.policy.categories import OpCategory
from mixprec.policy.entrypoints import op_name
from mixprec.policy.fp32_modules import select_fp32
from mixprec.policy.policy import Policy

if TYPE_CHECKING:
    from mixprec.graph.explain import CompiledReport

__all__ = ["ExplainDeviceError", "ExplainReport", "explain"]

_FP8_OP = "mixprec::fp8_linear"


def _flop_registry() -> dict[Any, Any]:
    try:
        from torch.utils.flop_counter import flop_registry
    except ImportError:  # pragma: no cover - present in every supported torch
        return {}
    return flop_registry


def _fp8_packet() -> Any:
    return torch.ops.mixprec.fp8_linear  # registered by mixprec.fp8 (imported with mixprec)


def _name(func: Any) -> str:
    name = op_name(func)
    if name is not None:
        return name
    return getattr(func, "__name__", None) or type(func).__name__


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def _dtypes(value: Any) -> list[str]:
    return [dtype_name(t.dtype) for t in _tensors(value)]


class _Flops(TorchDispatchMode):
    """Counts matmul/convolution FLOPs per dtype below the function mode (aten level)."""

    def __init__(self) -> None:
        super().__init__()
        self.registry = _flop_registry()
        self.current: Counter[str] = Counter()
        self.backward: Counter[str] = Counter()
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        count = self.registry.get(func._overloadpacket)
        if func._overloadpacket is _fp8_packet():  # an FP8 layer's forward GEMM: x (M,K), w (N,K)
            x, w = args[0], args[1]
            phase = self.current if self.phase == "forward" else self.backward
            phase["fp8"] += 2 * x.shape[0] * x.shape[1] * w.shape[0]
        elif count is not None:
            ins = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)]
            floating = [t.dtype for t in ins if t.is_floating_point()]
            key = dtype_name(floating[0]) if floating else "other"
            try:
                flops = int(count(*args, **kwargs, out_val=out))
            except Exception:
                flops = 0
            (self.current if self.phase == "forward" else self.backward)[key] += flops
        return out


@dataclass
class _Row:
    index: int
    module: str
    op: str
    category: str
    reason: str
    inputs: list[str]
    ran_in: list[str]
    outputs: list[str]
    casts: list[dict[str, Any]] = field(default_factory=list)
    flops: dict[str, int] = field(default_factory=dict)
    # Per floating input tensor: (the row that produced it, or None for a weight, buffer or
    # model input; whether a rule cast it). The data flow the ping-pong search follows
    # through ops that keep a value's dtype (relu, a view); not part of the JSON rows.
    sources: list[tuple[int | None, bool]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        executed = [c for c in self.casts if not c["cached"]]
        return {
            "index": self.index,
            "module": self.module,
            "op": self.op,
            "category": self.category,
            "reason": self.reason,
            "inputs": self.inputs,
            "ran_in": self.ran_in,
            "outputs": self.outputs,
            "casts": len(executed),
            "cast_bytes": sum(c["bytes"] for c in executed),
            "cached_casts": len(self.casts) - len(executed),
            "cast_detail": self.casts,
            "flops": self.flops,
        }


class _Recorder(AutocastMode):
    """The autocast mode, applying the same rules, that also writes one row per call."""

    def __init__(self, policy: Policy) -> None:
        super().__init__()
        self.policy = policy  # explain's own region; a model may open regions of its own
        self.rows: list[_Row] = []
        self.modules: list[str] = []
        self.flops: _Flops | None = None
        self.producer: dict[int, tuple[int, torch.Tensor]] = {}  # id(output) -> (row, output)
        self.edges: list[tuple[int, int, str, str, int]] = []  # producer, row, from, to, bytes
        self._reasons: dict[tuple[Any, ...], str] = {}
        self._busy = False
        self.fp8_reasons: dict[str, str] = {}  # FP8 layer name -> why the policy chose FP8
        self.fp8_formats: dict[str, str] = {}  # FP8 layer name -> 'e4m3' (its forward operands)
        self.fp32_modules: dict[str, str] = {}  # module kept in fp32 -> why (policy, healing)

    def _reason(self, name: str, category: str, func: Any, rule: Any, args: tuple) -> str:
        # The region in force decides (a model may open its own, e.g. an O1 model's policy).
        device = rule.device_type if isinstance(rule, (Rule, Guarded)) else None
        if device is None:
            device = next((t.device.type for t in _tensors(args)), None)
        region = next((r for r in self.regions if r[0] == device), None)
        if region is None:
            region = self.regions[0] if self.regions else ("cpu", torch.bfloat16, self.policy)
        device, low, policy = region
        key = (name, category, device, low, policy.serial)
        hit = self._reasons.get(key)
        if hit is None:
            try:
                target: Any = name if op_name(func) is not None else func
                hit = policy.decide(target, device_type=device, dtype=low).reason
            except (MixprecError, TypeError, ValueError):
                hit = "in no list: runs in its input dtype"
            self._reasons[key] = hit
        return hit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rule = self.lookup(func)
        if self._busy or isinstance(rule, (ReentryRule, DecomposeRule)):
            # A Python-level function re-entered under the mode: its inner calls get the rows.
            if rule is None:
                return func(*args, **kwargs) if kwargs else func(*args)
            return rule(self, func, args, kwargs)
        seen: dict[str, Any] = {}

        def spy(*a: Any, **k: Any) -> Any:
            seen["args"], seen["kwargs"] = a, k
            out = func(*a, **k)
            seen["raw"] = out
            return out

        category = _category(rule, args, kwargs)
        cached_before = {id(v[3]) for v in self.cache.values()}
        flops = self.flops
        if flops is not None:
            flops.current = Counter()
        if rule is None:
            out = spy(*args, **(kwargs or {}))
        else:
            self._busy = True
            try:
                out = rule(self, spy, args, kwargs)
            finally:
                self._busy = False
        outs = _tensors(out)
        if not outs:
            return out  # shape, dtype and other metadata queries: not arithmetic
        name = _name(func)
        row = _Row(
            index=len(self.rows),
            module=self.modules[-1] if self.modules else "",
            op=name,
            category=category,
            reason=self._reason(name, category, func, rule, args),
            inputs=_dtypes((args, kwargs)),
            ran_in=_dtypes((seen.get("args", ()), seen.get("kwargs", {}))),
            outputs=_dtypes(out),
            flops=dict(flops.current) if flops is not None else {},
        )
        if name == _FP8_OP:  # an FP8 layer's matmul: decided per layer by the FP8 module rules
            row.category = OpCategory.FP8.value
            row.reason = self.fp8_reasons.get(row.module, OpCategory.FP8.summary)
            # It ran on FP8 operands (the op's tensor arguments are its unquantised inputs and
            # its state), and its output is the first result (the others are FP8 copies).
            fmt = self.fp8_formats.get(row.module)
            if fmt is not None:
                row.ran_in = [fmt]
            row.outputs = row.outputs[:1]
        if category == OpCategory.FP32_OUTPUT.value and seen.get("kwargs", {}).get("dtype"):
            row.ran_in = [f"{_FP32_NAME}-acc"]  # upcast inside the kernel, no copy
        kept = _kept(row.module, self.fp32_modules)
        if kept is not None:  # autocast is off inside a module the policy or healing keeps
            row.category = OpCategory.FP32.value
            row.reason = f"in {kept!r}, kept in fp32: {self.fp32_modules[kept]}"
        self._note_casts(row, args, kwargs, seen, cached_before, out)
        self.rows.append(row)
        for t in outs:
            self.producer[id(t)] = (row.index, t)
        return out

    def _note_casts(self, row, args, kwargs, seen, cached_before, out) -> None:
        before = _tensors((args, kwargs))
        after = _tensors((seen.get("args", ()), seen.get("kwargs", {})))
        if len(before) == len(after):
            for src, dst in zip(before, after, strict=True):
                if src is dst or src.dtype == dst.dtype:
                    continue
                weight = src.is_leaf and src.requires_grad
                row.casts.append({
                    "from": dtype_name(src.dtype),
                    "to": dtype_name(dst.dtype),
                    "bytes": dst.numel() * dst.element_size(),
                    "cached": id(dst) in cached_before,
                    "weight": weight,
                })  # fmt: skip
                made = self.producer.get(id(src))
                if made is not None and made[1] is src:
                    last = row.casts[-1]
                    self.edges.append((made[0], row.index, last["from"], last["to"],
                                       0 if last["cached"] else last["bytes"]))  # fmt: skip
        reached = {id(t) for t in after}
        for t in before:
            if t.is_floating_point():
                made = self.producer.get(id(t))
                row.sources.append((made[0] if made is not None and made[1] is t else None,
                                    id(t) not in reached))  # fmt: skip
        raw = seen.get("raw")
        restored = isinstance(raw, torch.Tensor) and isinstance(out, torch.Tensor)
        if restored and raw is not out and raw.dtype != out.dtype:  # a rule restored the dtype
            row.casts.append({
                "from": dtype_name(raw.dtype), "to": dtype_name(out.dtype),
                "bytes": out.numel() * out.element_size(), "cached": False, "weight": False,
            })  # fmt: skip


def _kept(module: str, kept: dict[str, str]) -> str | None:
    """The kept module `module` runs inside (itself or an ancestor), if any."""
    for name in kept:
        if module == name or module.startswith(name + "."):
            return name
    return None


def _category(rule: Any, args: tuple, kwargs: dict | None) -> str:
    if rule is None:
        return OpCategory.PASSTHROUGH.value
    if isinstance(rule, Rule):
        return rule.category.value
    if isinstance(rule, Guarded):
        return _category(rule.inner, args, kwargs)
    if isinstance(rule, ArgumentSwitch):
        inner = rule.rules.get(rule.resolve(args, kwargs or {}) or "", rule.other)
        return _category(inner, args, kwargs)
    if isinstance(rule, DeviceSwitch):
        for t in _tensors((args, kwargs)):
            return _category(rule.rules.get(t.device.type), args, kwargs)
        return OpCategory.PASSTHROUGH.value
    return type(rule).__name__


class _ModuleStack:
    """Forward pre/post hooks that keep the qualified name of the running module."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        self.handles = []
        for qualname, module in model.named_modules():
            label = qualname or f"({type(module).__name__})"

            def pre(_m, _a, label=label):
                names.append(label)

            def post(_m, _a, _o):
                if names:
                    names.pop()

            self.handles.append(module.register_forward_pre_hook(pre))
            self.handles.append(module.register_forward_hook(post, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _fp32_modules(
    model: torch.nn.Module, policy: Policy, device_type: str
) -> tuple[Fp32Modules | None, dict[str, str]]:
    """The modules kept in fp32 for this forward, with their reasons: those the model's
    ``initialize`` keeps (its policy, healing's moves) and those `policy` keeps, which get
    hooks for this forward only (returned, to be removed)."""
    from mixprec.levels.model import amp_hooks

    hooks = amp_hooks(model)
    own = hooks.fp32 if hooks is not None else None
    reasons = dict(own.reasons) if own is not None else {}
    extra = None
    if policy.fp32_modules:
        wanted = [n for n in select_fp32(model, policy.fp32_modules) if n not in reasons]
        if wanted:
            extra = Fp32Modules(model, device_type)
            why = f"the policy keeps it (fp32_modules={'+'.join(policy.fp32_modules)})"
            extra.set(wanted, dict.fromkeys(wanted, why))
            reasons.update(extra.reasons)
    return extra, reasons


class ExplainDeviceError(MixprecError, ValueError):
    """`explain` was asked for a device type on which none of the model's tensors live."""


def _check_devices(model: torch.nn.Module, inputs: Any, device_type: str) -> None:
    """Refuse a region for a device the model and inputs are not on: it would change nothing,
    and the report would be a table of pass-through calls that looks like an answer."""
    found = {t.device.type for t in [*model.parameters(), *model.buffers(), *_tensors(inputs)]}
    if not found or device_type in found:
        return
    where = " and ".join(sorted(found))
    fix = (
        f"Move both there (model.to({device_type!r}) and the inputs' .to({device_type!r})), or "
        f"explain for where they are: device_type={sorted(found)[0]!r}."
    )
    if device_type == "cuda" and not torch.cuda.is_available():
        fix = (
            "This machine has no CUDA device: explain for where they are, device_type="
            f"{sorted(found)[0]!r}; to read the CUDA policy without a GPU, run "
            "`mixprec policy --device cuda` or call mixprec.Policy().decide(op, "
            "device_type='cuda')."
        )
    raise ExplainDeviceError(
        f"explain(device_type={device_type!r}): the model's parameters and the inputs are on "
        f"{where}, and a {device_type} region changes only ops on {device_type} tensors: every "
        f"call would pass through and the report would be empty. {fix}"
    )


def explain(
    model: torch.nn.Module,
    *example_inputs: Any,
    device_type: str | None = None,
    dtype: str | torch.dtype | None = None,
    policy: Policy | str | None = None,
    backward: bool = False,
    **forward_kwargs: Any,
) -> ExplainReport | CompiledReport:
    """Run ``model(*example_inputs)`` once under ``mixprec.autocast`` and report every call.

    For a model or function compiled with `mixprec.compile`, run it once and report the aten
    ops of each captured graph instead (a `mixprec.graph.explain.CompiledReport`).

    Args:
        model: the module to explain (its hooks are removed again afterwards).
        example_inputs: one batch, as the model's forward takes it.
        device_type: the region's device type (default: the device of the model's parameters,
            or of the first input tensor).
        dtype: the low dtype (default: the policy's, else the device's default).
        policy: a `mixprec.Policy` or its string form (default: torch.autocast's lists).
        backward: also run a backward pass from the sum of the outputs and count its FLOPs per
            dtype (backward ops follow the forward's dtypes; they are not rows).

    FP8 layers (`mixprec.to_fp8`) appear as rows of category ``fp8`` with the reason their
    module rule gave, and ``report.fp8`` lists each layer's scales, amaxes and the relative
    error of its output on this batch against fp32 (measured for this forward only). For a
    model not converted yet, a policy with FP8 rules gets ``report.fp8_plan``: which layers
    the rules would put in FP8, and why.
        forward_kwargs: keyword arguments of the forward.

    Returns:
        An :class:`ExplainReport`: ``str(report)`` is a table, ``report.rows`` the calls,
        ``report.to_json()`` everything.

    Raises:
        ExplainDeviceError: `device_type` names a device none of the model's parameters and
            inputs are on (the region would change nothing); the message says how to fix it.

    Cost: one forward (and backward) at several times the normal Python cost per call, plus
    the memory of keeping each output alive until the report is built (to attribute casts to
    the calls that produced their inputs). Values are computed exactly as under autocast.
    """
    compiled_by = getattr(model, "mixprec_backend", None)
    if compiled_by is not None:  # compiled with mixprec.compile: report its graphs' aten ops
        from mixprec.graph.explain import explain_compiled

        given = {"device_type": device_type, "dtype": dtype, "policy": policy,
                 "backward": backward or None}  # fmt: skip
        ignored = ", ".join(f"{k}=" for k, v in given.items() if v is not None)
        if ignored:
            raise UsageError(
                f"explain of a model compiled with mixprec.compile reports what its graphs ran "
                f"with the settings it was compiled with, so {ignored} cannot apply."
                f" Explain the uncompiled model with them, or compile it again with them "
                f"(mixprec.compile(model, policy=..., dtype=...))."
            )

        return explain_compiled(model, example_inputs, forward_kwargs, compiled_by)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"explain needs a torch.nn.Module, got {type(model).__name__}.")
    if find_mode() is not None:
        raise UsageError(
            "mixprec.explain was called inside a mixprec.autocast region; call it outside any "
            "region (it opens its own, with the device_type, dtype and policy you pass)."
        )
    if device_type is None:
        first = next(iter(model.parameters()), None)
        if first is None:
            first = next(iter(_tensors((example_inputs, forward_kwargs))), None)
        device_type = first.device.type if first is not None else "cpu"
    device_type = parse_device_type(device_type)
    _check_devices(model, (example_inputs, forward_kwargs), device_type)
    if isinstance(policy, str):
        policy = Policy.from_string(policy)
    region = autocast(device_type, dtype=dtype, policy=policy)
    recorder = _Recorder(region.policy)
    layers = fp8_layers(model)
    recorder.fp8_reasons = {name: layer.fp8_reason for name, layer in layers}
    recorder.fp8_formats = {name: format_name(layer.fp8_recipe.forward_dtype)
                            for name, layer in layers}  # fmt: skip
    tokens_before = [layer.fp8_tokens for _, layer in layers]
    for _, layer in layers:
        layer.fp8_tokens = 0  # set again by each FP8 layer this forward calls
    measuring = [layer.measure_error for _, layer in layers]
    for _, layer in layers:
        layer.measure_error = True  # this forward also records each FP8 layer's error
    flops = _Flops()
    recorder.flops = flops
    fp32, recorder.fp32_modules = _fp32_modules(model, region.policy, device_type)
    stack = _ModuleStack(model, recorder.modules)
    try:
        with flops:
            _push_mode(recorder)
            try:
                with region:
                    out = model(*example_inputs, **forward_kwargs)
            finally:
                _pop_mode()
            if backward:
                flops.phase = "backward"
                leaves = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
                if not leaves:
                    raise UsageError(
                        "explain(backward=True) needs an output that requires grad; the model's "
                        "outputs do not (is it in torch.no_grad, or are its parameters frozen?)."
                    )
                torch.autograd.backward([t.float().sum() for t in leaves])
    finally:
        stack.remove()
        if fp32 is not None:
            fp32.remove()
        for (_, layer), was in zip(layers, measuring, strict=True):
            layer.measure_error = was
    report = ExplainReport(recorder, device_type, region.dtype, flops, backward)
    report.fp32_modules = dict(recorder.fp32_modules)
    if layers:
        report.fp8 = fp8_report(model)
        report.fp8_not_called = [name for name, layer in layers if layer.fp8_tokens == 0]
        for (_, layer), before in zip(layers, tokens_before, strict=True):
            layer.fp8_tokens = layer.fp8_tokens or before
    elif region.policy is not None and region.policy.modules:
        report.fp8_plan = region.policy.plan_fp8(model)
    return report
