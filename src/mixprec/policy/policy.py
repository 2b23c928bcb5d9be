"""`Policy`: a frozen value object saying which precision each op runs in, with a string form.

A policy is a base table (torch.autocast's lists for the region's device, by default), a compute
dtype and an ordered tuple of edits. Editing returns a new policy; nothing is ever mutated, so a
policy can be shared between threads, regions and models, and used as a cache key.

String grammar (for command lines and sweeps)::

    compute=bf16,table=cuda,fp32=softmax+layer_norm,lower@cuda/fp16=mylib::attention

- ``compute=<dtype>|auto`` - the low dtype (auto: fp16 on CUDA, bf16 on CPU).
- ``table=<name>|auto`` - the base table (auto: the table of the region's device).
- ``<category>[@<device>[/<dtype>]]=<op>+<op>...`` - move ops to a category, optionally only on
  one device type and dtype. An op is an aten name (``softmax``), a custom op (``mylib::op``) or
  the dotted import path of a function decorated with ``@mixprec.half_function`` & co.
- ``fp8=<selector>+<selector>...`` - FP8 module rules (`mixprec.policy.modules`): ``auto``,
  ``all`` or a glob over module names puts linear layers in FP8, ``!<selector>`` keeps them out.
- ``fp32_modules=<name>+<glob>...`` - modules whose whole forward runs in fp32 (qualified names or
  globs, `mixprec.policy.fp32_modules`), where mixprec knows the model (``initialize``,
  ``TrainStep``, ``mixprec.compile(model)``).
Edits apply in order; a later edit of the same op (or layer) wins.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Union

import torch

from mixprec.dtypes import dtype_name, parse_device_type, parse_dtype
from mixprec.errors import PolicyError, unknown_value
from mixprec.policy.categories import Decision, OpCategory
from mixprec.policy.decompositions import COMPOSITES, Via
from mixprec.policy.entrypoints import known_op_names, op_name
from mixprec.policy.fp32_modules import check_selector
from mixprec.policy.modules import ModuleDecision, ModuleRule, plan
from mixprec.policy.tables import TABLES, OpTable

__all__ = ["DEFAULT_POLICY", "Override", "Policy", "ResolvedPolicy", "Target", "as_policy"]

#: What an edit can name: an op name, a ``torch.ops`` op, a binding or a dispatchable callable.
Target = Union[str, Callable[..., Any]]  # noqa: UP007 - a runtime alias, valid on Python 3.10

#: The attribute `half_function` & co. put on the callables they make dispatchable.
CATEGORY_ATTR = "__mixprec_category__"

_SERIALS = itertools.count(1)
_LIVE: weakref.WeakValueDictionary[int, Policy] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class Override:
    """One policy edit: put `target` in `category` (on one device type / dtype, or everywhere)."""

    target: str | Callable[..., Any]
    category: OpCategory
    device_type: str | None = None
    dtype: torch.dtype | None = None

    def applies(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether this edit is in force in a region on `device_type` computing in `dtype`."""
        return (self.device_type in (None, device_type)) and (self.dtype in (None, dtype))

    @property
    def scope(self) -> str:
        """``'@cuda/fp16'``-style suffix of the string form ('' when unrestricted)."""
        if self.device_type is None and self.dtype is None:
            return ""
        out = "@" + (self.device_type or "any")
        return out + ("" if self.dtype is None else "/" + dtype_name(self.dtype))

    @property
    def target_name(self) -> str:
        """The target as it appears in the string form."""
        return self.target if isinstance(self.target, str) else _callable_path(self.target)


