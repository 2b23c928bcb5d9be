"""What an opt level does to a model: cast its weights, and hooks around its forward.

Everything is done with PyTorch's own extension points, never by replacing ``forward``:

- weights are cast in place (``param.data``), keeping every Parameter object, so optimizers,
  state-dict keys and user references stay valid; normalization layers can be kept in fp32;
- fp32 normalization layers in a low-precision model get forward hooks that run them in fp32
  (inputs up, outputs back down), so they work with every kernel and keep fp32 statistics;
- the model gets a pre-hook (cast floating inputs at the entry; enter a ``mixprec.autocast``
  region for O1) and a post-hook that always runs, also when forward raises (cast outputs,
  leave the region). Integer inputs such as token ids pass untouched, and so do targets passed
  as ``labels=`` (`TARGET_KEYWORDS`). A framework that calls another method through the model's
  call (Lightning's ``training_step`` under DDP) sets ``AmpHooks.passthrough``: such a call's
  arguments and result are not cast.

The hooks are instances of `AmpHooks`; `amp_hooks(model)` finds them (to refuse initializing a
model twice), and ``remove()`` takes them off.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mixprec.eager.autocast import autocast

__all__ = ["NORM_LAYERS", "AmpHooks", "amp_hooks", "cast_floats", "cast_model"]

#: Module types kept in fp32 by ``keep_batchnorm_fp32`` (all normalization layers, not only BN).
NORM_LAYERS: tuple[type[nn.Module], ...] = tuple(
    t for t in (
        nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
        getattr(nn, "RMSNorm", None), getattr(nn.modules.batchnorm, "SyncBatchNorm", None),
    ) if t is not None
)  # fmt: skip


#: Keyword arguments that are a loss's targets, not the model's inputs: never cast. Hugging Face
#: models take their targets as ``labels`` and compute the loss inside forward. A target's
#: precision is part of the objective (a bf16 regression target keeps 8 bits), and torch 2.11's
#: mse_loss backward refused an fp32 output beside a bf16 target.
TARGET_KEYWORDS = frozenset({"labels"})


def cast_floats(value: Any, dtype: torch.dtype, widen_only: bool = False) -> Any:
    """Cast floating tensors in a nested structure to `dtype`; leave everything else.

    With `widen_only`, only narrower floats are cast (an fp32 output cast leaves a model's
    deliberate fp64 outputs alone, as torch.autocast does).
    """
    if isinstance(value, torch.Tensor):
        cast = value.is_floating_point() and value.dtype != dtype
        if cast and widen_only:
            cast = value.dtype.itemsize < dtype.itemsize
        return value.to(dtype) if cast else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(cast_floats(v, dtype, widen_only) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype, widen_only) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: cast_floats(v, dtype, widen_only) for k, v in value.items()})
    return value


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, NORM_LAYERS)


def cast_model(model: nn.Module, dtype: torch.dtype, keep_norm_fp32: bool) -> list[nn.Module]:
    """Cast floating parameters and buffers of `model` to `dtype` in place.

    Returns the normalization layers kept in fp32 (when `keep_norm_fp32`).
    """
    kept: list[nn.Module] = []
    skip: set[int] = set()
    for module in model.modules():
        # State a module declares fp32 (an FP8 layer's scales and amax histories).
        for name in getattr(module, "mixprec_fp32_buffers", ()):
            buf = module._buffers.get(name)
            if buf is not None:
                skip.add(id(buf))
    if keep_norm_fp32:
        for module in model.modules():
            if _is_norm(module):
                kept.append(module)
                for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                    skip.add(id(t))
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point() and id(t) not in skip and t.dtype != dtype:
                t.data = t.data.to(dtype)
                if t.grad is not None:
                    t.grad = None  # a gradient of the old dtype no longer fits
    return kept


class AmpHooks:
    """The forward hooks one ``initialize`` call puts on a model and its fp32 norm layers."""

    def __init__(
        self,
        model: nn.Module,
        *,
        input_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
        region: tuple[str, torch.dtype, Any] | None,
        fp32_norms: list[nn.Module],
        low: torch.dtype,
    ) -> None:
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype
        self.region = region
        # The AmpOptions when mixprec.fully_shard applied the level through FSDP2 (no masters:
        # FSDP's fp32 shards are the masters); None when initialize did.
        self.sharded: Any = None
        self.optimized = False  # (sharded models) initialize already added the optimizer side
        # The last forward ran inside a DDP wrapper's no_sync(): its backward leaves local
        # gradients that the next synchronised backward must find on the weights (AmpOptimizer).
        self.unsynced = False
        self._local = _Regions()  # per-thread stack of open regions (re-entrant calls)
        # The policy's fp32 modules and healing's moves (`mixprec.levels.keep_fp32`), at O1.
        self.fp32: Any = None
        #: Set by a framework integration: ``passthrough(model)``, asked at the model's entry,
        #: says the call does not run the model's forward but a method the framework routes
        #: through the model's call (Lightning runs ``training_step`` as a DDP wrapper's
        #: forward): its arguments (the batch, targets included) and its result are then not
        #: the model's inputs and outputs, and are not cast. The model's own calls inside it
        #: (``self(x)``) are cast as always.
        self.passthrough: Callable[[nn.Module], bool] | None = None
        self._handles = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, with_kwargs=True, always_call=True),
        ]
        for norm in fp32_norms:
            self._handles.append(norm.register_forward_pre_hook(_to_fp32, with_kwargs=True))
            self._handles.append(norm.register_forward_hook(_OutputTo(low), always_call=False))

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ddp = _active_ddp()
        self.unsynced = ddp is not None and not ddp.require_backward_grad_sync
        if self.passthrough is not None and self.passthrough(module):
            # Known at its exit by its kwargs, a dict of its own for every call. (One at a time:
            # the framework's method calls the model itself, not another routed method.)
            self._local.passed = kwargs
        elif self.input_dtype is not None:
            args = cast_floats(args, self.input_dtype)
            kwargs = {k: v if k in TARGET_KEYWORDS else cast_floats(v, self.input_dtype)
                      for k, v in kwargs.items()}  # fmt: skip
        if self.region is not None:
            device_type, dtype, policy = self.region
            region = autocast(device_type, dtype=dtype, policy=policy)
            region.__enter__()
            self._local.stack.append(region)
        return args, kwargs

    def _leave(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.region is not None:
            stack = self._local.stack
            if stack:
                stack.pop().__exit__(None, None, None)
        if self.passthrough is not None and self._local.passed is kwargs:
            self._local.passed = None
            return None
        if self.output_dtype is not None and output is not None:
            # To fp32 only widens: the cast undoes low precision; it never narrows fp64.
            return cast_floats(output, self.output_dtype, self.output_dtype == torch.float32)
        return None

    def add_handles(self, handles: list[Any]) -> None:
        """Own more hook handles (the state-dict hooks of `mixprec.levels.model_state`), so that
        ``remove()`` takes them off too."""
        self._handles += handles

    def remove(self) -> None:
        """Take every hook off the model and its layers."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.fp32 is not None:
            self.fp32.remove()


