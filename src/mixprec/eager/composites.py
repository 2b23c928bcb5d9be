"""Python-level torch functions: decide when to look inside them, and make that possible.

torch.autocast lives in the dispatcher, below every Python wrapper, so it casts the ops *inside*
``F.multi_head_attention_forward``, ``F.normalize`` or ``Tensor.__rpow__``. A torch function mode
sees such a wrapper as one call, and torch pops the mode while the wrapper's body runs. To give
the body's ops the policy, mixprec runs the body of a *re-entrant copy* of the wrapper with the mode
pushed again. The copy is the same code object with globals in which ``has_torch_function*``
answer False (so the copy does not bounce back into the mode); torch's own objects are untouched.

Running a body re-entrantly costs a mode push and one dispatch per inner op, so it is done only
when the body can reach an op the policy rules on. `reachable_names` collects the names a function
can reach statically (global and attribute names, operators, closure cells, helper functions),
and `transparent_names` closes that set over torch's Python-level functions. The analysis is
conservative: a false positive costs time, never correctness.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "is_python_function",
    "needs_reentry",
    "reachable_names",
    "reentrant_copy",
    "refresh_globals",
    "super_calling_methods",
    "torch_python_functions",
    "transparent_names",
]

# Binary operators in bytecode -> the op a tensor operand dispatches to.
_OPERATORS = {
    "+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floor_divide", "%": "remainder",
    "@": "matmul", "**": "pow", "&": "bitwise_and", "|": "bitwise_or", "^": "bitwise_xor",
    "<<": "bitwise_left_shift", ">>": "bitwise_right_shift",
}  # fmt: skip
# Python 3.10 spells operators as opcodes.
_OPCODES = {
    "BINARY_ADD": "add", "BINARY_SUBTRACT": "sub", "BINARY_MULTIPLY": "mul",
    "BINARY_TRUE_DIVIDE": "div", "BINARY_FLOOR_DIVIDE": "floor_divide",
    "BINARY_MODULO": "remainder", "BINARY_MATRIX_MULTIPLY": "matmul", "BINARY_POWER": "pow",
    "BINARY_AND": "bitwise_and", "BINARY_OR": "bitwise_or", "BINARY_XOR": "bitwise_xor",
}  # fmt: skip
_COMPARE = {"==": "eq", "!=": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}

_HAS_TF = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def is_python_function(func: object) -> bool:
    """Whether `func` is a plain Python function (whose body a mode cannot see into)."""
    return isinstance(func, types.FunctionType)


@functools.cache
def _code_names(code: types.CodeType) -> frozenset[str]:
    names: set[str] = set(code.co_names)
    for ins in dis.get_instructions(code):
        if ins.opname == "BINARY_OP":
            op = _OPERATORS.get(str(ins.argrepr).rstrip("="))
            if op:
                names.add(op)
        elif ins.opname == "COMPARE_OP":
            op = _COMPARE.get(str(ins.argrepr).split()[-1] if ins.argrepr else "")
            if op:
                names.add(op)
        elif ins.opname in _OPCODES:
            names.add(_OPCODES[ins.opname])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return frozenset(names)


def reachable_names(func: Callable[..., Any]) -> frozenset[str]:
    """Names `func` can reach: its code's names and operators, closures and helper functions."""
    seen: set[int] = set()
    out: set[str] = set()
    stack: list[Any] = [func]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if not isinstance(fn, types.FunctionType):
            name = getattr(fn, "__name__", None)
            if isinstance(name, str):
                out.add(name)
            continue
        names = _code_names(fn.__code__)
        out |= names
        # Helpers called by global name (e.g. F._in_projection_packed) run inside the body.
        glb = fn.__globals__
        for n in names:
            obj = glb.get(n)
            if isinstance(obj, types.FunctionType) and _is_torch_code(obj):
                stack.append(obj)
        for cell in fn.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if callable(content):
                stack.append(content)
    return frozenset(out)


def _is_torch_code(fn: types.FunctionType) -> bool:
    module = fn.__module__ or ""
    return module == "torch" or module.startswith("torch.")


# Namespaces whose Python-level functions dispatch to torch function modes themselves.
_PY_NAMESPACES = ("torch", "torch.functional", "torch.nn.functional", "torch.linalg",
                  "torch.fft", "torch.special", "torch.nested", "torch.sparse")  # fmt: skip


@functools.cache
def torch_python_functions() -> tuple[types.FunctionType, ...]:
    """torch's Python-level wrappers a mode sees: functions and Tensor methods that dispatch.

    A function qualifies if it (or a function in its closure) calls ``handle_torch_function``,
    i.e. a torch function mode receives it as one call.
    """
    import importlib

    found: dict[int, types.FunctionType] = {}
    spaces: list[Any] = [importlib.import_module(n) for n in _PY_NAMESPACES]
    spaces.append(torch.Tensor)
    for ns in spaces:
        for value in list(vars(ns).values()):
            if isinstance(value, types.FunctionType) and _dispatches(value):
                found[id(value)] = value
    return tuple(found.values())