@dataclass(frozen=True)
class ResolvedPolicy:
    """A policy resolved for one device type and dtype: what the eager engine compiles.

    Attributes:
        device_type: the region's device type.
        dtype: the region's low dtype.
        table: the base table used.
        ops: op name -> category (PASSTHROUGH entries mark ops an edit took out of a list),
            including C++ composites that inherit the category of an inner op.
        functions: dispatchable callable -> category, from edits naming callables.
        reasons: op name or callable -> the sentence explaining its category.
        keep: op name -> argument positions/names its cast must skip.
        restore: op names whose result is cast back to their first input's dtype.
        dynamic: op name -> its `Via` for composites whose inner op depends on the arguments.
    """

    device_type: str
    dtype: torch.dtype
    table: OpTable
    ops: Mapping[str, OpCategory]
    functions: Mapping[Callable[..., Any], OpCategory]
    reasons: Mapping[object, str]
    keep: Mapping[str, tuple[int | str, ...]]
    dynamic: Mapping[str, Via]
    restore: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Policy:
    """Which dtype each op runs in under ``mixprec.autocast``; immutable, with a string form.

    Args:
        compute: the low dtype (``torch.bfloat16``, ``'fp16'``, ...); None means the default of
            the region's device (fp16 on CUDA, bf16 on CPU). An explicit ``autocast(dtype=...)``
            takes precedence.
        table: name of the base table (``'cuda'``, ``'cpu'``, ``'xpu'``, ``'mps'``); None means
            the table of the region's device. Naming one lets you run e.g. the CUDA rules on CPU.
        overrides: ordered edits; build them with :meth:`move` rather than by hand.
        modules: ordered FP8 module rules; build them with :meth:`fp8` (``'auto'``, a glob,
            ``'!head'``). They take effect where FP8 is turned on (``initialize(..., fp8=...)``,
            `mixprec.to_fp8`); a policy with rules turns it on by itself there.
        fp32_modules: modules whose whole forward runs in fp32 (qualified names or globs);
            build them with :meth:`keep_fp32`. They take effect where mixprec knows the model:
            ``initialize`` at O1 (and ``TrainStep``, the integrations), ``mixprec.explain``.

    Examples:
        >>> p = Policy.from_string("compute=bf16").move("softmax", to="fp32")
        >>> str(p)
        'compute=bf16,fp32=softmax'
        >>> p.decide("softmax", device_type="cpu").category
        <OpCategory.FP32: 'fp32'>
    """

    compute: torch.dtype | None = None
    table: str | None = None
    overrides: tuple[Override, ...] = ()
    modules: tuple[ModuleRule, ...] = ()
    fp32_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Normalise our own fields during construction (never a shared object).
        self._register()
        if self.compute is not None:
            object.__setattr__(self, "compute", parse_dtype(self.compute, low_only=True))
        if self.table is not None and self.table not in TABLES:
            raise PolicyError(unknown_value("op table", self.table, TABLES))
        overrides = tuple(self.overrides)
        bad = next((o for o in overrides if not isinstance(o, Override)), None)
        if bad is not None:
            raise PolicyError(
                f"Policy(overrides=...) takes Override objects, got {type(bad).__name__} "
                f"{bad!r}. Build edits with Policy().move({bad!r}, to='fp32') or "
                f"Policy.from_string('fp32=...') instead."
            )
        object.__setattr__(self, "overrides", overrides)
        rules = tuple(r if isinstance(r, ModuleRule) else ModuleRule.parse(r) for r in self.modules)
        object.__setattr__(self, "modules", rules)
        if isinstance(self.fp32_modules, str):
            raise PolicyError(
                f"Policy(fp32_modules=...) takes a tuple of module names, got the string "
                f"{self.fp32_modules!r}; write fp32_modules=({self.fp32_modules!r},) or use "
                f"Policy().keep_fp32({self.fp32_modules!r})."
            )
        kept = tuple(dict.fromkeys(check_selector(m) for m in self.fp32_modules))
        object.__setattr__(self, "fp32_modules", kept)

    # ----- identity for compiled dispatch tables -----

    def _register(self) -> int:
        serial = next(_SERIALS)
        object.__setattr__(self, "_serial", serial)
        _LIVE[serial] = self
        return serial

    @property
    def serial(self) -> int:
        """A process-unique number for this object, usable as a constant under torch.compile."""
        serial = self.__dict__.get("_serial")
        return serial if serial is not None else self._register()

    @staticmethod
    def by_serial(serial: int) -> Policy:
        """The live policy with this `serial` (see :attr:`serial`)."""
        return _LIVE[serial]

    def __getstate__(self) -> dict[str, Any]:
        # Serials are per process: never carry one into a pickle.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, value)

    # ----- editing (every method returns a new Policy) -----

    def move(
        self,
        *targets: Target,
        to: str | OpCategory,
        device_type: str | None = None,
        dtype: str | torch.dtype | None = None,
    ) -> Policy:
        """Return a policy in which `targets` run in category `to`.

        Args:
            targets: op names (``'softmax'``), custom ops (``'mylib::op'``,
                ``torch.ops.mylib.op``), torch bindings (``torch.exp``, ``F.gelu``) or
                callables made dispatchable by ``@mixprec.half_function`` & co.
            to: the category: ``'lower'``, ``'fp32'``, ``'fp32_output'``, ``'promote'``,
                ``'banned'`` or ``'passthrough'`` (take the op out of every list).
            device_type: restrict the edit to regions on this device type.
            dtype: restrict the edit to regions computing in this low dtype.

        Raises:
            PolicyError: an unknown op name, category, device type or dtype, or a plain Python
                function autocast cannot see.
        """
        if not targets:
            raise PolicyError(
                "Policy.move needs at least one op to move, e.g. move('softmax', to='fp32')."
            )
        category = OpCategory.parse(to)
        if category is OpCategory.FP8:
            raise PolicyError(
                f"ops cannot be moved to 'fp8': FP8 is decided per linear layer (its scales and "
                f"amax histories belong to the layer). Select layers with Policy.fp8('auto'), "
                f"Policy.fp8('blocks.*.mlp.*') or keep one out with Policy.fp8('!head'); "
                f"got move({', '.join(map(repr, targets))}, to='fp8')."
            )
        dev = None if device_type is None else parse_device_type(device_type)
        dt = None if dtype is None else parse_dtype(dtype, low_only=True)
        new = tuple(Override(_normalize_target(t), category, dev, dt) for t in targets)
        for ov in new:
            if category is OpCategory.FP32_OUTPUT and not isinstance(ov.target, str):
                raise PolicyError(
                    f"{ov.target_name} cannot be moved to 'fp32_output': that category passes "
                    f"dtype=torch.float32 to an op, which an arbitrary function may not accept. "
                    f"Use to='fp32' (cast its inputs) instead."
                )
        return dataclasses.replace(self, overrides=self.overrides + new)

    def fp8(self, *selectors: str) -> Policy:
        """Return a policy with FP8 module rules appended (later rules win).

        Args:
            selectors: ``'auto'`` (every linear layer with sizes multiple of 16 except the first
                and the last), ``'all'``, a glob over qualified module names
                (``'blocks.*.attn.*'``), or ``'!<selector>'`` to keep layers out of FP8.

        Examples:
            >>> str(Policy().fp8("auto", "!blocks.0.*"))
            'fp8=auto+!blocks.0.*'
        """
        if not selectors:
            raise PolicyError(
                "Policy.fp8 needs at least one selector, e.g. fp8('auto') or fp8('!head')."
            )
        new = tuple(ModuleRule.parse(s) for s in selectors)
        return dataclasses.replace(self, modules=self.modules + new)

    def keep_fp32(self, *modules: str) -> Policy:
        """Return a policy that runs these modules' whole forward in fp32.

        Args:
            modules: qualified module names as ``model.named_modules()`` lists them
                (``'blocks.3.ff.wo'``) or globs over them (``'blocks.*.ff.wo'``). A module
                already kept is not added twice.

        A kept module's floating inputs are cast to fp32 and autocast is off inside it, so its
        ops and their backward compute in fp32, and its outputs stay fp32 (values past the low
        dtype's range stay finite). Applied where mixprec knows the model (`initialize` at O1,
        `TrainStep`, the integrations, `mixprec.explain`); see `mixprec.policy.fp32_modules`.

        Examples:
            >>> str(Policy().keep_fp32("blocks.0.ff.wo", "head"))
            'fp32_modules=blocks.0.ff.wo+head'
        """
        if not modules:
            raise PolicyError(
                "Policy.keep_fp32 needs at least one module name, e.g. keep_fp32('blocks.0.ff.wo')."
            )
        return dataclasses.replace(self, fp32_modules=self.fp32_modules + tuple(modules))

    def without_fp32(self, *modules: str) -> Policy:
        """Return this policy with these module selectors (exactly as kept) removed."""
        unknown = [m for m in modules if m not in self.fp32_modules]
        if unknown:
            raise PolicyError(
                f"the policy does not keep {unknown[0]!r} in fp32; it keeps "
                f"{list(self.fp32_modules) or 'no module'}."
            )
        gone = set(modules)
        return dataclasses.replace(
            self, fp32_modules=tuple(m for m in self.fp32_modules if m not in gone)
        )

    def plan_fp8(self, model: torch.nn.Module) -> tuple[ModuleDecision, ...]:
        """Which linear layers of `model` the FP8 module rules put in FP8, each with its reason.

        A policy without module rules is read as ``fp8=auto``, the default where FP8 is on.
        """
        from mixprec.policy.modules import DEFAULT_FP8_RULES

        return plan(model, self.modules or DEFAULT_FP8_RULES)

    def with_compute(self, dtype: str | torch.dtype | None) -> Policy:
        """Return this policy with another compute dtype (None: the device default)."""
        return dataclasses.replace(self, compute=None if dtype is None else parse_dtype(dtype))

    def with_table(self, table: str | None) -> Policy:
        """Return this policy on another base table (None: the region device's table)."""
        return dataclasses.replace(self, table=table)

    # ----- resolution -----

    def base_table(self, device_type: str) -> OpTable:
        """The base table used in regions on `device_type`."""
        return TABLES[self.table or parse_device_type(device_type)]

    def resolve(self, device_type: str, dtype: torch.dtype) -> ResolvedPolicy:
        """Apply the edits in force on `device_type`/`dtype` to the base table."""
        device_type = parse_device_type(device_type)
        table = self.base_table(device_type)
        ops: dict[str, OpCategory] = dict(table.ops)
        reasons: dict[object, str] = {n: f"in {table.sources[n]}" for n in table.ops}
        functions: dict[Callable[..., Any], OpCategory] = {}
        for ov in self.overrides:
            if not ov.applies(device_type, dtype):
                continue
            why = f"moved to {ov.category.value} by Policy.move{ov.scope and ' (' + ov.scope + ')'}"
            if isinstance(ov.target, str):
                ops[ov.target] = ov.category
            else:
                functions[ov.target] = ov.category
            reasons[ov.target] = why
        keep: dict[str, tuple[int | str, ...]] = {}
        dynamic: dict[str, Via] = {}
        restore: set[str] = set()
        for name, via in COMPOSITES.items():
            if name in ops:
                continue  # listed (or edited) itself: the outer registration wins
            # Per call where the table's device decides by the arguments; a table named after a
            # dispatcher device (table="cuda" on a CPU: CUDA's rules, as Apex's tests run them)
            # takes that device's static answer (lstm: _cudnn_rnn, lowered).
            table_device = self.table or device_type
            per_call = via.resolve is not None and table_device not in via.dispatcher
            if per_call or via.decompose is not None:
                dynamic[name] = via
                reasons[name] = (
                    "a C++ composite whose inner ops depend on its arguments: mixprec decides "
                    "per call, as torch.autocast does inside it"
                )
                continue
            for inner in via.ops:
                cat = ops.get(inner)
                if cat is None or cat is OpCategory.PASSTHROUGH:
                    continue
                if cat is OpCategory.FP32_OUTPUT and not via.accepts_dtype:
                    cat = OpCategory.FP32
                ops[name] = cat
                reasons[name] = (
                    f"a C++ composite whose body calls {inner} ({ops[inner].value} here), which "
                    f"torch.autocast casts inside it"
                )
                if device_type in via.dispatcher:
                    reasons[name] += (
                        "; while that agrees with torch's list, mixprec leaves the call to "
                        "torch's dispatcher here, whose kernel casts the weights as one buffer"
                    )
                if via.keep:
                    keep[name] = via.keep
                if via.restore:
                    restore.add(name)
                break
        return ResolvedPolicy(
            device_type,
            dtype,
            table,
            MappingProxyType(ops),
            MappingProxyType(functions),
            MappingProxyType(reasons),
            MappingProxyType(keep),
            MappingProxyType(dynamic),
            frozenset(restore),
        )

    def decide(
        self, op: Target, *, device_type: str, dtype: str | torch.dtype | None = None
    ) -> Decision:
        """The category `op` gets in a region on `device_type`, and the reason, for printing.

        Examples:
            >>> print(Policy().decide("mm", device_type="cuda"))
            mm: lower -> float16 (in torch.autocast's CUDA lower list)
        """
        from mixprec.dtypes import resolve_dtype

        low = resolve_dtype(device_type, dtype, self.compute).dtype
        resolved = self.resolve(device_type, low)
        target = _normalize_target(op)
        if isinstance(target, str):
            category = resolved.ops.get(target, OpCategory.PASSTHROUGH)
            name = target
        else:
            name = _callable_path(target)
            category = resolved.functions.get(target) or getattr(
                target, CATEGORY_ATTR, OpCategory.PASSTHROUGH
            )
        reason = resolved.reasons.get(target)
        if reason is None:
            if hasattr(target, CATEGORY_ATTR):
                reason = f"registered as {category.value} by its mixprec decorator"
            elif not isinstance(target, str) and _is_torch_dispatchable(target):
                reason = "a Python-level torch function: the ops it calls follow the policy"
            else:
                reason = "in no list: runs in its input dtype"
        dtype_of = {OpCategory.LOWER: low, OpCategory.FP32: torch.float32,
                    OpCategory.FP32_OUTPUT: torch.float32}.get(category)  # fmt: skip
        return Decision(name, category, dtype_of, reason)

    # ----- string form -----

    @classmethod
    def from_string(cls, text: str) -> Policy:
        """Parse the string form (see the module docstring); ``str(p)`` round-trips."""
        if not isinstance(text, str):
            raise PolicyError(f"Policy.from_string expects a string, got {type(text).__name__}.")
        policy = cls()
        for raw in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = raw.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not value:
                raise PolicyError(
                    f"policy item {raw!r} is not of the form key=value (e.g. 'compute=bf16' or "
                    f"'fp32=softmax+layer_norm')."
                )
            if ";" in value:
                raise PolicyError(
                    f"policy item {raw!r} contains ';': separate items with ',' (e.g. "
                    f"'compute=bf16,fp32=softmax')."
                )
            if key == "compute":
                policy = policy.with_compute(None if value == "auto" else value)
            elif key == "table":
                policy = policy.with_table(None if value == "auto" else value)
            elif key.partition("@")[0].strip().lower() == "fp32_modules":
                if "@" in key:
                    raise PolicyError(
                        f"policy item {raw!r}: modules kept in fp32 apply on every device and "
                        f"dtype; write 'fp32_modules=...' without a scope."
                    )
                policy = policy.keep_fp32(*value.split("+"))
            elif key.partition("@")[0].strip().lower() == "fp8":
                if "@" in key:
                    raise PolicyError(
                        f"policy item {raw!r}: FP8 module rules apply on every device; write "
                        f"'fp8=...' without a scope."
                    )
                policy = policy.fp8(*value.split("+"))
            else:
                cat, _, scope = key.partition("@")
                _parse_key(cat, raw)
                device, _, dt = scope.partition("/")
                ops = [t.strip() for t in value.split("+") if t.strip()]
                spaced = next((t for t in ops if any(c.isspace() for c in t)), None)
                if spaced is not None:
                    raise PolicyError(
                        f"policy item {raw!r}: {spaced!r} is not one op name; join several ops "
                        f"with '+' (e.g. 'fp32=softmax+layer_norm')."
                    )
                policy = policy.move(
                    *ops,
                    to=cat,
                    device_type=None if device in ("", "any") else device,
                    dtype=dt or None,
                )
        return policy

    def __str__(self) -> str:
        parts = []
        if self.compute is not None:
            parts.append(f"compute={dtype_name(self.compute)}")
        if self.table is not None:
            parts.append(f"table={self.table}")
        group_key, names = None, []
        for ov in self.overrides:
            key = (ov.category, ov.scope)
            if key != group_key and names:
                parts.append(f"{group_key[0].value}{group_key[1]}={'+'.join(names)}")
                names = []
            group_key = key
            names.append(ov.target_name)
        if names:
            parts.append(f"{group_key[0].value}{group_key[1]}={'+'.join(names)}")
        if self.modules:
            parts.append("fp8=" + "+".join(str(r) for r in self.modules))
        if self.fp32_modules:
            parts.append("fp32_modules=" + "+".join(self.fp32_modules))
        return ",".join(parts) or "compute=auto"

    def __repr__(self) -> str:
        return f"Policy({str(self)!r})"