_ACTIVE_DDP = getattr(nn.parallel.DistributedDataParallel, "_get_active_ddp_module", None)


def _active_ddp() -> Any:
    """The DistributedDataParallel whose forward is running (torch sets it around its wrapped
    module's call, for dynamo's DDP optimizer), or None."""
    return None if _ACTIVE_DDP is None or torch.compiler.is_compiling() else _ACTIVE_DDP()


class _Regions(threading.local):
    """A per-thread stack of open regions, present from the first access in every thread: a
    stack created lazily would change what torch.compile's guards saw after the first call
    (the O1 model's forward would be compiled twice). With it, the kwargs of the call let
    through uncast (`AmpHooks.passthrough`) that has not returned yet."""

    def __init__(self) -> None:
        self.stack: list[Any] = []
        self.passed: dict | None = None

    def __reduce__(self) -> tuple[type, tuple]:
        # A copy or pickle of the model (EMA/SWA's deepcopy, torch.save(model)) takes the
        # hooks along: they get a fresh, empty stack (regions are open only inside a call).
        return (type(self), ())


def _to_fp32(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)


class _OutputTo:
    """Post-hook casting a norm layer's fp32 output back to the model's low dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return cast_floats(output, self.dtype)


def amp_hooks(model: nn.Module) -> AmpHooks | None:
    """The `AmpHooks` on `model`, if ``initialize`` has been applied to it."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, AmpHooks):
            return owner
    return None
