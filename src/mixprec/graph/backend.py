"""`mixprec.compile` and `AmpBackend`: graph-level AMP as a ``torch.compile`` backend.

    compiled = mixprec.compile(model, policy="fp32=layer_norm", dtype="bf16")
    compiled = torch.compile(model, backend=mixprec.AmpBackend(dtype="bf16"))
    compiled = torch.compile(model, backend="mixprec")       # default policy, once installed

Each graph dynamo captures is run as if inside ``mixprec.autocast(device, dtype, policy)``:
recorded through the eager engine at aten level (`mixprec.graph.trace`), its casts minimised
(`mixprec.graph.casts`), then handed to the inner backend (``inductor`` by default,
``aot_eager`` or ``eager``), which derives the backward from the cast graph. Model code that
opens its own regions (``torch.autocast(enabled=False)``, an O1 model's region) keeps them: the
recorded graph replays its region changes.

Unlike a region around a compiled function, nothing is hidden from the policy here: the
``torch._C._nn`` losses, interpolation and padding, which no torch function mode sees while
dynamo traces, are ordinary nodes of the captured graph, so they get the policy too.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import fx
from torch.overrides import _pop_mode, _push_mode

from mixprec.dtypes import parse_device_type, resolve_dtype
from mixprec.eager.autocast import autocast
from mixprec.eager.mode import AutocastMode
from mixprec.errors import PolicyError, format_options
from mixprec.graph.casts import CAST_MODES, CastReport, minimise_casts
from mixprec.graph.kernels import KERNEL_MODES, KernelChoice, choose_kernels, summary
from mixprec.graph.lowering import keep_whole_in
from mixprec.graph.trace import (
    computes_gradients,
    own_gradients_inputs,
    own_gradients_run,
    trace_with_policy,
)
from mixprec.policy.categories import OpCategory
from mixprec.policy.policy import Policy, as_policy

__all__ = ["AmpBackend", "compile", "default_backend"]


class AmpBackend:
    """A ``torch.compile`` backend that applies a mixprec policy to every captured graph.

    Args:
        policy: a `mixprec.Policy` or its string form (default: torch.autocast's lists).
        dtype: the low dtype (default: the policy's, else the device's: fp16 CUDA, bf16 CPU).
        device_type: the device type of the region (default: that of the graph's first floating
            input tensor, parameters included).
        backend: the backend that compiles the result: a name (``'inductor'``, ``'aot_eager'``,
            ``'eager'``) or a backend callable.
        casts: ``'exact'``, ``'minimal'`` or ``'off'``: the cast-minimising pass (see
            `mixprec.graph.casts`).
        kernels: ``'auto'`` (measure each low-precision matmul, convolution and attention on
            this machine, natively and in fp32 on the same low-precision values, and keep the
            faster: CPUs without 16-bit units run the latter far faster), ``'native'`` or
            ``'fp32'`` (see `mixprec.graph.kernels`). On a CPU, ``'auto'`` and ``'fp32'`` also
            leave a few backward ops to torch's kernels where inductor's loop is far slower
            (`mixprec.graph.lowering`).

    Attributes:
        reports: one `CastReport` per compiled graph (casts and bytes before and after, the
            reason for each remaining cast, every aten op with its category and reason).
        kernel_choices: one `KernelChoice` per heavy low-precision op compiled (its route and
            the timings that chose it).

    Costs: at compile time, one extra trace of each graph, and with ``kernels='auto'`` on a CPU
    a timing of each distinct heavy op (a fraction of a second each, cached per process); at
    run time, nothing beyond the compiled graph itself. No host-device synchronisation.
    """

    def __init__(
        self,
        policy: Policy | str | None = None,
        dtype: str | torch.dtype | None = None,
        device_type: str | None = None,
        backend: str | Callable[..., Any] = "inductor",
        casts: str = "exact",
        kernels: str = "auto",
    ) -> None:
        policy = as_policy(policy)
        if kernels not in KERNEL_MODES:
            raise PolicyError(
                f"unknown kernels mode {kernels!r}; valid: {format_options(KERNEL_MODES)}."
            )
        if casts not in CAST_MODES:
            minimise_casts(fx.GraphModule({}, fx.Graph()), casts, _none, _none)  # the error
        if not (isinstance(backend, str) or callable(backend)):
            raise PolicyError(
                f"backend must be a torch.compile backend name ('inductor', 'aot_eager', "
                f"'eager') or a backend callable, got {type(backend).__name__} {backend!r}."
            )
        if isinstance(backend, str):
            from torch._dynamo import list_backends  # registered names (dynamo is loading anyway)

            names = list_backends(exclude_tags=())
            if backend not in names:
                close = difflib.get_close_matches(backend, names, n=1)
                raise PolicyError(
                    f"unknown backend {backend!r}."
                    + (f" Did you mean {close[0]!r}?" if close else "")
                    + " Common ones: 'inductor', 'aot_eager', 'eager' (torch._dynamo."
                    "list_backends(exclude_tags=()) lists all), or pass a backend callable."
                )
        self.policy = policy
        self.device_type = None if device_type is None else parse_device_type(device_type)
        if dtype is not None:
            resolve_dtype(self.device_type or "cpu", dtype)  # validate now, not at first call
        self.dtype = dtype
        self.backend = backend
        self.casts = casts
        self.kernels = kernels
        self.reports: list[CastReport] = []
        self.kernel_choices: list[KernelChoice] = []
        _keep_functions_whole(policy)

    def __repr__(self) -> str:
        return (
            f"mixprec.AmpBackend(policy={self.policy!r}, dtype={self.dtype!r}, "
            f"device_type={self.device_type!r}, backend={self.backend!r}, casts={self.casts!r}, "
            f"kernels={self.kernels!r})"
        )

    def region(self, example_inputs: list[Any]) -> tuple[str, torch.dtype]:
        """The (device type, low dtype) a graph with these inputs runs in."""
        device = self.device_type
        if device is None:
            # The first floating tensor's device; else any tensor's (a language model's step
            # takes token ids only, on the GPU); "cpu" only when no tensor comes in.
            tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
            floating = [t for t in tensors if t.is_floating_point()]
            device = parse_device_type((floating or tensors)[0].device.type if tensors else "cpu")
        return device, resolve_dtype(device, self.dtype, self.policy.compute).dtype

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """Compile one captured graph. `mode` and `options` are ``torch.compile``'s (it hands
        them to a callable backend): they go to the inner backend, inductor's included."""
        device, dtype = self.region(example_inputs)
        inner = _inner_backend(self.backend, mode, options)
        unkept = _unkept_operators(gm)
        if unkept:
            return self._as_region(gm, example_inputs, inner, unkept)
        own_gradients = computes_gradients(gm)
        if own_gradients:
            gm, example_inputs, lifted = own_gradients_inputs(gm, example_inputs)
        traced = trace_with_policy(gm, example_inputs, device, dtype, self.policy,
                                   kernels=self.kernels)  # fmt: skip
        category, reason = _deciders(self.policy, device, dtype)
        needs_grad = [isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs]
        report = minimise_casts(traced, self.casts, category, reason, len(self.reports), needs_grad)
        self.reports.append(report)
        self.kernel_choices += choose_kernels(traced, device, self.kernels)
        if inner == "eager":
            run = _without_torch_autocast(traced)
            return own_gradients_run(run, lifted) if own_gradients else run
        inner, kept = keep_whole_in(inner, self.backend, traced, device, self.kernels, mode,
                                    options)  # fmt: skip
        self.kernel_choices += kept
        # The graph carries every cast the policy wants: torch's own (dispatcher-level) autocast
        # must not apply its lists on top, neither while AOTAutograd traces it nor when it runs.
        # A graph that computes its own gradients is compiled as one with no backward.
        no_backward = torch.no_grad() if own_gradients else contextlib.nullcontext()
        with torch._C._DisableAutocast(), no_backward:
            compiled = inner(traced, example_inputs)
        run = _without_torch_autocast(compiled)
        return own_gradients_run(run, lifted) if own_gradients else run

    def _as_region(
        self, gm: fx.GraphModule, example_inputs: list[Any], inner: Any, unkept: list[str]
    ) -> Callable[..., Any]:
        """Compile `gm` as it was captured inside the region, without the re-trace.

        The re-trace runs a graph's nodes eagerly; a node such as a ``torch.autograd.Function``
        (``autograd_function_apply``) would run inlined there and lose its own backward. Such a
        graph is compiled as a region around a compiled function is: the calls dynamo showed
        the mode already carry the policy, and torch's own lists apply to the rest.
        """
        why = (
            f"kept as captured (a region around the graph, no cast pass): it calls "
            f"{', '.join(sorted(set(unkept)))}, which the re-trace cannot keep (a "
            f"torch.autograd.Function's own backward, activation checkpointing); ops no "
            f"function mode saw follow torch's lists here"
        )
        warnings.warn(f"mixprec.compile: graph {len(self.reports)} {why}.", stacklevel=2)
        self.reports.append(CastReport(len(self.reports), "region", 0, 0, note=why))
        return gm if inner == "eager" else inner(gm, example_inputs)

    def kernel_summary(self) -> str:
        """How each heavy low-precision op was computed, and why, as text."""
        if not self.kernel_choices:
            return "no heavy low-precision op measured (kernels='native', a GPU, or none yet)"
        return summary(self.kernel_choices)

    def summary(self) -> str:
        """All graphs' cast reports as text."""
        if not self.reports:
            return "no graph compiled yet: call the compiled function once"
        return "\n".join(str(r) for r in self.reports)


