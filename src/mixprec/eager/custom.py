"""User code under autocast: ``custom_fwd``/``custom_bwd`` for autograd Functions, and decorators
that give a whole function a precision (Apex's ``half_function`` family, without patching).

``custom_fwd`` and ``custom_bwd`` follow ``torch.amp.custom_fwd``/``custom_bwd``, reading and
re-entering mixprec regions: the backward of a custom Function runs under the region (device,
dtype *and policy*) its forward ran under.

``half_function``, ``float_function`` and ``promote_function`` return a dispatchable wrapper:
inside a mixprec region its tensor inputs are cast as the category says and its body runs with
autocast off; outside a region it is the original function. The category is a default that a
policy can override with ``Policy.move(wrapper, to=...)``. No module or global registry is
modified.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, overload

import torch
from torch.overrides import _pop_mode, _push_mode, handle_torch_function, has_torch_function

from mixprec._compat import dynamo_tracing
from mixprec.dtypes import parse_device_type, parse_dtype
from mixprec.eager.autocast import _in_force, _region, autocast
from mixprec.eager.mode import find_mode
from mixprec.eager.table import declared_functions, tables
from mixprec.policy.categories import OpCategory
from mixprec.policy.policy import CATEGORY_ATTR

__all__ = [
    "checkpoint_context",
    "custom_bwd",
    "custom_fwd",
    "float_function",
    "half_function",
    "promote_function",
]

F = TypeVar("F", bound=Callable[..., Any])

# Attribute set on the autograd ctx: the (dtype, policy) of the forward's region, or None.
_CTX_ATTR = "_mixprec_fwd_region"


def _cast_inputs(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        eligible = (
            value.is_floating_point()
            and value.device.type == device_type
            and value.dtype is not torch.float64
        )
        return value.to(dtype) if eligible else value
    if isinstance(value, (str, bytes)):
        return value
    if isinstance(value, Mapping):
        return {k: _cast_inputs(v, device_type, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_inputs(v, device_type, dtype) for v in value)
    if isinstance(value, Iterable) and not isinstance(value, torch.nn.Module):
        return [_cast_inputs(v, device_type, dtype) for v in value]
    return value


@overload
def custom_fwd(
    fwd: None = None, *, device_type: str, cast_inputs: torch.dtype | str | None = None
) -> Callable[[F], F]: ...
@overload
def custom_fwd(fwd: F, *, device_type: str, cast_inputs: torch.dtype | str | None = None) -> F: ...
def custom_fwd(fwd=None, *, device_type, cast_inputs=None):
    """Decorate ``forward`` of a ``torch.autograd.Function`` for use inside mixprec regions.

    Args:
        device_type: the device type whose region state is recorded (``'cuda'``, ``'cpu'``, ...).
        cast_inputs: if given and the forward runs in an enabled region, cast its floating
            tensor inputs on `device_type` (not fp64) to this dtype and run the forward with
            autocast off; the backward then also runs with autocast off. If None, the forward
            runs under the region as is and the backward re-enters it.
    """
    device = parse_device_type(device_type)
    target = None if cast_inputs is None else parse_dtype(cast_inputs)
    if fwd is None:
        return functools.partial(custom_fwd, device_type=device, cast_inputs=target)
    _require_callable("custom_fwd", fwd)

    @functools.wraps(fwd)
    def decorate_fwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        region = _region(device)
        if target is None or region is None:
            setattr(ctx, _CTX_ATTR, None if region is None else (region[1], region[2]))
            return fwd(ctx, *args, **kwargs)
        setattr(ctx, _CTX_ATTR, None)
        with autocast(device, enabled=False):
            return fwd(
                ctx, *_cast_inputs(args, device, target), **_cast_inputs(kwargs, device, target)
            )

    return decorate_fwd


@overload
def custom_bwd(bwd: None = None, *, device_type: str) -> Callable[[F], F]: ...
@overload
def custom_bwd(bwd: F, *, device_type: str) -> F: ...
def custom_bwd(bwd=None, *, device_type):
    """Decorate ``backward`` of a ``torch.autograd.Function`` whose forward used `custom_fwd`.

    The backward runs under the region its forward ran under (same device, dtype and policy),
    or with autocast off if the forward ran outside a region or with ``cast_inputs``.
    """
    device = parse_device_type(device_type)
    if bwd is None:
        return functools.partial(custom_bwd, device_type=device)
    _require_callable("custom_bwd", bwd)

    @functools.wraps(bwd)
    def decorate_bwd(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(ctx, _CTX_ATTR):
            raise RuntimeError(
                f"{getattr(bwd, '__qualname__', 'backward')} is decorated with "
                f"mixprec.custom_bwd, but its forward was not decorated with "
                f"mixprec.custom_fwd(device_type={device!r}). Decorate both."
            )
        saved = getattr(ctx, _CTX_ATTR)
        if saved is None:
            with autocast(device, enabled=False):
                return bwd(ctx, *args, **kwargs)
        dtype, policy = saved
        with autocast(device, dtype=dtype, policy=policy):
            return bwd(ctx, *args, **kwargs)

    return decorate_bwd


def _require_callable(name: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(
            f"mixprec.{name} decorates a function, got {type(fn).__name__} {fn!r}. Use it as "
            f"@mixprec.{name} (or @mixprec.{name}(...)) on a def."
        )


_EARLIER_RULES = "_mixprec_earlier_rules"


def _declare(category: OpCategory, fn: F, decorator: str) -> F:
    _require_callable(decorator, fn)

    @functools.wraps(fn)
    def dispatchable(*args: Any, **kwargs: Any) -> Any:
        if dynamo_tracing():
            return _traced(dispatchable, fn, args, kwargs)
        relevant = (*args, *kwargs.values()) if kwargs else args
        if has_torch_function(relevant):
            return handle_torch_function(dispatchable, relevant, *args, **kwargs)
        return fn(*args, **kwargs)

    setattr(dispatchable, CATEGORY_ATTR, category)
    declared_functions().add(dispatchable)  # so every dispatch table enters it up front
    # Tables built before it keep their memo (growing it would recompile compiled code); the
    # function carries its rules under those tables itself, for traced calls (`_traced`).
    setattr(
        dispatchable,
        _EARLIER_RULES,
        {t.handle: t.rule_for_declared(dispatchable) for t in tables()},
    )
    return dispatchable  # type: ignore[return-value]


def _traced(dispatchable: Callable[..., Any], fn: Callable[..., Any], args: tuple, kwargs: dict):
    """A declared function met by dynamo: it evaluates ``has_torch_function`` as false for plain
    tensors, so the mode would never see the call and the body would be inlined past the
    policy. Apply the rule here as the mode does: inputs cast, the body run with the mode off."""
    mode = find_mode()
    if mode is None or torch.overrides._get_current_function_mode() is not mode:
        return fn(*args, **kwargs)
    rule = mode.lookup(dispatchable)  # tables built after the declaration have it in memo
    if rule is None:
        rule = getattr(dispatchable, _EARLIER_RULES).get(mode.table.handle)
    if rule is None:
        return fn(*args, **kwargs)
    _pop_mode()
    try:
        return rule(mode, fn, args, kwargs)
    finally:
        _push_mode(mode)


def half_function(fn: F) -> F:
    """Run `fn` in the low dtype inside mixprec regions: cast its floating inputs, autocast off.

    Use it for custom kernels that need half inputs (fused attention, custom CUDA ops). Outside a
    region the wrapper calls `fn` unchanged.

    Examples:
        >>> @mixprec.half_function
        ... def attention(q, k, v): ...
    """
    return _declare(OpCategory.LOWER, fn, "half_function")


def float_function(fn: F) -> F:
    """Run `fn` in fp32 inside mixprec regions: cast its floating inputs to fp32, autocast off."""
    return _declare(OpCategory.FP32, fn, "float_function")


def promote_function(fn: F) -> F:
    """Run `fn` in the widest floating dtype among its inputs inside mixprec regions."""
    return _declare(OpCategory.PROMOTE, fn, "promote_function")


@contextlib.contextmanager
def _reenter(regions: tuple) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, dtype, policy in regions:
            stack.enter_context(autocast(device, dtype=dtype, policy=policy))
        yield


def checkpoint_context() -> tuple[contextlib.AbstractContextManager, ...]:
    """A ``context_fn`` for ``torch.utils.checkpoint``: recompute under the forward's regions.

    Activation checkpointing recomputes a block's forward during backward, under the autocast
    state it saw in the forward, which it restores with ``torch.autocast``, i.e. torch's lists.
    With the default policy those give mixprec's dtypes exactly and nothing is needed. With an
    edited policy the recomputed tensors would differ from the forward's (non-reentrant
    checkpointing then raises ``CheckpointError``); pass this function as ``context_fn`` and
    the recompute re-enters the mixprec regions (device, dtype, policy) of the forward.
    Reentrant checkpointing (``use_reentrant=True``) takes no ``context_fn``: use the
    non-reentrant form with edited policies.

    Examples:
        >>> y = torch.utils.checkpoint.checkpoint(
        ...     block, x, use_reentrant=False, context_fn=mixprec.checkpoint_context)
        >>> model.gradient_checkpointing_enable(  # Transformers
        ...     gradient_checkpointing_kwargs={"use_reentrant": False,
        ...                                    "context_fn": mixprec.checkpoint_context})
    """
    return contextlib.nullcontext(), _reenter(_in_force())
