"""Map op names to every Python entry point torch exposes for them, and back.

One op name covers all of its C-level bindings: ``mm`` is ``torch.mm``, ``Tensor.mm`` and
``torch._C._VariableFunctions.mm``; ``matmul`` includes ``Tensor.__matmul__``; ``linear`` is
``torch.nn.functional.linear`` = ``torch._C._nn.linear``; ``linalg_vector_norm`` is
``torch.linalg.vector_norm``. Python-level wrappers (``torch.nn.functional.softmax``,
``torch.einsum``, ``Tensor.__rmatmul__``) are not listed: the eager engine runs their bodies and
sees the bindings they call, as torch's dispatcher does.

The index is built once per process, from the bindings torch actually has, so it follows the
installed torch version.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["entry_points", "known_op_names", "op_name"]

# The C-level namespaces whose callables are generated op bindings.
_NAMESPACES: tuple[tuple[str, Any], ...] = tuple(
    (label, ns)
    for label, ns in (
        ("torch", getattr(torch._C, "_VariableFunctions", None)),
        ("Tensor", torch._C.TensorBase),
        ("torch._C._nn", getattr(torch._C, "_nn", None)),
        ("torch._C._linalg", getattr(torch._C, "_linalg", None)),
        ("torch._C._fft", getattr(torch._C, "_fft", None)),
        ("torch._C._special", getattr(torch._C, "_special", None)),
        ("torch._C._nested", getattr(torch._C, "_nested", None)),
        ("torch._C._sparse", getattr(torch._C, "_sparse", None)),
    )
    if ns is not None
)

# Out-of-place operator methods -> the op they run. In-place ones (__iadd__, ...) are left out on
# purpose: autocast never casts in-place ops.
_DUNDER_OPS = {
    "__add__": "add", "__radd__": "add", "__sub__": "sub", "__rsub__": "sub",
    "__mul__": "mul", "__rmul__": "mul", "__matmul__": "matmul", "__truediv__": "div",
    "__div__": "div", "__floordiv__": "floor_divide", "__mod__": "remainder",
    "__pow__": "pow", "__and__": "bitwise_and", "__rand__": "bitwise_and",
    "__or__": "bitwise_or", "__ror__": "bitwise_or", "__xor__": "bitwise_xor",
    "__rxor__": "bitwise_xor", "__lshift__": "bitwise_left_shift",
    "__rshift__": "bitwise_right_shift", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt",
    "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__invert__": "bitwise_not",
}  # fmt: skip

_BINDING_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType)


def _binding_name(obj: Any) -> str | None:
    name = getattr(obj, "__name__", None)
    if not isinstance(name, str):
        return None
    if name.startswith("__"):
        return _DUNDER_OPS.get(name)
    return name


@functools.cache
def _index() -> tuple[dict[str, tuple[Callable[..., Any], ...]], dict[int, str]]:
    by_name: dict[str, list[Callable[..., Any]]] = {}
    by_id: dict[int, str] = {}
    for _label, ns in _NAMESPACES:
        for attr in dir(ns):
            try:
                obj = getattr(ns, attr)
            except AttributeError:  # pragma: no cover - defensive: lazy attributes
                continue
            if not isinstance(obj, _BINDING_TYPES):
                continue
            name = _binding_name(obj)
            if name is None:
                continue
            if id(obj) not in by_id:
                by_id[id(obj)] = name
                by_name.setdefault(name, []).append(obj)
    return {k: tuple(v) for k, v in by_name.items()}, by_id


def entry_points(name: str) -> tuple[Callable[..., Any], ...]:
    """Every C-level binding of op `name` in this torch build (empty if it has none)."""
    return _index()[0].get(name, ())


@functools.cache
def known_op_names() -> frozenset[str]:
    """The op names with at least one Python entry point in this torch build."""
    return frozenset(_index()[0])


def op_name(func: object) -> str | None:
    """The op name of a binding, ``torch.ops`` op or overload; None for anything else.

    ``torch.ops.aten.mm`` and its overloads map to ``'mm'`` (same rules as ``torch.mm``); other
    namespaces keep their qualified name (``'mylib::attention'``).
    """
    if isinstance(func, _BINDING_TYPES):
        return _index()[1].get(id(func))
    if isinstance(func, torch._ops.OpOverloadPacket):
        qualified = func._qualified_op_name
    elif isinstance(func, torch._ops.OpOverload):
        qualified = func._schema.name
    else:
        return None
    ns, _, name = qualified.partition("::")
    return name if ns == "aten" else qualified
