"""`autocast`: the region that runs each torch op in the precision the policy picks for it.

Same signature and semantics as ``torch.autocast``, implemented by mixprec above autograd: the
casts it inserts are ordinary autograd ops, so backward runs in the dtypes the forward used.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import _pop_mode, _push_mode

from mixprec._compat import autocast_state_traceable, dynamo_tracing
from mixprec.dtypes import (
    LOW_DTYPES,
    DtypeChoice,
    default_dtype,
    dtype_name,
    parse_device_type,
    parse_dtype,
    resolve_dtype,
)
from mixprec.eager.mode import AutocastMode, find_mode, torch_state
from mixprec.eager.table import Region
from mixprec.errors import AutocastError, PolicyError, format_options
from mixprec.policy.policy import Policy, as_policy

__all__ = ["autocast", "get_autocast_dtype", "get_autocast_policy", "is_autocast_enabled"]

F = TypeVar("F", bound=Callable[..., Any])

_enabled = torch.is_autocast_enabled
_dtype = torch.get_autocast_dtype


class autocast:
    """Run the ops of a region in the precision a :class:`~mixprec.Policy` picks for each.

    Inside the region, matmuls and convolutions run in the low dtype, range-sensitive ops and
    losses in fp32, reductions with fp32 accumulation, and ops mixing dtypes in the widest one;
    everything else runs in its input dtype. With the default policy that is exactly what
    ``torch.autocast`` does, op for op; edit the policy to change any op.

    Wrap the forward pass and the loss only: backward ops run in the dtype their forward ops used.

    The region sets torch's own autocast state as ``torch.autocast`` would (enabled, dtype, cache
    flag), so model code that asks ``torch.is_autocast_enabled()``, opens
    ``torch.autocast(enabled=False)`` or uses ``torch.amp.custom_fwd`` behaves as it does under
    torch.autocast; nested torch regions switch mixprec off or change its dtype in turn.

    Args:
        device_type: ``'cuda'``, ``'cpu'``, ``'xpu'`` or ``'mps'``. Tensors on other devices, fp64
            tensors and non-floating tensors are never cast.
        dtype: the low dtype (``torch.float16``/``'fp16'``, ``torch.bfloat16``/``'bf16'``).
            Default: the policy's compute dtype, else fp16 on CUDA and bf16 on CPU. fp16 on CPU
            is allowed but slow on most CPUs (no fast fp16 matmul kernels). Another dtype
            (fp32) disables the region, as in ``torch.autocast``: silently with
            ``enabled=False`` (the ``autocast(dtype=..., enabled=use_amp)`` pattern), with a
            warning otherwise.
        enabled: False makes the region a no-op; inside an enabled region it switches autocast off
            for `device_type` until the inner region exits.
        cache_enabled: cache the low-precision cast of each fp32 weight for the region (one cast
            per weight per outermost region). None keeps the enclosing region's setting (True at
            the outermost level).
        policy: a :class:`~mixprec.Policy` or its string form. Default: ``Policy()``.

    Raises:
        DeviceTypeError: unknown device type (a PolicyError, and a RuntimeError as in torch).
        PolicyError: unknown dtype name, or a device type or dtype of the wrong type.
        AutocastError: bf16 on a CUDA GPU without bf16 support (enabled regions only).

    Besides ``torch.autocast``'s strings, `device_type` may be a ``torch.device`` (its type is
    used).

    Costs:
        Each torch call in the region pays a Python-level dispatch (about a microsecond; calls
        with a rule also read torch's autocast state), and the casts themselves. No host-device
        synchronisation.

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> with mixprec.autocast("cpu"):
        ...     y = model(torch.randn(2, 4))
        >>> y.dtype
        torch.bfloat16
    """

    def __init__(
        self,
        device_type: str,
        dtype: str | torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
        policy: Policy | str | None = None,
    ) -> None:
        self.device_type = parse_device_type(device_type)
        # torch.autocast refuses numpy bools too (set_autocast_enabled raises TypeError).
        if not isinstance(enabled, bool):
            raise TypeError(
                f"enabled must be a bool (True or False), got {_type_name(enabled)} "
                f"{enabled!r}. Pass bool(enabled)."
            )
        if cache_enabled is not None and not isinstance(cache_enabled, bool):
            raise TypeError(
                f"cache_enabled must be a bool or None, got {_type_name(cache_enabled)} "
                f"{cache_enabled!r}. Pass bool(cache_enabled)."
            )
        self.policy = policy = as_policy(policy)
        requested = None if dtype is None else _parse_region_dtype(dtype)  # even when disabled
        if enabled and requested is not None and requested not in LOW_DTYPES:
            if requested.is_floating_point and requested.itemsize == 1:
                parse_dtype(requested, low_only=True)  # FP8: raises, naming the FP8 layer rule
            warnings.warn(
                f"mixprec.autocast({self.device_type!r}, dtype={dtype_name(requested)!r}): "
                f"autocast computes in a 16-bit dtype ('bf16' or 'fp16'), so the region is "
                f"disabled, as torch.autocast disables it. Pass enabled=False to run in "
                f"{dtype_name(requested)} without this warning.",
                stacklevel=2,
            )
            enabled = False
        if enabled and self.device_type == "cuda" and not torch.cuda.is_available():
            warnings.warn(
                "mixprec.autocast('cuda') was requested but CUDA is not available; the region is "
                "disabled. Use device_type='cpu' to autocast on the CPU.",
                stacklevel=2,
            )
            enabled = False
        self.enabled = enabled
        if enabled:
            choice = resolve_dtype(self.device_type, dtype, policy.compute)
        elif requested is not None:
            # Disabled: torch.autocast still sets the requested dtype as the device's autocast
            # dtype inside the region (fp32 too), and checks nothing more.
            choice = DtypeChoice(requested, "requested by the dtype argument (region disabled)")
        else:
            choice = default_dtype(self.device_type)
        self.dtype: torch.dtype = choice.dtype
        #: Why `dtype` was chosen (argument, policy or device default).
        self.dtype_reason: str = choice.reason
        self.cache_enabled = cache_enabled
        self._dtype_given = dtype is not None
        self._frames: list[tuple[AutocastMode | None, tuple[Region, ...], bool, tuple]] = []

    def __repr__(self) -> str:
        return (
            f"mixprec.autocast({self.device_type!r}, dtype={self.dtype}, enabled={self.enabled}, "
            f"cache_enabled={self.cache_enabled}, policy={self.policy!r})"
        )

    def __enter__(self) -> autocast:
        dev = self.device_type
        # torch's autocast state first, exactly as torch.autocast sets it: model code reads it
        # (torch.is_autocast_enabled, torch.amp.custom_fwd, torch.utils.checkpoint) and nested
        # torch.autocast regions change it; the mode reads it back before every rule.
        saved: tuple | contextlib.AbstractContextManager
        if dynamo_tracing() and not autocast_state_traceable():
            # torch 2.11's dynamo cannot trace the setters below (a graph break, an error under
            # fullgraph=True) but traces torch.autocast in a with-statement, which sets the same
            # state (and, when disabled, the device's default dtype: unread there).
            saved = _torch_region(dev, self.dtype, self.enabled, self.cache_enabled)
            saved.__enter__()
        else:
            saved = (_enabled(dev), _dtype(dev), torch.is_autocast_cache_enabled())
            # Nesting first on entry and last on exit: a captured graph replayed inside another
            # region (mixprec.graph) treats the pair as brackets around the state changes.
            torch.autocast_increment_nesting()
            torch.set_autocast_enabled(dev, self.enabled)
            if self.enabled or self._dtype_given:
                torch.set_autocast_dtype(dev, self.dtype)
            if self.cache_enabled is not None:
                torch.set_autocast_cache_enabled(self.cache_enabled)

        mode = find_mode()
        prev_regions = mode.regions if mode is not None else ()
        regions = tuple(r for r in prev_regions if r[0] != dev)
        if self.enabled:
            regions = tuple(sorted((*regions, (dev, self.dtype, self.policy)), key=lambda r: r[0]))
        pushed = False
        if mode is None and regions:
            mode = AutocastMode()
            _push_mode(mode)
            pushed = True
        if mode is not None:
            mode.depth += 1
            mode.set_state(regions)
        self._frames.append((mode, prev_regions, pushed, saved))
        return self

    def __exit__(self, *exc_info: object) -> None:
        mode, prev_regions, pushed, saved = self._frames.pop()
        dev = self.device_type
        if isinstance(saved, tuple):
            torch.set_autocast_enabled(dev, saved[0])
            torch.set_autocast_dtype(dev, saved[1])
            torch.set_autocast_cache_enabled(saved[2])
            if torch.autocast_decrement_nesting() == 0:
                torch.clear_autocast_cache()
        else:
            saved.__exit__(None, None, None)
        if mode is None:
            return
        mode.set_state(prev_regions)
        mode.depth -= 1
        if mode.depth == 0:
            mode.cache.clear()  # cast weights live for one outermost region only
        if pushed:
            top = torch.overrides._get_current_function_mode()
            if top is not mode:
                raise AutocastError(
                    "mixprec.autocast exited while another torch function mode opened inside it "
                    "is still active. Exit regions and modes in the reverse order of entering."
                )
            _pop_mode()

    def __call__(self, func: F) -> F:
        """Use the region as a decorator: each call of `func` runs in a fresh region."""
        if not callable(func):
            # torch's message (its tests match it), naming mixprec's region in the example.
            raise TypeError(
                f"mixprec.autocast()(func) requires a callable, but got {type(func).__name__}. "
                f"Did you mean to use autocast as a context manager? For example:\n"
                f"    with mixprec.autocast({self.device_type!r}):\n"
                f"        output = model(input)"
            )

        @functools.wraps(func)
        def decorate_autocast(*a: Any, **kw: Any) -> Any:
            region = copy.copy(self)  # validated once; a fresh frame stack per call and thread
            region._frames = []
            with region:
                return func(*a, **kw)

        return decorate_autocast  # type: ignore[return-value]


def _type_name(value: object) -> str:
    """``bool``, but ``numpy.bool`` for numpy's (whose ``__name__`` is also 'bool')."""
    cls = type(value)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# The names a region's dtype can take (see mixprec.dtypes); fp32 disables the region.
_LOW_NAMES = ("bf16", "bfloat16", "fp16", "float16", "half", "f16")
_OTHER_NAMES = ("fp32", "float32", "float", "f32", "fp64", "float64", "double")


def _parse_region_dtype(value: str | torch.dtype) -> torch.dtype:
    """`parse_dtype`, with an unknown name answered by the closest low dtypes first: a region
    computes in bf16 or fp16, so 'bf32' means 'bf16' more likely than 'f32'."""
    try:
        return parse_dtype(value)
    except PolicyError as err:
        if not isinstance(value, str) or not str(err).startswith("unknown dtype"):
            raise  # not a name, or an FP8 name (its message points to the FP8 layer rule)
        key = value.strip().lower().removeprefix("torch.")
        close = difflib.get_close_matches(key, _LOW_NAMES, n=2, cutoff=0.5)
        close += [n for n in difflib.get_close_matches(key, _OTHER_NAMES, n=2) if n not in close]
        if not close:
            raise  # not a dtype name at all (FP8 names get their own message there)
        raise PolicyError(
            f"unknown dtype {value!r}. Did you mean {format_options(close[:3])}? An autocast "
            f"region computes in {format_options(_LOW_NAMES)} (torch.bfloat16, "
            f"torch.float16); 'fp32' disables it."
        ) from None


@contextlib.contextmanager
def _torch_region(
    device_type: str, dtype: torch.dtype, enabled: bool, cache_enabled: bool | None
) -> Iterator[None]:
    """torch's autocast state as a with-statement, the one form torch 2.11's dynamo traces
    when the region is entered and exited in separate methods."""
    with torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled):
        yield


def _in_force() -> tuple[Region, ...]:
    mode = find_mode()
    return () if mode is None else torch_state(mode.regions)


def _region(device_type: str) -> Region | None:
    """The mixprec region in force on `device_type`: torch's state may have switched it off
    (a nested ``torch.autocast(enabled=False)``) or changed its dtype."""
    for region in _in_force():
        if region[0] == device_type:
            return region
    return None


def is_autocast_enabled(device_type: str | None = None) -> bool:
    """Whether a mixprec.autocast region is in force on this thread (for `device_type`, or any).

    A nested ``torch.autocast(device_type, enabled=False)`` takes the region out of force until
    it exits, as it would a torch.autocast region.
    """
    if device_type is None:
        return bool(_in_force())
    return _region(parse_device_type(device_type)) is not None


def get_autocast_dtype(device_type: str) -> torch.dtype:
    """The low dtype of the region in force on `device_type`, else the device default."""
    device_type = parse_device_type(device_type)
    region = _region(device_type)
    return region[1] if region is not None else default_dtype(device_type).dtype


def get_autocast_policy(device_type: str) -> Policy | None:
    """The policy of the region in force on `device_type`, or None outside such a region."""
    region = _region(parse_device_type(device_type))
    return region[2] if region is not None else None
