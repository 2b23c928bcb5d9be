"""Apply a policy to a captured graph: re-trace it through the eager engine to aten level.

Why this route (and not a rewrite of AOTAutograd's forward/backward graphs): the casts of mixed
precision must exist *before* differentiation, so that backward runs in the dtypes the forward
used, exactly as eager autograd records them. Dynamo hands a backend a torch-level graph; we run
that graph node by node inside a ``mixprec.autocast`` region while ``make_fx(pre_dispatch=True)``
records it. Every node is an ordinary torch call, so the region's dispatch table sees each one,
including the ``torch._C._nn`` functions (the losses) that no function mode sees while dynamo
traces. The recording is an aten graph taken above autograd (composites such as ``linear``,
``layer_norm`` or ``cross_entropy_loss`` are still single nodes) with the policy's casts as
explicit nodes. AOTAutograd then derives forward and backward from it, and the inner backend
(``eager``, ``aot_eager``, ``inductor``) compiles them.

So the graph path makes its decisions with the same tables and the same rule code as the eager
engine: a compiled function gets the dtypes eager ``mixprec.autocast`` gives, op for op, policy
edits and ``@mixprec.half_function`` & co included.

Cost: one extra trace per graph at compile time (no cost per call).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch import fx

from mixprec.dtypes import DEVICE_TYPES
from mixprec.eager.autocast import autocast
from mixprec.policy.policy import Policy

__all__ = [
    "computes_gradients",
    "lift_tensor_attributes",
    "own_gradients_inputs",
    "own_gradients_run",
    "trace_with_policy",
]


def computes_gradients(gm: fx.GraphModule) -> bool:
    """Whether `gm` calls ``torch.autograd.grad`` itself (a whole training step in one graph,
    `mixprec.step.whole`): its backward is part of the graph, not derived after it."""
    return any(
        node.op == "call_function" and node.target is torch.autograd.grad for node in gm.graph.nodes
    )


def _fakes_like(example_inputs: list[Any], values: list[torch.Tensor]) -> list[Any]:
    """`values` as inputs of the kind dynamo gave: fake ones in its fake mode, else as they are."""
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(example_inputs)
    return [mode.from_tensor(v, static_shapes=True) for v in values] if mode else list(values)


def _run_without_autograd(compiled: Any) -> Any:
    """`compiled` run with autograd off: a graph that computes its own gradients updates the
    parameters in place, which autograd would refuse on leaves that require grad."""

    def run(*args: Any) -> Any:
        with torch.no_grad():
            return compiled(*args)

    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run


def lift_tensor_attributes(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of `gm` whose tensor attributes are trailing inputs, and their values (`gm`
    itself stays as dynamo made it: dynamo reads its inputs' records after the backend).

    dynamo hands an optimizer's state to the graph as attributes (static tensors), not inputs.
    Recorded under a fake mode, a real attribute would meet fake values in the same op (and
    turned fake, it would be baked into the recording as a constant without data), so a graph
    that updates them, as a whole training step does, takes them as inputs instead;
    `own_gradients_run` passes their values at each call.
    """
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    gm = fx.GraphModule(gm, graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    values: list[torch.Tensor] = []
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        value = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, torch.Tensor):
            continue
        if anchor is None:
            with gm.graph.inserting_before(next(iter(gm.graph.nodes))):
                anchor = gm.graph.placeholder(f"mixprec_lifted_{len(values)}")
        else:
            with gm.graph.inserting_after(anchor):
                anchor = gm.graph.placeholder(f"mixprec_lifted_{len(values)}")
        anchor.meta = dict(node.meta)
        node.replace_all_uses_with(anchor)
        gm.graph.erase_node(node)
        values.append(value)
    if values:
        gm.graph.lint()
        gm.recompile()
    return gm, values


def _with_lifted(compiled: Any, values: list[torch.Tensor]) -> Any:
    """`compiled` (of a graph `lift_tensor_attributes` changed) called as the original was:
    the lifted values are appended to each call's arguments."""
    if not values:
        return compiled

    def run(*args: Any) -> Any:  # as dynamo calls a backend's result: unboxed
        return compiled(*args, *values)

    return run


def own_gradients_inputs(
    gm: fx.GraphModule,
    example_inputs: list[Any],
) -> tuple[fx.GraphModule, list[Any], list[torch.Tensor]]:
    """What a backend records for a graph that takes its own gradients: `gm` with its tensor
    attributes as trailing inputs, the inputs to record it with, and the lifted values (for
    `own_gradients_run`)."""
    gm, lifted = lift_tensor_attributes(gm)
    return gm, [*example_inputs, *_fakes_like(example_inputs, lifted)], lifted


def own_gradients_run(compiled: Any, lifted: list[torch.Tensor]) -> Any:
    """`compiled` (of `own_gradients_inputs`' graph) as dynamo calls the original: the lifted
    values appended, autograd off (the graph updates parameters in place)."""
    return _with_lifted(_run_without_autograd(compiled), lifted)