def _inner_backend(backend: Any, mode: str | None, options: dict[str, Any] | None) -> Any:
    """The compiler behind the cast pass, with ``torch.compile``'s `mode` / `options` (as
    ``torch.compile`` itself would configure it: inductor through its own wrapper, any other
    backend given them as keywords)."""
    if backend == "eager":
        return backend
    if backend == "inductor" and (mode or options):
        return torch._TorchCompileInductorWrapper(mode, options, None)
    if isinstance(backend, str):
        from torch._dynamo import lookup_backend

        backend = lookup_backend(backend)
    kwargs = {k: v for k, v in (("mode", mode), ("options", options)) if v}
    return functools.partial(backend, **kwargs) if kwargs else backend


#: Higher-order operators the re-trace may run inlined without changing what they compute.
_INLINE_SAFE = frozenset({"wrap"})


def _unkept_operators(gm: fx.GraphModule) -> list[str]:
    """Names of higher-order operators in `gm` that the re-trace cannot keep."""
    names = []
    for node in gm.graph.nodes:
        target = node.target
        hop = node.op == "call_function" and isinstance(target, torch._ops.HigherOrderOperator)
        if hop and target.name() not in _INLINE_SAFE:
            names.append(target.name())
    return names


def _keep_functions_whole(policy: Policy) -> None:
    """Make dynamo record calls of ``@mixprec.half_function`` & co (and of callables the policy
    moves) as single nodes instead of inlining their bodies, so that the re-trace under the
    region meets the call itself: its inputs are cast and its body runs with autocast off, as in
    eager. Uses torch's public ``torch.compiler.allow_in_graph``; functions decorated after the
    first compilation are inlined (decorate before compiling)."""
    from mixprec.eager.table import declared_functions

    movable = [ov.target for ov in policy.overrides if callable(ov.target)]
    for fn in [*declared_functions(), *movable]:
        torch.compiler.allow_in_graph(fn)


