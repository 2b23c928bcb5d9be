"""`Fp32Modules`: the forward hooks that run a policy's ``fp32_modules`` in fp32.

For each kept module, a pre-hook casts the floating inputs to fp32 and opens a disabled
``mixprec.autocast`` region for the device (torch's autocast state off, as a nested
``torch.autocast(enabled=False)`` would set it), and a post-hook that always runs (also when the
forward raises) closes it. Inside, every op sees fp32 inputs and fp32 weights (O1 keeps weights
in fp32), so it computes in fp32, and autograd records backward in fp32 too. The outputs are
left in fp32: a kept module is kept because its values leave the low dtype's range, and casting
them back would bring the overflow back one op later; the next op under autocast casts them as
the policy says (a matmul to the low dtype, a residual add stays fp32).

Under ``torch.compile`` the hooks are traced with the forward (the region's state changes
become graph nodes that mixprec's graph pass replays), so compiled code follows the same rule
once it is compiled *after* the hooks change: dynamo does not guard on a module's hooks, and a
function compiled before keeps the old forward. `TrainStep` rebuilds its compiled forward when
the kept modules change (``rebuild_forward``).

Cost: two Python hooks per call of a kept module and the input casts; none for other modules.
No host-device synchronisation.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.eager.autocast import autocast
from mixprec.policy.fp32_modules import missing_selectors, select_fp32

__all__ = ["Fp32Modules", "check_models", "install"]

_LOW = (torch.float16, torch.bfloat16)


def _upcast(value: Any) -> Any:
    """fp16/bf16 tensors in a nested structure cast to fp32; fp64 and the rest left alone (as
    autocast leaves them)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _LOW else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_upcast(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: _upcast(v) for k, v in value.items()})
    return value


class _Open(threading.local):
    """Per thread: the regions opened by the pre-hooks, innermost last (present from the first
    access in every thread, so torch.compile's guards see the same object every call)."""

    def __init__(self) -> None:
        self.stack: list[autocast] = []


class Fp32Modules:
    """Hooks that run selected submodules of one model in fp32 inside its autocast region.

    Args:
        model: the model (its submodules are looked up by qualified name).
        device_type: the device type whose autocast is switched off inside a kept module.

    Attributes:
        reasons: qualified name -> why the module runs in fp32 (the policy, or healing's words).
    """

    def __init__(self, model: nn.Module, device_type: str) -> None:
        self.model = model
        self.device_type = device_type
        self.reasons: dict[str, str] = {}
        self._handles: dict[str, list[Any]] = {}
        self._open = _Open()

    @property
    def names(self) -> tuple[str, ...]:
        """The modules running in fp32, in the model's order."""
        order = [n for n, _ in self.model.named_modules()]
        return tuple(n for n in order if n in self._handles)

    def plan(self, selectors: Iterable[str]) -> list[str]:
        """The modules `selectors` keep (see `mixprec.policy.fp32_modules.select_fp32`); pure.

        Raises:
            PolicyError: a selector that names no module of the model.
        """
        return select_fp32(self.model, selectors)

    def set(self, names: Iterable[str], reasons: Mapping[str, str] | None = None) -> None:
        """Keep exactly `names` (qualified names, from `plan`) in fp32: hooks are added to the
        new ones and taken off the others. `reasons` gives each new one its explanation."""
        wanted = list(dict.fromkeys(names))
        modules = dict(self.model.named_modules())
        missing = [n for n in wanted if n not in modules or not n]
        if missing:  # plan() checked the selectors; a name here comes from a caller's list
            raise KeyError(f"no submodule named {missing[0]!r} in {type(self.model).__name__}")
        for name in [n for n in self._handles if n not in wanted]:
            for handle in self._handles.pop(name):
                handle.remove()
            self.reasons.pop(name, None)
        for name in wanted:
            if name in self._handles:
                continue
            module = modules[name]
            self._handles[name] = [
                module.register_forward_pre_hook(self._enter, with_kwargs=True),
                module.register_forward_hook(self._leave, always_call=True),
            ]
            self.reasons[name] = (reasons or {}).get(name, "kept in fp32 by the policy")

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = _upcast(args), _upcast(kwargs)
        region = autocast(self.device_type, enabled=False)
        region.__enter__()
        self._open.stack.append(region)
        return args, kwargs

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        stack = self._open.stack
        if stack:
            stack.pop().__exit__(None, None, None)

    def remove(self) -> None:
        """Take every hook off."""
        self.set(())

    def __repr__(self) -> str:
        return f"Fp32Modules({list(self.names)})"


def _applies(options: Any) -> bool:
    """Whether `options` (an `AmpOptions`) keep modules in fp32: O1's region, with fp32
    modules in its policy or healing on (healing adds them later)."""
    return bool(options.patch_torch_functions) and bool(
        options.policy.fp32_modules or options.heal is not None
    )


def check_models(models: Iterable[nn.Module], options: Any) -> None:
    """Refuse, before any model changes, a policy selector that names no module of `models`."""
    if options.patch_torch_functions and options.policy.fp32_modules:
        missing_selectors(models, options.policy.fp32_modules)


def install(model: nn.Module, hooks: Any, options: Any) -> Fp32Modules | None:
    """`Fp32Modules` for `model` with the policy's modules kept, where the options call for it
    (O1 with fp32 modules or healing; else None); set as ``hooks.fp32`` on its `AmpHooks`
    when given (a framework integration's O1 model has none: the framework opens the region)."""
    if not _applies(options):
        return None
    fp32 = Fp32Modules(model, options.device_type)
    selectors = options.policy.fp32_modules
    fp32.set(select_fp32(model, selectors, strict=False))
    if hooks is not None:
        hooks.fp32 = fp32
    return fp32