_KEYS = ("compute", "table", "fp32_modules")


def _parse_key(category: str, raw: str) -> OpCategory:
    """The category named by a string-form key, or an error suggesting keys *and* categories."""
    try:
        return OpCategory.parse(category)
    except PolicyError:
        pass
    names = [*_KEYS, *(c.value for c in OpCategory)]
    raise PolicyError(
        unknown_value(
            "policy key",
            category,
            names,
            hint=f"In {raw!r}, the part before '=' is 'compute', 'table', 'fp32_modules' or an "
            f"op category, "
            f"optionally scoped as '<category>@<device>[/<dtype>]' (e.g. 'fp32@cuda/fp16').",
        )
    )


def _callable_path(fn: Callable[..., Any]) -> str:
    name = op_name(fn)
    if name is not None:
        return name
    module = getattr(fn, "__module__", None) or "?"
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", repr(fn))
    return f"{module}.{qual}"


def _import_path(path: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            break
        return obj
    raise PolicyError(
        f"cannot import {path!r}: a dotted target must name an importable function, "
        f"e.g. 'mypkg.layers.attention'. Op names have no dots ('softmax'); custom ops use "
        f"'namespace::op'."
    )


def _normalize_target(target: Target) -> str | Callable[..., Any]:
    """Op names stay names; bindings and ``torch.ops`` ops become names; callables stay."""
    if isinstance(target, str):
        name = target.strip()
        if "::" in name:
            ns, _, op = name.partition("::")
            # aten names are checked as bare names are ('aten::sofmax' was taken and did
            # nothing); a custom op may be registered after the policy is written.
            return _normalize_target(op) if ns == "aten" else name
        if "." in name:
            return _normalize_target(_import_path(name))
        if name in known_op_names() or any(name in t.ops for t in TABLES.values()):
            return name
        raise PolicyError(
            unknown_value(
                "op name",
                name,
                known_op_names(),
                hint="Op names are aten names without overloads ('softmax', 'layer_norm', "
                "'mm'); custom ops are 'namespace::op'.",
            )
        )
    name = op_name(target)
    if name is not None:
        return name
    if callable(target):
        if hasattr(target, CATEGORY_ATTR) or _is_torch_dispatchable(target):
            return target
        raise PolicyError(
            f"{_callable_path(target)} is a plain Python function, and mixprec.autocast only "
            f"sees calls that go through torch's function dispatch. Make it dispatchable with "
            f"a decorator (@mixprec.half_function, @mixprec.float_function or "
            f"@mixprec.promote_function), or wrap it (f = mixprec.float_function(f)), and "
            f"move the wrapper."
        )
    raise PolicyError(
        f"cannot use {target!r} as a policy target: give an op name ('softmax'), a custom op "
        f"('mylib::op') or a callable."
    )


def _is_torch_dispatchable(fn: Callable[..., Any]) -> bool:
    # Python-level torch functions dispatch to modes via handle_torch_function.
    code = getattr(fn, "__code__", None)
    return code is not None and "handle_torch_function" in code.co_names


#: The policy of regions that name none: torch.autocast's lists, unedited.
DEFAULT_POLICY = Policy()


def as_policy(value: Policy | str | None, what: str = "policy") -> Policy:
    """A `Policy` from what an argument may be: a Policy, its string form, or None (default).

    Raises:
        TypeError: anything else (the message names `what` and the accepted forms).
        PolicyError: a string that does not parse.
    """
    if value is None:
        return DEFAULT_POLICY
    if isinstance(value, str):
        return Policy.from_string(value)
    if isinstance(value, Policy):
        return value
    raise TypeError(
        f"{what} must be a mixprec.Policy, its string form or None, got "
        f"{type(value).__name__} {value!r}; e.g. mixprec.Policy().move('softmax', to='fp32') "
        f"or 'fp32=softmax'."
    )