def _none(_name: str) -> Any:
    return OpCategory.PASSTHROUGH


def _deciders(
    policy: Policy, device: str, dtype: torch.dtype
) -> tuple[Callable[[str], OpCategory], Callable[[str], str]]:
    @functools.cache
    def decide(name: str) -> Any:
        try:
            return policy.decide(name, device_type=device, dtype=dtype)
        except PolicyError:  # a name the policy does not know: runs in its input dtype
            return None

    def category(name: str) -> OpCategory:
        d = decide(name)
        return OpCategory.PASSTHROUGH if d is None else d.category

    def reason(name: str) -> str:
        d = decide(name)
        return "in no list: runs in its input dtype" if d is None else d.reason

    return category, reason


def compile(
    model_or_fn: Any,
    *,
    policy: Policy | str | None = None,
    dtype: str | torch.dtype | None = None,
    device_type: str | None = None,
    backend: str | Callable[..., Any] = "inductor",
    casts: str = "exact",
    kernels: str = "auto",
    **compile_kwargs: Any,
) -> Any:
    """``torch.compile`` with the policy applied to every captured graph (see `AmpBackend`).

    Each call runs inside ``mixprec.autocast(device, dtype, policy)``, so that dynamo traces the
    code as it runs in a region (model code that asks ``torch.is_autocast_enabled()``, ops that
    only work once cast), and the backend then applies the policy to the whole captured graph,
    including the ops no function mode sees while dynamo traces.

    Args:
        model_or_fn: an ``nn.Module`` or a function (a whole training step's forward and loss,
            for example).
        policy: a `mixprec.Policy` or its string form (default: torch.autocast's lists).
        dtype: the low dtype (default: the policy's, else the device's: fp16 CUDA, bf16 CPU).
        device_type: the device type of the region (default: that of the first floating input).
        backend: the backend that compiles the result (``'inductor'``, ``'aot_eager'``, ...).
        casts: ``'exact'``, ``'minimal'`` or ``'off'`` (see `AmpBackend`).
        kernels: ``'auto'``, ``'native'`` or ``'fp32'``: how heavy low-precision ops are
            computed on a CPU (see `AmpBackend`).
        compile_kwargs: passed to ``torch.compile`` (``fullgraph``, ``dynamic``, ``mode``...).

    Returns:
        For a module, what ``torch.compile`` returns (with two hooks that open and close the
        region); for a function, a wrapper of the compiled function. Either has the attribute
        ``mixprec_backend``: the `AmpBackend` (``.reports``, ``.summary()``).

    Examples:
        >>> step = mixprec.compile(lambda x, y: F.cross_entropy(model(x), y), dtype="bf16")
        >>> loss = step(x, y)        # the loss in fp32, the matmuls in bf16, backward alike
    """
    amp = AmpBackend(policy=policy, dtype=dtype, device_type=device_type, backend=backend,
                     casts=casts, kernels=kernels)  # fmt: skip
    kept = None
    if isinstance(model_or_fn, torch.nn.Module) and amp.policy.fp32_modules:
        kept = _keep_fp32(model_or_fn, amp)  # before the first trace: dynamo bakes hooks in
    compiled = torch.compile(model_or_fn, backend=amp, **compile_kwargs)
    if kept is not None:
        compiled.mixprec_fp32 = kept
    if isinstance(model_or_fn, torch.nn.Module):
        state = _Region(amp, model_or_fn)
        compiled.register_forward_pre_hook(state.enter)
        compiled.register_forward_hook(state.exit, always_call=True)
        compiled.mixprec_backend = amp
        return compiled

    @functools.wraps(model_or_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _Region(amp, None).around(args, kwargs):
            return compiled(*args, **kwargs)

    run.mixprec_backend = amp  # type: ignore[attr-defined]
    return run


def _keep_fp32(model: torch.nn.Module, amp: AmpBackend) -> Any:
    """The policy's ``fp32_modules`` kept in fp32 on `model` (`mixprec.levels.keep_fp32`), as
    ``initialize`` keeps them: the hooks are added to the model (they stay on it). A model that
    ``initialize`` prepared with the policy has them already; they are not added twice.

    Raises:
        PolicyError: a selector that names no module of `model`.
    """
    from mixprec.levels.keep_fp32 import Fp32Modules
    from mixprec.policy.fp32_modules import select_fp32

    for module in model.modules():
        for hook in module._forward_pre_hooks.values():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, Fp32Modules) and owner.model is model:
                return owner
    first = next(iter(model.parameters()), None)
    device = amp.device_type or parse_device_type(first.device.type if first is not None
                                                  else "cpu")  # fmt: skip
    kept = Fp32Modules(model, device)
    kept.set(select_fp32(model, amp.policy.fp32_modules))
    return kept