def trace_with_policy(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    device_type: str,
    dtype: torch.dtype,
    policy: Policy,
    region: bool = True,
    kernels: str = "native",
) -> fx.GraphModule:
    """Record `gm` run under ``mixprec.autocast(device_type, dtype, policy)`` as an aten graph.

    With ``region=False`` the graph is recorded as it runs, without a region: an aten graph of
    a model whose dtypes are its own (O2/O3), for passes such as `mixprec.graph.kernels`.

    Args:
        gm: a torch-level graph (what dynamo passes to a backend).
        example_inputs: its inputs (fake tensors from dynamo, or real ones).
        device_type, dtype, policy: the region the whole graph runs in.
        kernels: the `mixprec.AmpBackend` ``kernels`` mode. Under ``'auto'`` on a CPU, each
            2-D convolution the product is faster for is recorded as one
            (`mixprec.graph.routes`; in a graph that takes its own gradients, attention's
            route too); the choices are kept in
            ``traced.meta[mixprec.graph.kernels.RECORDED]`` for `choose_kernels`.

    Returns:
        A pre-dispatch aten ``GraphModule`` with the same calling convention as `gm`, in which
        every cast the policy makes is an explicit node; ``node.meta['val']`` holds fake values.
    """
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import make_fx

    interpreter = _Annotating(gm, device_type if region else None)
    whole = computes_gradients(gm)
    routes = None
    if kernels == "auto" and device_type == "cpu":
        from mixprec.graph.kernels import decide_attention, decide_convolution
        from mixprec.graph.routes import Routes

        # Attention is routed here only in a graph that takes its own gradients: a forward
        # graph's is rewritten on the aten graph (`choose_kernels`), as before.
        routes = Routes(decide_convolution, decide_attention if whole else None)

    def run(*args: Any) -> Any:
        # The routes' mode is entered first, so it sits below the region's and sees each call
        # with the dtypes the policy gave it.
        with routes if routes is not None else contextlib.nullcontext():
            if not region:
                return interpreter.run(*args)
            with autocast(device_type, dtype=dtype, policy=policy):
                return interpreter.run(*args)

    # A graph that computes its own gradients is recorded below autograd: the backward's ops
    # then take the recorded forward values as inputs (above autograd, make_fx would see them
    # reach the backward's kernels untracked). Composites appear decomposed there (``linear``
    # as ``t`` and ``addmm``), and the graph needs no gradient of its own.
    keep = (lambda traced, inputs: traced) if whole else _inputs_keep_requires_grad
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is None:
        with fx_traceback.preserve_node_meta():
            traced = make_fx(run, pre_dispatch=not whole, tracing_mode="fake")(*example_inputs)
        return _recorded(keep(traced, example_inputs), routes)
    # Dynamo's own fake mode (and its shape environment): symbolic sizes stay symbolic.
    fakes = [
        fake_mode.from_tensor(t)
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)
        else t
        for t in example_inputs
    ]
    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(run, pre_dispatch=not whole, tracing_mode="real")(*fakes)
    return _recorded(keep(traced, fakes), routes)


def _recorded(traced: fx.GraphModule, routes: Any) -> fx.GraphModule:
    if routes is not None and routes.choices:
        from mixprec.graph.kernels import RECORDED

        traced.meta[RECORDED] = list(routes.choices)
    return traced


def _inputs_keep_requires_grad(traced: fx.GraphModule, inputs: list[Any]) -> fx.GraphModule:
    """Mark the recorded value of each input that requires grad as requiring it.

    make_fx records each input's value detached. Inductor's C++-wrapper mode (``cpp_wrapper``)
    takes its example inputs from these values: detached, a training graph would be compiled
    for inference and return outputs that need no gradient.
    """
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, inputs, strict=True):
        val = node.meta.get("val")
        needs = isinstance(value, torch.Tensor) and value.requires_grad
        if needs and isinstance(val, torch.Tensor) and not val.requires_grad:
            node.meta["val"] = val.detach().requires_grad_()
    return traced


#: ``node.meta['custom'][ORIGIN]`` on a recorded aten node: ``(name of the captured torch-level
#: node it came from, whether that node was an explicit cast in the model's code)``.
ORIGIN = "mixprec_origin"

_ENTER = torch.amp.autocast_mode._enter_autocast
_EXIT = torch.amp.autocast_mode._exit_autocast

_CAST_METHODS = frozenset({"to", "float", "half", "bfloat16", "double", "type"})


# Files of the eager engine that make the policy's casts (their frames appear in the stack
# trace dynamo records for a cast it traced through a region).
_RULE_FILES = tuple(
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "eager", f)
    for f in ("rules.py", "custom.py")
)