@functools.cache
def super_calling_methods() -> tuple[types.FunctionType, ...]:
    """Python-level Tensor methods whose bodies call zero-argument ``super()``
    (``Tensor.unflatten``).

    Dynamo cannot inline such a body when a torch function mode hands the method over as a
    plain function (it has no class to resolve ``super()`` against) and falls back to eager for
    the whole frame; called as a method, dynamo records it natively.
    """
    found = []
    for value in vars(torch.Tensor).values():
        fn = value
        while isinstance(fn, types.FunctionType):
            if "__class__" in fn.__code__.co_freevars:
                found.append(value)
                break
            fn = getattr(fn, "__wrapped__", None)
    return tuple(found)


def _dispatches(fn: types.FunctionType) -> bool:
    if "handle_torch_function" in fn.__code__.co_names:
        return True
    for cell in fn.__closure__ or ():
        try:
            content = cell.cell_contents
        except ValueError:
            continue
        if isinstance(content, types.FunctionType) and (
            "handle_torch_function" in content.__code__.co_names
        ):
            return True
    return False


@functools.cache
def transparent_names(ruled: frozenset[str]) -> frozenset[str]:
    """Close `ruled` over torch's Python functions: add each one whose body reaches the set.

    A wrapper that calls another wrapper which reaches a ruled op must be looked into as well;
    adding wrapper names until nothing changes captures that.
    """
    names = set(ruled)
    funcs = [(fn, reachable_names(fn)) for fn in torch_python_functions()]
    changed = True
    while changed:
        changed = False
        for fn, reach in funcs:
            if fn.__name__ not in names and not reach.isdisjoint(names):
                names.add(fn.__name__)
                changed = True
    return frozenset(names)


def needs_reentry(func: types.FunctionType, names: Iterable[str]) -> bool:
    """Whether `func`'s body can reach any of `names` (see `transparent_names`)."""
    return not reachable_names(func).isdisjoint(names)


# id(module globals) -> (the module globals, our copy, the copy's own entries: its
# has_torch_function* names, answering False).
_globals_copies: dict[int, tuple[dict[str, Any], dict[str, Any], dict[str, Any]]] = {}
_copies: dict[types.FunctionType, types.FunctionType] = {}
# id(our copy of module globals) -> the module globals it copies.
_originals: dict[int, dict[str, Any]] = {}


def _never(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _reentrant_globals(glb: dict[str, Any]) -> dict[str, Any]:
    entry = _globals_copies.get(id(glb))
    if entry is None or entry[0] is not glb:
        own = {name: _never for name in _HAS_TF if name in glb}
        entry = (glb, {**glb, **own}, own)
        _globals_copies[id(glb)] = entry
        _originals[id(entry[1])] = glb
    return entry[1]


def refresh_globals(copy: types.FunctionType) -> None:
    """Bring a re-entrant copy's module globals up to date with the module's own.

    A copy's globals are a dict of its own, so a monkeypatch of a module global made after the
    copy was taken (``mock.patch("torch.nn.functional.scaled_dot_product_attention")``), or
    undone since, would not reach the copy's body, while torch.autocast sees it. `ReentryRule`
    calls this before running a copy in eager code.

    Cost: one C-level dict merge of the copy's module (``torch.nn.functional``: about 200
    names, a few microseconds), only where a re-entrant wrapper runs; nothing per op and
    nothing per region.
    """
    mine = copy.__globals__
    module = _originals.get(id(mine))
    entry = None if module is None else _globals_copies.get(id(module))
    if entry is None or entry[1] is not mine:
        return  # not a copy of ours (or one whose module went away)
    own = entry[2]
    # One update, with the copy's own entries merged in first: another thread running a copy
    # never sees its has_torch_function names answer True in between.
    mine.update({**module, **own})
    if len(mine) != len(module):  # a name the module has dropped (a patch with create=True)
        for name in mine.keys() - module.keys():
            del mine[name]


def reentrant_copy(
    func: types.FunctionType, _busy: frozenset[int] = frozenset()
) -> types.FunctionType:
    """A copy of `func` whose body runs without dispatching itself back to torch function modes.

    Closure cells holding other torch functions (``boolean_dispatch`` in ``F.max_pool2d``, the
    operator wrappers of ``Tensor``) are copied the same way, so the whole wrapper chain runs its
    body once, under the caller's mode. The copy shares code, defaults and closure values with
    the original; only the module globals it sees differ (a copy of the module's, refreshed
    before each eager run: `refresh_globals`).
    """
    copy = _copies.get(func)
    if copy is not None:
        return copy
    closure = func.__closure__
    if closure:
        busy = _busy | {id(func)}
        cells = []
        for cell in closure:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                cells.append(cell)
                continue
            # A wrapper's closure may hold the wrapper itself (it names itself as the public
            # API in handle_torch_function): keep such cells, only copy other torch functions.
            if (
                isinstance(content, types.FunctionType)
                and id(content) not in busy
                and _is_torch_code(content)
            ):
                cells.append(types.CellType(reentrant_copy(content, busy)))
            else:
                cells.append(cell)
        closure = tuple(cells)
    copy = types.FunctionType(
        func.__code__,
        _reentrant_globals(func.__globals__),
        func.__name__,
        func.__defaults__,
        closure,
    )
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    copy.__module__ = func.__module__
    copy.__doc__ = func.__doc__
    _copies[func] = copy
    return copy