class _Region:
    """The backend's region around each call (per thread): dynamo then traces the code as it
    runs in a region (``torch.is_autocast_enabled()`` branches, ops that only work once cast),
    and the backend applies the policy to the whole captured graph."""

    _local = threading.local()

    def __init__(self, amp: AmpBackend, module: torch.nn.Module | None) -> None:
        self.amp = amp
        self.module = module

    def _stack(self) -> list[autocast]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def open(self, tensors: list[Any]) -> autocast:
        device, dtype = self.amp.region(tensors)
        region = autocast(device, dtype=dtype, policy=self.amp.policy)
        region.__enter__()
        return region

    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        first = next(iter(self.module.parameters()), None) if self.module is not None else None
        self._stack().append(self.open([first] if first is not None else list(args)))

    def exit(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self._stack().pop().__exit__(None, None, None)

    @contextlib.contextmanager
    def around(self, args: tuple, kwargs: dict) -> Iterator[None]:
        region = self.open([*args, *kwargs.values()])
        try:
            yield
        finally:
            region.__exit__(None, None, None)


def _without_torch_autocast(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """Run an already cast graph with torch's dispatcher-level autocast off, so that nothing
    recasts its ops (the calls run inside the backend's region, where it is on)."""

    def run(*args: Any) -> Any:
        # The graph is cast already: mixprec's mode, still on the stack inside the region,
        # would only see the kernels' own calls (extern mm with out=, which no rule casts) and
        # charge its Python dispatch for each. Step it aside while the graph runs.
        mode = torch.overrides._get_current_function_mode()
        if isinstance(mode, AutocastMode):
            _pop_mode()
            try:
                with torch._C._DisableAutocast():
                    return compiled(*args)
            finally:
                _push_mode(mode)
        with torch._C._DisableAutocast():
            return compiled(*args)

    # Keep the boxed calling convention of AOTAutograd's compiled functions, if any.
    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run


def default_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """``torch.compile(model, backend="mixprec")``: the default policy, inductor, exact casts."""
    return AmpBackend()(gm, example_inputs)
