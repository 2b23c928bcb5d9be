"""The dispatch table: a resolved policy compiled to ``{function object: rule}``, and its handles.

The hot path of the mode is one dict lookup. Bindings are entered up front by op name, and so are
torch's Python-level wrappers and the functions decorated with ``half_function`` & co, so that
a ``torch.compile`` trace finds every entry without running mixprec's classification code.
Anything else (``torch.ops`` overloads, new user functions) is classified on first sight and
memoised.

Tables are addressed by integer *handles*. ``table_handle`` runs at trace time under
``torch.compile`` (``assume_constant_result``) and returns a constant, so a region entered inside
a compiled function costs the graph nothing: no table is built or looked up in traced code.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from mixprec._compat import dynamo_tracing, mark_constant_result
from mixprec.eager import composites
from mixprec.eager.rules import (
    ArgumentSwitch,
    DecomposeRule,
    DeviceSwitch,
    Guarded,
    MethodCallRule,
    ReentryRule,
    make_rule,
)
from mixprec.policy.categories import OpCategory
from mixprec.policy.decompositions import COMPOSITES, KNOWN_DEVIATIONS
from mixprec.policy.entrypoints import entry_points, op_name
from mixprec.policy.policy import CATEGORY_ATTR, DEFAULT_POLICY, Policy, ResolvedPolicy

__all__ = ["MISS", "DispatchTable", "Region", "declared_functions", "table_handle", "tables"]

#: One enabled device type of a region: (device type, low dtype, policy).
Region = tuple[str, torch.dtype, Policy]

MISS = object()

# Functions decorated with half_function & co. Weak: a decorated function that is dropped goes.
_DECLARED: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def declared_functions() -> weakref.WeakSet[Callable[..., Any]]:
    """The live functions made dispatchable by ``half_function`` & co (entered in every table)."""
    return _DECLARED


class DispatchTable:
    """A resolved policy per enabled device type, compiled to ``{function: rule}``.

    ``table.memo.get(func, MISS)`` answers a rule, None (pass through) or MISS (`classify`).
    `memo` is complete when built (every function torch hands to a mode, with its rule or None)
    and never changes afterwards: dynamo guards on the contents of what a traced
    ``__torch_function__`` reads, so a memo that grew would recompile every compiled function
    (and some keys, property getters, break dynamo's guards outright). Functions met later
    (property getters, torch internals, ``torch.ops`` overloads, user callables) are classified
    into `late`, which traced code never reads.
    """

    def __init__(self, resolved: tuple[ResolvedPolicy, ...]) -> None:
        self.resolved = resolved
        self._memo: dict[Any, Any] = {}
        self.memo: dict[Any, Any] = self._memo
        self.late: dict[Any, Any] = {}
        self._rules: dict[tuple[Any, ...], Any] = {}
        #: Index in `tables()` (set when registered there).
        self.handle = 0
        ruled: set[str] = set()
        watched: set[str] = set()  # passed through, but kept out of torch's dispatcher
        per_func: dict[Any, dict[str, Any]] = {}
        for rp in resolved:
            ref = _torch_reference(rp.device_type, rp.dtype)
            for name, cat in rp.ops.items():
                if cat is OpCategory.PASSTHROUGH:
                    continue
                ruled.add(name)
                if _left_to_torch(rp, ref, name):
                    for fn in entry_points(name):
                        per_func.setdefault(fn, {})  # no rule on this device: torch casts it
                    continue
                rule = self._rule(
                    rp,
                    cat,
                    keep=rp.keep.get(name, ()),
                    restore=name in rp.restore,
                    guard=_differs(rp, ref, name),
                )
                for fn in entry_points(name):
                    per_func.setdefault(fn, {})[rp.device_type] = rule
            for name, via in rp.dynamic.items():
                ruled.add(name)
                if via.decompose is not None:
                    special: Any = DecomposeRule(via.decompose)
                else:
                    hands_off = Guarded(None, rp.device_type)
                    inner = dict.fromkeys(_torch_touches(rp.device_type, rp.dtype), hands_off)
                    inner.update(
                        (n, self._rule(rp, c, guard=_differs(rp, ref, n)))
                        for n, c in rp.ops.items()
                        if c is not OpCategory.PASSTHROUGH
                    )
                    other = hands_off if name in KNOWN_DEVIATIONS else None
                    special = ArgumentSwitch(via.resolve, inner, other)  # type: ignore[arg-type]
                for fn in entry_points(name):
                    per_func.setdefault(fn, {})[rp.device_type] = special
            # Ops the policy passes through but torch's dispatcher would cast (an edit took them
            # out of a list, another base table, documented deviations): keep torch's hands off.
            hands_off = Guarded(None, rp.device_type)
            for name in _torch_touches(rp.device_type, rp.dtype) - ruled:
                watched.add(name)
                for fn in entry_points(name):
                    per_func.setdefault(fn, {}).setdefault(rp.device_type, hands_off)
        for fn, by_dev in per_func.items():
            self._memo[fn] = self._combine(by_dev)
        self._reentry_names = None
        if resolved:
            # Python wrappers reaching any of these must run their body under the mode.
            self._reentry_names = composites.transparent_names(frozenset(ruled | watched))
            # Enter everything a compile trace may meet, so tracing never has to classify.
            # (Direct _classify: this may run at trace time, where `classify` declines.)
            for fn in (*_overridable(), *composites.torch_python_functions(), *list(_DECLARED)):
                if fn not in self._memo:
                    self._memo[fn] = self._classify(fn)
            for fn in composites.super_calling_methods():
                if self._memo.get(fn) is None:
                    self._memo[fn] = MethodCallRule(fn.__name__)
        # Keys dynamo cannot guard go to `late` (traced code never reads it): property getters
        # break its guards outright, and it guards the Python-level Tensor methods of
        # torch/_tensor.py (``__rdiv__``, ``__rpow__``, ...) as absent from a dict that holds
        # them, which fails on the frame that created the guard.
        for fn in [fn for fn in self._memo if not _guardable(fn)]:
            self.late[fn] = self._memo.pop(fn)
        # What traced code may still read for such keys (`traced_rule_index`, run outside the
        # trace): only rules written for traces, never rules classified later in eager code.
        self.traced_late: dict[Any, Any] = {
            fn: r for fn, r in self.late.items() if isinstance(r, MethodCallRule)
        }
        #: The distinct rules of `memo`, in a fixed order: what torch.compile traces reads (by
        #: index, see `traced_rule_index`) instead of the memo itself.
        self.traced_rules: tuple[Any, ...] = tuple(
            {
                id(r): r
                for r in (*self._memo.values(), *self.traced_late.values())
                if r is not None
            }.values()
        )
        self._traced_index = {id(r): i for i, r in enumerate(self.traced_rules)}

    def _rule(
        self,
        rp: ResolvedPolicy,
        cat: OpCategory,
        keep: tuple[int | str, ...] = (),
        restore: bool = False,
        guard: bool = False,
    ) -> Any:
        key = (rp.device_type, cat, keep, restore, guard)
        rule = self._rules.get(key)
        if rule is None:
            rule = make_rule(cat, rp.device_type, rp.dtype, keep, restore)
            if guard:
                rule = Guarded(rule, rp.device_type)
            self._rules[key] = rule
        return rule

    @staticmethod
    def _combine(by_dev: dict[str, Any]) -> Any:
        if not by_dev:
            return None
        if len(by_dev) == 1:
            return next(iter(by_dev.values()))
        return DeviceSwitch(by_dev)

    def rule_for_declared(self, func: Any) -> Any:
        """The rule of a function declared after this table was built (``@mixprec.float_function``
        & co.), computed at declaration: such a function is in no `memo` of an older table, and
        dynamo never shows its call to the mode, so the wrapper keeps these rules itself."""
        return self._classify(func)

    def classify(self, func: Any) -> Any:
        """Find (and remember in `late`) the rule for a function not in `memo`; None = pass."""
        if dynamo_tracing():
            return None  # never run classification in a trace (tables pre-enter what it meets)
        try:
            return self.late[func]
        except (KeyError, TypeError):  # not met yet, or unhashable (classified every call)
            pass
        rule = self._classify(func)
        with contextlib.suppress(TypeError):
            self.late[func] = rule
        return rule

    def _classify(self, func: Any) -> Any:
        by_dev: dict[str, Any] = {}
        name = op_name(func)
        declared = getattr(func, CATEGORY_ATTR, None)
        if not isinstance(declared, OpCategory):
            declared = None  # a stand-in (a mock answers every attribute) declares nothing
        for rp in self.resolved:
            cat = None
            with contextlib.suppress(TypeError):
                cat = rp.functions.get(func)
            by_op = cat is None and name is not None and name in rp.ops
            if by_op and _left_to_torch(rp, _torch_reference(rp.device_type, rp.dtype), name):
                continue
            if by_op:
                cat = rp.ops[name]
            if cat is None and declared is not None:
                cat = declared
            if cat is not None and cat is not OpCategory.PASSTHROUGH:
                # For a callable (not an op binding) the rule casts its inputs; its body then
                # runs with the mode popped and torch's autocast off, i.e. with autocast off,
                # as documented.
                guard = not by_op or _differs(rp, _torch_reference(rp.device_type, rp.dtype), name)
                by_dev[rp.device_type] = self._rule(rp, cat, guard=guard)
        if by_dev:
            return self._combine(by_dev)
        if (
            self._reentry_names is not None
            and composites.is_python_function(func)
            and composites.needs_reentry(func, self._reentry_names)
        ):
            # Dynamo cannot look inside some wrappers (torch.norm, torch.tensordot: their bodies
            # call builtins it does not trace); there the call gets the rule of the op it wraps.
            outer = {}
            for rp in self.resolved:
                cat = rp.ops.get(func.__name__)
                if cat is not None and cat is not OpCategory.PASSTHROUGH:
                    ref = _torch_reference(rp.device_type, rp.dtype)
                    outer[rp.device_type] = self._rule(
                        rp, cat, guard=_differs(rp, ref, func.__name__)
                    )
            return ReentryRule(func, self._combine(outer) if outer else None)
        return None


@functools.lru_cache(maxsize=32)
def _torch_reference(device_type: str, dtype: torch.dtype) -> ResolvedPolicy:
    """What torch's dispatcher does in an autocast region on `device_type`: the default policy
    (torch.autocast's lists for that device, checked op for op by the test suite)."""
    return DEFAULT_POLICY.resolve(device_type, dtype)


def _spec(rp: ResolvedPolicy, name: str) -> tuple[Any, ...]:
    return (
        rp.ops.get(name, OpCategory.PASSTHROUGH),
        rp.keep.get(name, ()),
        name in rp.restore,
        rp.dynamic.get(name),
    )


def _differs(rp: ResolvedPolicy, ref: ResolvedPolicy, name: str | None) -> bool:
    """Whether the policy treats op `name` otherwise than torch's dispatcher would."""
    return name is None or name in KNOWN_DEVIATIONS or _spec(rp, name) != _spec(ref, name)


def _left_to_torch(rp: ResolvedPolicy, ref: ResolvedPolicy, name: str) -> bool:
    """Whether calls of composite `name` pass through to torch's dispatcher (`Via.dispatcher`):
    on such a device, while the policy treats it as torch's list does."""
    via = COMPOSITES.get(name)
    return (
        via is not None
        and rp.device_type in via.dispatcher
        and name not in rp.dynamic
        and _spec(rp, name) == _spec(ref, name)
    )


@functools.lru_cache(maxsize=32)
def _torch_touches(device_type: str, dtype: torch.dtype) -> frozenset[str]:
    """Op names whose calls torch's dispatcher may cast (or mixprec documents as deviating)."""
    ref = _torch_reference(device_type, dtype)
    touched = {n for n, c in ref.ops.items() if c is not OpCategory.PASSTHROUGH}
    return frozenset(touched | set(ref.dynamic) | set(KNOWN_DEVIATIONS))


@functools.cache
def _overridable_by_torch() -> tuple[Any, ...]:
    return tuple(
        fn for funcs in torch.overrides.get_overridable_functions().values() for fn in funcs
    )


def _overridable() -> tuple[Any, ...]:
    """The functions torch hands to a torch function mode (about 1,400 in torch 2.13).

    Cost: torch's scan, once per process (cached); while it fails, our own scan per table.
    """
    try:
        return _overridable_by_torch()
    except Exception:
        # torch's scan fails as a whole on a stand-in for a torch function (under
        # unittest.mock.patch("torch.nn.functional.scaled_dot_product_attention") its own
        # consistency check raises AttributeError: __name__), which must not break the user's
        # region. Not cached: once the patch is undone, torch's scan works again.
        return _scan_overridable()


# What torch.overrides scans for functions a mode can receive (its _get_overridable_functions).
_SCANNED = ("torch", "torch.functional", "torch.nn.functional", "torch.nn.init", "torch.linalg",
            "torch.fft", "torch.special")  # fmt: skip


def _scan_overridable() -> tuple[Any, ...]:
    """torch's scan (`torch.overrides.get_overridable_functions`), skipping what it cannot
    classify: callables without a name (mocks and other stand-ins) and unhashable objects."""
    import importlib

    ignored = torch.overrides.get_ignored_functions()
    spaces: list[tuple[Any, list[str]]] = []
    for name in _SCANNED:
        module = importlib.import_module(name)
        public = getattr(module, "__all__", None) if name in ("torch", "torch.functional") else None
        names = list(public) if public is not None else dir(module)
        spaces.append((module, [n for n in names if n[:1].islower() and not n.endswith("_")]))
    spaces.append((torch.Tensor, dir(torch.Tensor)))
    found: dict[int, Any] = {}
    for ns, names in spaces:
        for name in names:
            if name == "unique_dim" and ns is not torch.Tensor:
                continue  # deleted from torch in torch/__init__.py
            try:
                obj = getattr(ns, name)
                if ns is torch.Tensor and getattr(object, name, None) is obj:
                    continue
                if isinstance(obj, type(torch)):
                    continue
                if not callable(obj):
                    getter = getattr(obj, "__get__", None)  # properties: their getter
                    if getter is not None and getter not in ignored:
                        found[id(getter)] = getter
                    continue
                if isinstance(getattr(obj, "__name__", None), str) and obj not in ignored:
                    found[id(obj)] = obj
            except (AttributeError, TypeError):  # a lazy attribute, an unhashable object
                continue
    return tuple(found.values())


def _guardable(fn: Any) -> bool:
    """Whether dynamo guards a dict with `fn` as a key correctly (see `DispatchTable`)."""
    return type(fn).__name__ != "method-wrapper" and getattr(fn, "__module__", "") != (
        "torch._tensor"
    )


EMPTY = DispatchTable(())

# Handle -> table. Handle 0 is the empty table (a region with nothing enabled).
_TABLES: list[DispatchTable] = [EMPTY]
_HANDLES: dict[tuple[Region, ...], int] = {}


def tables() -> list[DispatchTable]:
    """All tables built in this process, indexed by handle."""
    return _TABLES


@functools.lru_cache(maxsize=128)
def _handle_by_value(regions: tuple[Region, ...]) -> int:
    # Equal policies share one table, however many Policy objects say the same thing.
    handle = _HANDLES.get(regions)
    if handle is None:
        table = DispatchTable(tuple(p.resolve(dev, dtype) for dev, dtype, p in regions))
        _TABLES.append(table)
        handle = table.handle = _HANDLES[regions] = len(_TABLES) - 1
    return handle


@mark_constant_result
def traced_rule_index(handle: int, func: Any) -> int:
    """Where ``table.memo.get(func, MISS)`` is in ``table.traced_rules``, for the table of
    `handle` (``tables()[handle]``): -1 for None (pass through), -2 for MISS.

    torch.compile calls this once per traced call and bakes the int in, guarded by the table's
    handle alone (tables and their memos never change once built). A traced
    ``memo.get(func)`` would instead guard every key of the memo (about 1,400 EQUALS_MATCH
    guards), evaluated on every call of the compiled function. It takes the handle, not the
    table: torch 2.11's dynamo calls a constant-result function only with constant arguments,
    and refused the table object (TrainStep's compile=True failed on every model there).
    """
    table = _TABLES[handle]
    try:
        rule = table.memo.get(func, MISS)
        if rule is MISS:
            rule = table.traced_late.get(func, MISS)
    except TypeError:  # unhashable
        return -2
    if rule is None:
        return -1
    return -2 if rule is MISS else table._traced_index[id(rule)]


# torch.compile calls this at trace time and bakes the returned int into the graph, so table
# construction never enters traced code. Its arguments must therefore be constants: device
# types, dtypes and each policy's serial number (not the Policy object).
@mark_constant_result
def table_handle(key: tuple[tuple[str, torch.dtype, int], ...]) -> int:
    """The handle of the table for ``((device type, dtype, policy serial), ...)``."""
    if not key:
        return 0
    return _handle_by_value(tuple((dev, dt, Policy.by_serial(s)) for dev, dt, s in key))