def _explicit_cast(node: fx.Node) -> bool:
    """A cast the model's code makes itself (``h.float()``), not one a rule made."""
    if node.op == "call_method":
        is_cast = node.target in _CAST_METHODS
    else:
        is_cast = node.op == "call_function" and getattr(node.target, "__name__", "") in (
            _CAST_METHODS
        )
    trace = node.meta.get("stack_trace") or ""
    return is_cast and not any(f in trace for f in _RULE_FILES)


class _Annotating(fx.Interpreter):
    """Runs the captured graph; every aten node recorded for a captured node remembers it.

    A ``mixprec.autocast`` region inside the captured code was recorded by dynamo as raw state
    changes with the values of trace time: entering sets torch's autocast state, exiting sets
    it back to what it was *then* (no region). Replayed inside the backend's own region, that
    exit would switch the backend's region off for the rest of the graph, so the replay treats
    the recorded nesting counter as brackets and restores the state it saw at the opening one.
    """

    def __init__(self, gm: fx.GraphModule, region: str | None = None) -> None:
        super().__init__(gm)
        self._brackets: list[tuple[Any, ...]] = []
        # A whole step's graph: from its ``torch.autograd.grad`` on, the nodes are the backward
        # and the update, which eager code runs outside the region (`region`: its device).
        self._region = region
        self._after_grad = False

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_function" and n.target is _ENTER:
            # A torch.autocast region in the model's code. Recording it as a node would let
            # torch's dispatcher apply its lists to the region when the graph is compiled; the
            # eager engine follows torch's state instead, so apply the state change now (the
            # casts it implies are recorded as explicit nodes) and record nothing.
            device, dtype, enabled, cache = self.map_nodes_to_values(n.args, n)
            saved = _torch_state()
            torch.autocast_increment_nesting()
            torch.set_autocast_enabled(device, enabled)
            if dtype is not None:
                torch.set_autocast_dtype(device, dtype)
            if cache is not None:
                torch.set_autocast_cache_enabled(cache)
            return saved
        if n.op == "call_function" and n.target is _EXIT:
            (saved,) = self.map_nodes_to_values(n.args, n)
            _set_torch_state(saved)
            torch.autocast_decrement_nesting()
            return None
        if n.op == "call_function" and n.target is torch.autocast_increment_nesting:
            self._brackets.append(_torch_state())
        elif n.op == "call_function" and n.target is torch.autocast_decrement_nesting:
            out = super().run_node(n)
            if self._brackets:
                _set_torch_state(self._brackets.pop())
            return out
        saved = n.meta.get("custom")
        n.meta["custom"] = {**(saved or {}), ORIGIN: (n.name, _explicit_cast(n))}
        if n.op == "call_function" and n.target is torch.autograd.grad:
            self._after_grad = True
        outside = self._after_grad and self._region is not None
        try:
            with (
                fx_traceback.set_current_meta(n),
                autocast(self._region, enabled=False) if outside else contextlib.nullcontext(),
            ):
                return super().run_node(n)
        finally:
            if saved is None:
                n.meta.pop("custom", None)
            else:
                n.meta["custom"] = saved

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_function(target, *_plain(args, kwargs))

    def call_method(self, target: Any, args: tuple, kwargs: dict) -> Any:
        return super().call_method(target, *_plain(args, kwargs))


def _plain(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args` and `kwargs` with fx's immutable lists and dicts made plain lists and dicts.

    fx hands a node its list arguments (``torch.cat([a, b])``, a custom op's ``Tensor[]``) as
    ``immutable_list``. The eager rules recognise a list argument by its exact type, as eager
    code passes it (``type(a) in (list, tuple)``: the hot path must not pay an isinstance
    chain), so an immutable list would reach the op with its tensors uncast: the graph path
    would not give the dtypes eager ``mixprec.autocast`` gives.
    """
    return _unfreeze(args), _unfreeze(kwargs)


def _unfreeze(value: Any) -> Any:
    # Plain containers too: an immutable list may sit inside a plain dict or tuple.
    if isinstance(value, list):  # immutable_list included
        return [_unfreeze(v) for v in value]
    if isinstance(value, dict):  # immutable_dict included
        return {k: _unfreeze(v) for k, v in value.items()}
    if type(value) is tuple:  # not a namedtuple (torch.return_types): kept as it is
        return tuple(_unfreeze(v) for v in value)
    return value


def _torch_state() -> tuple[Any, ...]:
    per_device = tuple(
        (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in DEVICE_TYPES
    )
    return per_device, torch.is_autocast_cache_enabled()


def _set_torch_state(state: tuple[Any, ...]) -> None:
    per_device, cache = state
    for dev, enabled, dtype in per_device:
        torch.set_autocast_enabled(dev, enabled)
        torch.set_autocast_dtype(dev, dtype)
    torch.set_autocast_cache_enabled(cache)
