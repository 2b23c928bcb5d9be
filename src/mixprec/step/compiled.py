"""The second half of a training step, after backward, as one compiled function.

Where `TrainStep` cannot run the whole step as one graph (`mixprec.step.whole`, whose graph
calls this module's update body after taking the gradients itself), it compiles the step in two
pieces, since backward is then where autograd, not Python, is in charge:

1. the forward and the loss, through mixprec's graph pass (the policy applies to every op, the
   loss included; AOTAutograd derives the backward from the cast graph, so backward too runs as
   compiled code);
2. everything after backward, here: (O2) the low-precision gradients into the fp32 masters, the
   scaler's unscale and overflow check, clipping, the optimizer's own update, the exact skip on
   overflow, the masters copied back into the model, the FP8 scale update and the loss-scale
   update, traced by ``torch.compile`` into one graph.

Why one graph for the second half: eager, each of those stages is a pass over every parameter
(and the optimizer's update alone is a dozen small kernels per parameter); compiled, inductor
fuses the unscaled gradient, the update, the skip and the copy-back into one loop per
parameter. The skip is a ``torch.where`` between the state before and after the update, which
in a fused loop costs nothing: the old value is in a register when the new one is written. No
value is read back to the host, so the step never waits for the device.

What it is exact to: the eager `TrainStep` step runs the same operations (torch's own optimizer
``step``, the scaler's own unscale kernel and scale update, ``clip_grad_norm_``). Inductor may
fuse and reorder fp32 arithmetic (an ``a * b + c`` may become one fused multiply-add, a norm may
be summed in another order), so compiled and eager steps agree to a few fp32 ulps per step,
not bit for bit; a skipped step is exact (every parameter, optimizer state tensor and step
counter keeps its bits, and the scale backs off exactly as eager).

Costs: compiling takes seconds to a minute once per graph (inductor's on-disk cache makes later
processes fast); at run time, one guard check and one call. No host-device synchronisation.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable
from typing import Any

import torch

from mixprec.errors import PolicyError, format_options
from mixprec.fp8.convert import fp8_update
from mixprec.levels.optimizer import AmpOptimizer
from mixprec.optim.lowmem import LowMemOptimizer
from mixprec.scaling import contract
from mixprec.scaling.state import update_scale
from mixprec.scaling.unscale import _unscale_and_check, check_finite_

__all__ = ["CountingBackend", "StepUpdate", "keep_weight_layouts", "own_code", "tensor_lr"]

# Optimizers whose single-tensor ``step`` takes the lr as a 0-dim tensor, so that an LR schedule
# (which fills the tensor in place) never changes what the compiled graph was traced with.
_TENSOR_LR_OK = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad")
    if hasattr(torch.optim, name)
)


def tensor_lr(optimizer: torch.optim.Optimizer) -> list[str]:
    """Hold each param group's lr as a 0-dim tensor where `optimizer` accepts one; return notes.

    A Python float lr is a constant of the traced graph: every change (each step of an LR
    schedule) would recompile it. torch's schedulers fill a tensor lr in place. Skipped for
    groups that asked for ``foreach=True`` (torch refuses a tensor lr there without
    ``capturable``), for optimizer classes not known to take one, and on CUDA, where
    `mixprec.step.graphs.prepare` decides (a tensor lr there needs ``capturable``).
    """
    notes: list[str] = []
    # mixprec's low-memory optimizers (mixprec.optim) say so with `accepts_tensor_lr`.
    if not (isinstance(optimizer, _TENSOR_LR_OK) or getattr(optimizer, "accepts_tensor_lr", False)):
        return notes
    name = type(optimizer).__name__
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if not isinstance(lr, float) or group.get("foreach") or group.get("fused"):
            continue
        device = next((p.device for p in group["params"]), torch.device("cpu"))
        if device.type == "cuda":
            continue
        group["lr"] = torch.tensor(lr, dtype=torch.float32, device=device)
        notes.append(
            f"{name} param group {i}: lr held as a 0-dim tensor (an LR schedule fills it in "
            f"place, so the compiled step is not recompiled when it changes)"
        )
    return notes


def keep_weight_layouts(model: torch.nn.Module, compile_kwargs: dict[str, Any]) -> str | None:
    """Turn inductor's layout optimization off for a CPU model with convolution weights; say so.

    Inductor runs the convolutions of a graph channels-last when it judges that faster, so the
    compiled backward returns each convolution weight's gradient channels-last. autograd keeps a
    gradient only in its parameter's layout: `AccumulateGrad` copies every such gradient into a
    new tensor strided like the (contiguous) weight, one extra pass over every convolution weight
    per step. ResNet-50 (CIFAR size, batch 8, bf16, AMD EPYC with avx512_bf16, 2 threads): 74-76
    ms a step with the copies, 64-68 ms without, against 64-67 ms for torch.amp eager (each in a
    process of its own). With the option off inductor keeps the model's own layout, so a model
    made channels-last (``model.to(memory_format=torch.channels_last)``) still gets
    channels-last convolutions, and gradients that need no copy. Changes `compile_kwargs` in
    place (``options['layout_optimization'] = False``) unless the caller set that option, or a
    ``mode`` (``torch.compile`` takes options or a mode, not both); returns the note for
    ``explain()``, or None when nothing changed. On CUDA, where channels-last convolutions are
    what makes 16-bit convolutions fast, the caller does not call this.
    """
    if not any(p.dim() >= 3 for p in model.parameters()):
        return None  # no convolution weight: nothing inductor would re-lay out
    options = compile_kwargs.get("options") or {}
    if "layout_optimization" in options or compile_kwargs.get("mode"):
        return None
    compile_kwargs["options"] = {**options, "layout_optimization": False}
    return (
        "inductor's layout optimization off (compile options layout_optimization=False): "
        "channels-last convolutions on contiguous weights would return channels-last weight "
        "gradients, and autograd would copy each into the weight's layout every step; the "
        "graph keeps the model's layout (make the model channels_last for channels-last "
        "convolutions)"
    )


#: Inductor settings for the update graph (a caller's ``options`` override them).
#: ``max_fusion_buffer_group_pairwise_attempts``: inductor pairs each node with up to this many
#: later nodes that read the same buffer, looking for fusions. In the update graph every
#: parameter's nodes read the same few scalars (the skip flag, the inverse scale, the lr), so at
#: inductor's default of 64 the search tries tens of thousands of pairs of different parameters'
#: kernels, which never fuse (different sizes). A parameter's own chain (gradient, state,
#: weight, skip) is found through the buffers only it reads, a handful of nodes each, so 8 finds
#: the same fusions. ResNet-50's update (161 tensors, SGD with momentum, cold cache, 2 cores):
#: the search took 27-72 s at 64 and 3-6 s at 8, the same 327 kernels, the same step time.
UPDATE_INDUCTOR_OPTIONS: dict[str, Any] = {"max_fusion_buffer_group_pairwise_attempts": 8}

_INSTANCES = itertools.count()


def own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`fn` with a code object of its own, named `name` and a serial number.

    dynamo keeps compiled graphs per code object, at most ``torch._dynamo.config.
    recompile_limit`` (8) of them, and past that runs the function uncompiled, with a warning.
    Every TrainStep's forward and update are the same Python functions: without their own code
    objects, the ninth TrainStep of a process (a sweep, a test suite) would silently run eager
    code. The name also says in dynamo's logs which graph is which.
    """
    code = fn.__code__.replace(co_name=f"{name}_{next(_INSTANCES)}")
    new = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs it compiles, then hands them on.

    Args:
        backend: the backend that compiles them (a name or a callable); ``torch.compile``'s
            `mode` and `options` reach it as they would reach it directly.
        kernels: `mixprec.graph.kernels`' mode for graphs that run in their own dtypes (an
            O2/O3 model's forward): ``'native'`` hands graphs on as they are; ``'auto'`` and
            ``'fp32'`` record them at aten level first (one extra trace) and choose the route
            of their heavy low-precision ops on a CPU.

    Attributes:
        compiles: graphs compiled so far.
        kernel_choices: a `KernelChoice` per heavy low-precision op compiled (CPU).
    """

    def __init__(
        self, backend: str | Callable[..., Any] = "inductor", kernels: str = "native"
    ) -> None:
        from mixprec.graph.kernels import KERNEL_MODES

        if kernels not in KERNEL_MODES:
            raise PolicyError(
                f"unknown kernels mode {kernels!r}; valid: {format_options(KERNEL_MODES)}."
            )
        self.backend = backend
        self.kernels = kernels
        self.compiles = 0
        self.kernel_choices: list[Any] = []

    def __call__(
        self,
        gm: torch.fx.GraphModule,
        example_inputs: list[Any],
        mode: str | None = None,
        options: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        from mixprec.graph.backend import _inner_backend, _unkept_operators

        self.compiles += 1
        inner = _inner_backend(self.backend, mode, options)
        tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
        on_cpu = bool(tensors) and all(t.device.type == "cpu" for t in tensors)
        from mixprec.graph.trace import computes_gradients, own_gradients_inputs, own_gradients_run

        own_gradients = computes_gradients(gm)  # before the re-trace records the backward
        retraced = self.kernels != "native" and on_cpu and not _unkept_operators(gm)
        if retraced and own_gradients:
            gm, example_inputs, lifted = own_gradients_inputs(gm, example_inputs)
        if retraced:
            from mixprec.graph.kernels import choose_kernels
            from mixprec.graph.lowering import keep_whole_in
            from mixprec.graph.trace import trace_with_policy
            from mixprec.policy.policy import Policy

            gm = trace_with_policy(gm, example_inputs, "cpu", torch.bfloat16, Policy(),
                                   region=False, kernels=self.kernels)  # fmt: skip
            self.kernel_choices += choose_kernels(gm, "cpu", self.kernels)
            inner, kept = keep_whole_in(inner, self.backend, gm, "cpu", self.kernels, mode,
                                        options)  # fmt: skip
            self.kernel_choices += kept
        if not (retraced and own_gradients):
            return gm if inner == "eager" else inner(gm, example_inputs)
        # Recorded with its backward: nothing left to derive, and parameters updated in place.
        with torch.no_grad():
            compiled = gm if inner == "eager" else inner(gm, example_inputs)
        return own_gradients_run(compiled, lifted)


def _raw_step(optimizer: torch.optim.Optimizer) -> tuple[Callable[..., Any], bool]:
    """The optimizer's ``step`` body, and whether it is the unwrapped one.

    torch wraps every ``step`` twice: a profiler/hook wrapper, and a grad-mode wrapper that
    breaks dynamo's graph on purpose (so that a standalone compiled ``step`` is an inference
    graph). Inside our update, grad mode is off already and the whole update must be one graph,
    so we call the body under the wrappers, unless the optimizer has step hooks (the wrapper
    runs them: then we keep it, and dynamo's graph breaks with it).
    """
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    hooks = (
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or _global_optimizer_pre_hooks
        or _global_optimizer_post_hooks
    )
    bound = type(optimizer).step
    if hooks or "step" in vars(optimizer):  # hooks, or a step patched on the instance
        return (lambda: optimizer.step()), False
    raw = inspect.unwrap(bound)
    return (lambda: raw(optimizer)), True


class StepUpdate:
    """Everything of one step after backward, for `optimizer`, as one compiled function.

    Args:
        optimizer: the `AmpOptimizer` the step trains with (one ``initialize`` call).
        clip: clip the unscaled gradients to this total norm (None: no clipping).
        compile_kwargs: ``torch.compile`` keyword arguments (``backend``, ``mode``, ``options``).

    Attributes:
        compiles: graphs compiled so far (the first call compiles one; a change dynamo guards
            on, such as a new set of parameters with gradients, compiles another).
        split: why the update is more than one graph (step hooks, which torch's wrapper runs
            between graphs; a fused optimizer, whose kernel torch keeps out of compiled code),
            or None.
    """

    def __init__(
        self,
        optimizer: AmpOptimizer,
        clip: float | None,
        compile_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.optimizer = optimizer
        self.clip = clip
        self._complete_at: tuple[int, int, int] | None = None
        self._own_masters_at: tuple[int, int] | None = None
        self._own_masters: list[torch.Tensor] = []
        # ids of parameters that had a gradient in an eager update and kept no state (SGD
        # without momentum). Ids, not weak references: a parameter dies with its optimizer.
        self._stateless: set[int] = set()
        kwargs = dict(compile_kwargs or {})
        backend = kwargs.pop("backend", "inductor")
        self._backend = CountingBackend(backend)
        kwargs.setdefault("dynamic", False)
        if backend == "inductor" and not kwargs.get("mode"):  # torch.compile takes one of the two
            kwargs["options"] = {**UPDATE_INDUCTOR_OPTIONS, **(kwargs.get("options") or {})}
        update = types.MethodType(own_code(StepUpdate._update, "mixprec_trainstep_update"), self)
        self._compiled = torch.compile(update, backend=self._backend, **kwargs)
        self._step, unwrapped = _raw_step(optimizer.optimizer)
        inner = optimizer.optimizer
        # mixprec's low-memory optimizers take the scale (fp16 gradients are not unscaled in
        # place) and skip exactly themselves: nothing saved to restore. Not with clipping
        # (it needs unscaled gradients) or step hooks (which only `step` runs).
        self._lowmem = clip is None and isinstance(inner, LowMemOptimizer)
        self._takes_scale = self._lowmem and unwrapped
        self.split: str | None = None
        if not unwrapped:
            self.split = "the optimizer's step hooks run between graphs"
        elif any(g.get("fused") for g in inner.param_groups):
            self.split = (
                f"torch keeps {type(inner).__name__}'s fused kernel out of compiled code: the "
                f"update is a graph before it and one after (the exact skip then holds a copy "
                f"of the state the kernel overwrites)"
            )

    @property
    def compiles(self) -> int:
        """Graphs compiled so far (the first call compiles one; a change dynamo guards on, such
        as a new set of parameters with gradients, compiles another)."""
        return self._backend.compiles

    # ------------------------------------------------------------------ when it can run

    @staticmethod
    def blocker(optimizer: AmpOptimizer) -> str | None:
        """Why the update of `optimizer` cannot be compiled, or None.

        Asked at each step until the optimizer has state, that step included: the checks on
        the state find nothing before it exists, the others answer from the first step.
        """
        inner = optimizer.optimizer
        name = type(inner).__name__
        scaler = optimizer.scaler
        if contract.needs_closure(inner):
            return f"{name}.step requires a closure, which re-evaluates the loss inside the step"
        if scaler is not None and scaler.is_enabled():
            if scaler._num_losses > 1:
                return (
                    f"the scaler has num_losses={scaler._num_losses}: each loss's backward is "
                    f"unscaled in its own scale_loss block, which a one-loss step has no place for"
                )
            if contract.takes_scaler_keyword(inner):
                return f"{name}.step(grad_scaler=...) runs its own unscale and skip code"
            if scaler._skip_mode.value == "sync":
                return "the scaler was asked for skip_mode='sync', a host decision every step"
        devices = set()
        for group in inner.param_groups:
            if group.get("differentiable"):
                return f"{name} runs with differentiable=True"
            for p in group["params"]:
                devices.add(p.device)
                if p.grad is not None and p.grad.is_sparse:
                    return "sparse gradients change shape every step"
                for key, value in inner.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor):
                        return (
                            f"{name} keeps its state {key!r} as a Python {type(value).__name__},"
                            f" which a compiled graph would freeze at its traced value"
                        )
        if len(devices) > 1:
            return f"{name} steps parameters on several devices ({sorted(map(str, devices))})"
        return None

    def ready(self) -> bool:
        """Whether the compiled update can run now, after backward: every parameter with a
        gradient has its optimizer state (or is known to keep none).

        A step that creates state runs eagerly (`eager`): it is decided on the host there (a
        skipped creating step creates nothing), and state created inside a traced graph would
        change what the graph was traced with. Cost: a pass over the parameters, skipped while
        every parameter has state and the state's size and the parameter count stay those of
        that check.
        """
        inner = self.optimizer.optimizer
        scaler = self.optimizer.scaler
        stateless = self._stateless
        if scaler is not None and scaler.is_enabled():
            if contract.needs_closure(inner):
                return False  # (`blocker` says why)
            guard = scaler._guard(inner)
            if guard.flag is None:
                # The skip flag the graph writes, made here where no eager step made it: a
                # scaler just loaded from a checkpoint, beside an optimizer that has its state
                # (the first step after a resume then runs the compiled update, as it would
                # have without the interruption).
                device = scaler._losses[0].state.scale.device
                guard.flag = torch.zeros((), dtype=torch.float32, device=device)
            stateless = {k for k, ref in guard._stateless.items() if ref() is not None}
        key = (id(inner.state), len(inner.state), sum(len(g["params"]) for g in inner.param_groups))
        if key == self._complete_at:
            return True
        everyone = True
        for group in inner.param_groups:
            for p in group["params"]:
                if inner.state.get(p):
                    continue
                everyone = False
                if p.grad is not None and id(p) not in stateless:
                    return False
        if everyone:
            self._complete_at = key
        return True

    def state_complete(self) -> bool:
        """Whether every trainable parameter of the optimizer has its state, or is known to
        keep none (checked before a step, when no gradient says which will train)."""
        inner = self.optimizer.optimizer
        stateless = self._stateless
        scaler = self.optimizer.scaler
        if scaler is not None and scaler.is_enabled():
            guard = scaler._guard(inner)
            stateless = stateless | {k for k, ref in guard._stateless.items() if ref() is not None}
        return all(
            inner.state.get(p) or id(p) in stateless
            for group in inner.param_groups
            for p in group["params"]
            if p.requires_grad
        )

    def eager(self) -> None:
        """The same update, op by op (after a plain scaled backward); notes stateless params."""
        opt = self.optimizer
        inner = opt.optimizer
        opt._after_backward()
        scaler = opt.scaler
        if scaler is not None and scaler.is_enabled() and not self._lowmem:
            scaler.unscale_(inner)  # else scaler.step hands the optimizer the scale
        if self.clip is not None:
            params = [p for g in inner.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.clip)
        opt._scaling.scaled = True  # what scale_loss records: the loss was scaled
        opt.step()
        opt._scaling.flush()
        if scaler is not None and scaler.is_enabled():
            return  # the scaler's guard knows which steps ran (a skipped one proves nothing)
        for group in inner.param_groups:
            for p in group["params"]:
                if p.grad is not None and not inner.state.get(p):
                    self._stateless.add(id(p))

    # ------------------------------------------------------------------ the step

    def zero_grad(self) -> None:
        """Clear the gradients before a step's backward, keeping the fp32 masters' (O2).

        The masters' gradient buffers stay allocated between compiled steps: the graph writes
        each step's gradients into them in place, because assigning ``.grad`` inside the graph
        would break it in two (dynamo stops before an optimizer whose parameters have pending
        attribute changes). `__call__` drops a master's stale gradient where its weight got
        none this step, so the optimizer skips that parameter as it would eagerly.
        """
        opt = self.optimizer
        if not opt._low:
            opt.optimizer.zero_grad(set_to_none=True)
            return
        for low in opt._low:
            low.grad = None
        groups = opt.optimizer.param_groups
        key = (id(groups), sum(len(g["params"]) for g in groups))
        if key != self._own_masters_at:  # param groups changed: look again
            masters = {id(m) for m in opt._masters}
            self._own_masters = [p for g in groups for p in g["params"] if id(p) not in masters]
            self._own_masters_at = key
        for p in self._own_masters:  # fp32 weights (norm layers) are their own masters
            p.grad = None

    def __call__(self) -> None:
        """Run the update once (compiling it on first use). No host sync."""
        opt = self.optimizer
        for low, master in zip(opt._low, opt._masters, strict=True):
            if low.grad is None:
                master.grad = None
            elif master.grad is None:
                master.grad = torch.empty_like(master)
        scaler = opt.scaler
        if scaler is not None and scaler.is_enabled():
            # Handed in rather than looked up inside: what the graph reads is then a plain
            # argument (the scaler's bookkeeping is weak references and dicts keyed by id).
            state = scaler._losses[0].state
            flag = scaler._known_guard(self.optimizer.optimizer).flag
            self._compiled(state, flag)
            scaler.note_update()  # the host's count of updates (on_skip batches, explain)
        else:
            self._compiled(None, None)
        for low in opt._low:  # as eager O2 leaves them: the gradients live in the masters
            low.grad = None
        if getattr(opt.step, "_wrapped_by_lr_sched", False):
            # An LR scheduler wrapped optimizer.step to note that it ran (and warns when it
            # did not); the compiled update ran the step's body, so note it the same way.
            opt._opt_called = True  # type: ignore[attr-defined]

    def _update(self, state: Any, flag: torch.Tensor | None) -> None:
        opt = self.optimizer
        inner = opt.optimizer
        with torch.no_grad():
            # O2: the low-precision gradients into the fp32 masters (accumulation in fp32).
            for low, master in zip(opt._low, opt._masters, strict=True):
                if low.grad is not None:
                    master.grad.copy_(low.grad)  # the buffer `__call__` keeps allocated
            params = [p for g in inner.param_groups for p in g["params"] if p.grad is not None]
            scaler = opt.scaler
            found = None
            # An optimizer that takes the scale itself (torch's fused contract: mixprec's
            # low-memory ones) divides by it in fp32 and skips exactly inside its own update:
            # its fp16 gradients are not unscaled in place, and nothing is saved to restore.
            takes_scale = self._takes_scale
            if state is not None:
                found = torch.zeros((), dtype=torch.float32, device=state.scale.device)
                # The reciprocal in fp64, as the eager scaler (and torch's) takes it.
                inv = None if takes_scale else state.scale.double().reciprocal().float()
                grads = [p.grad for p in params]
                by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
                for grad in grads:
                    by_dtype.setdefault(grad.dtype, []).append(grad)
                for same in by_dtype.values():
                    if takes_scale:
                        check_finite_(same, found)
                    else:
                        _unscale_and_check(same, inv, found, scaler._unscale_impl)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(params, self.clip)
            if found is None:
                self._step()
                skipped = None
            else:
                skip = found != 0
                if takes_scale:
                    inner.step_scaled(state.scale, skip.float())
                else:
                    # Exact skip: the state before the update, selected back where found_inf
                    # is set.
                    tracked = list(params)
                    for p in params:
                        tracked += [v for v in inner.state.get(p, {}).values()]
                    saved = [t.clone() for t in tracked]
                    self._step()
                    for current, old in zip(tracked, saved, strict=True):
                        current.copy_(torch.where(skip, old, current))
                flag.copy_(skip)
                skipped = flag
                new = update_scale(state, found, scaler._config)
                for cur, nxt in zip(state, new, strict=True):
                    cur.copy_(nxt)
            if opt._fp8:
                fp8_update(opt._fp8, skipped)
            if opt._low:
                torch._foreach_copy_(opt._low, opt._masters)
