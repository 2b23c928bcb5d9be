"""FP8 weights under FSDP2: all-gathered in FP8 with their scale, computed once per all-gather.

    mixprec.fully_shard(model, opt_level="O2", fp8="tensorwise", units=(Block,))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = mixprec.initialize(model, optimizer, opt_level="O2")  # FP8 from the shard

FSDP2 all-gathers each unit's parameters before its forward (and, resharded, before its
backward). An FP8 layer only ever multiplies its weight in FP8, so gathering it in bf16 and
quantising the whole weight on every rank afterwards moves twice the bytes and repeats the
cast. Instead each rank quantises its own shard before the all-gather, with one scale for the
whole weight, and the gathered FP8 bytes are the layer's FP8 weight (torchao's float8 training
does the same; the extension points are FSDP2's ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` on the sharded parameter's local tensor):

- `Fp8ShardWeight` is that local tensor: the fp32 (O1, O2) or bf16 (O3) shard, behaving as a
  plain tensor for everything else (the optimizer steps it, checkpoints read it).
  ``fsdp_pre_all_gather`` rounds the shard to the gather dtype FSDP2 would use (so the FP8
  values are those the unsharded layer would make from its bf16 weight), finds the weight's
  amax across the shard group (one all-reduce of one value, MAX) and casts with the recipe's
  scale; true delayed scaling (``overflow='saturate'``) takes the delayed scale the histories
  agreed on, and needs no collective at all. The scale is thus computed once per all-gather.
- `Fp8GatheredWeight` is what ``fsdp_post_all_gather`` makes of the gathered bytes: the FP8
  weight and its scale, with the parameter's dtype for autograd. `Fp8Linear` takes both as
  they are (``fp8_gathered``); the weight gradient comes back in that dtype and FSDP2 reduces
  it as usual. Any other use of it (a layer calling the weight directly) reads the dequantised
  values: correct, not fast.

What is gathered: 1 byte per weight element instead of 2 (bf16) or 4 (fp32); biases and other
parameters as before. The histories agree across the shard group (`to_fp8`'s ``amax_group``:
one asynchronous all-reduce per step in `fp8_update`), so every rank holds the same FP8 state,
which a sharded checkpoint saves once.

Not covered: rowwise recipes (their backward re-quantises the weight along the other axis from
its high-precision values: those layers gather as usual), weights tied to another module (the
other module needs them unquantised), ``reshard_after_forward`` given as an int (FSDP2 has no
extension hook for the smaller re-gather), and ``torch.compile`` of the sharded model.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from mixprec._compat import local_tensor
from mixprec.fp8.linear import Fp8Linear
from mixprec.fp8.numerics import amax, fp8_amax, inverse, quantize, scale_from_amax
from mixprec.fp8.recipe import E4M3, fp8_max

__all__ = [
    "Fp8GatheredWeight", "Fp8ShardWeight", "gathers_in_fp8", "plain_dtensor", "plain_local",
    "shard_weights_in_fp8",
]  # fmt: skip

_E4M3_MAX = fp8_max(E4M3)
aten = torch.ops.aten

# Ops FSDP2 uses to carve and pad a shard out of the parameter: their results are still this
# weight's shard (so the all-gather extension stays on it). Every other op sees a plain tensor.
_SHARD_OPS = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.narrow.default,
    aten.slice.Tensor, aten.new_zeros.default, aten.clone.default, aten._to_copy.default,
    aten.as_strided.default, aten.empty_like.default,
}  # fmt: skip
_GATHERED_VIEWS = {aten.detach.default, aten.alias.default, aten.view.default,
                   aten.as_strided.default, aten._unsafe_view.default}  # fmt: skip


class Fp8ShardWeight(torch.Tensor):
    """This rank's shard of an FP8 layer's weight; FSDP2 all-gathers it in FP8 (see above)."""

    _data: torch.Tensor
    _layer: Any  # weakref to the Fp8Linear

    @staticmethod
    def __new__(cls, data: torch.Tensor, layer: Any) -> Fp8ShardWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, device=data.device, layout=data.layout,
            requires_grad=data.requires_grad,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor, layer: Any) -> None:
        self._data = data
        self._layer = layer

    def __repr__(self) -> str:
        return f"Fp8ShardWeight({self._data!r})"

    def plain(self) -> torch.Tensor:
        """The shard as a plain tensor (the same storage: in-place changes reach it)."""
        return self._data

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        layer = None
        inner_of: dict[int, Fp8ShardWeight] = {}

        def unwrap(t: Any) -> Any:
            nonlocal layer
            if isinstance(t, Fp8ShardWeight):
                layer = t._layer
                inner_of[id(t._data)] = t
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        keep = func in _SHARD_OPS

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in inner_of:  # an in-place op returned its (unwrapped) self
                return inner_of[id(t)]
            return Fp8ShardWeight(t, layer) if keep else t

        return tree_map(wrap, out)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data"], self._layer

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], layer: Any, size: Any,
                             stride: Any) -> Fp8ShardWeight:  # fmt: skip
        return Fp8ShardWeight(inner["_data"], layer)

    # ------------------------------------------------------------------ FSDP2 extension

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: Any = None,
        outer_stride: Any = None,
        module: Any = None,
        mp_policy: Any = None,
    ) -> tuple[Any, Any]:
        """(the FP8 shard, as bytes), (scale, amax): quantised with the whole weight's scale."""
        layer: Fp8Linear | None = self._layer()
        if layer is None:
            raise RuntimeError("the FP8 layer that owns this weight shard no longer exists")
        recipe = layer.fp8_recipe
        gather_dtype = getattr(mp_policy, "param_dtype", None) or self._data.dtype
        with torch.no_grad():
            shard = self._data.to(gather_dtype)
            if recipe.true_delayed and layer.fp8_ready:
                # The scale every rank agreed on (histories are all-reduced each step); the
                # amax for the history is this shard's, agreed in the next update.
                scale = layer.fp8_next[1].clone()
                q = quantize(shard, scale, E4M3, _E4M3_MAX)
                found = fp8_amax(q)
                local = torch.where(found >= _E4M3_MAX, 2.0 * _E4M3_MAX, found) / scale
                return (q.view(torch.uint8),), (scale, local)
            whole = amax(shard).reshape(1)
            group = mesh.get_group() if mesh is not None else None
            torch.distributed.all_reduce(whole, op=torch.distributed.ReduceOp.MAX, group=group)
            whole = whole.reshape(())
            scale = scale_from_amax(whole, _E4M3_MAX, recipe.power_of_two)
            if recipe.delayed and not recipe.true_delayed:  # capped by the current amax
                scale = torch.minimum(layer.fp8_scale[1], scale)
            q = quantize(shard, scale, E4M3, _E4M3_MAX)
        return (q.view(torch.uint8),), (scale, whole)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *,
                             out: torch.Tensor | None = None) -> Any:  # fmt: skip
        """The gathered FP8 weight with its scale (in place into `out` after the first time:
        the bytes already sit in its storage, which FSDP2 refills)."""
        (data,) = outputs
        scale, whole = metadata
        inv = inverse(scale)
        zero = torch.zeros_like(scale)
        stats = torch.stack([zero, whole, zero, scale])  # the layout of fp8_linear's stats
        if out is not None:
            assert isinstance(out, Fp8GatheredWeight)
            out._inv, out._stats = inv, stats
            return None
        gathered = Fp8GatheredWeight(data.view(E4M3), inv, stats, param_dtype)
        return gathered, (data,)


class Fp8GatheredWeight(torch.Tensor):
    """An all-gathered FP8 weight with its scale, standing in for the parameter (its dtype)."""

    _data: torch.Tensor
    _inv: torch.Tensor
    _stats: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, inv: torch.Tensor, stats: torch.Tensor,
                dtype: torch.dtype) -> Fp8GatheredWeight:  # fmt: skip
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=dtype, device=data.device,
        )  # fmt: skip

    def __init__(self, data: torch.Tensor, inv: torch.Tensor, stats: torch.Tensor,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self._data, self._inv, self._stats = data, inv, stats

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, fp8)"

    def fp8_gathered(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(FP8 weight, inverse scale, stats) for ``mixprec::fp8_linear``'s ``wq`` arguments."""
        return self._data, self._inv, self._stats

    def dequantized(self) -> torch.Tensor:
        """The values it stands for, in its dtype."""
        return (self._data.float() * self._inv).to(self.dtype)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.mixprec.fp8_linear.default:
            # Fp8Linear passes the quantised weight as `wq`; the op does not read `w` then,
            # and the weight's gradient (autograd's business, above this) has its shape.
            return func(*tree_map(_fp8_data, args), **tree_map(_fp8_data, kwargs))
        if func in _GATHERED_VIEWS:
            owner = next(a for a in args if isinstance(a, Fp8GatheredWeight))
            data = func(owner._data, *args[1:], **kwargs)
            return Fp8GatheredWeight(data, owner._inv, owner._stats, owner.dtype)

        def plain(t: Any) -> Any:
            return t.dequantized() if isinstance(t, Fp8GatheredWeight) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _fp8_data(t: Any) -> Any:
    return t._data if isinstance(t, Fp8GatheredWeight) else t


def plain_local(t: torch.Tensor) -> torch.Tensor:
    """`t`'s local tensor (a DTensor's shard), as a plain tensor: an `Fp8ShardWeight`'s data."""
    local = local_tensor(t)
    return local.plain() if isinstance(local, Fp8ShardWeight) else local


def plain_dtensor(t: torch.Tensor) -> torch.Tensor:
    """`t` with an `Fp8ShardWeight` local tensor replaced by its plain data (same storage and
    placement), for code that reads storages (checkpoints); any other tensor as it is."""
    local = getattr(t, "_local_tensor", None)
    if not isinstance(local, Fp8ShardWeight):
        return t
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.plain(), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())  # fmt: skip


def gathers_in_fp8(layer: nn.Module) -> bool:
    """Whether `layer`'s weight shard is all-gathered in FP8 (an `Fp8ShardWeight`)."""
    weight = getattr(layer, "weight", None)
    local = getattr(weight, "_local_tensor", weight)
    return isinstance(local, Fp8ShardWeight)


def shard_weights_in_fp8(model: nn.Module) -> dict[str, str]:
    """Make the weights of `model`'s FP8 layers all-gather in FP8 once FSDP2 shards them.

    Call before ``fully_shard`` (`mixprec.fully_shard` does). Returns the layers left to
    FSDP2's usual gather, with the reason (also added to the layer's ``fp8_reason``, which
    ``explain`` prints).
    """
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[id(p)] = owners.get(id(p), 0) + 1
    skipped = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, Fp8Linear):
            continue
        if layer.fp8_recipe.rowwise:
            skipped[name] = ("rowwise scaling re-quantises the weight along the other axis in "
                             "backward: gathered in the unit's dtype")  # fmt: skip
            continue
        if owners.get(id(layer.weight), 0) > 1:
            skipped[name] = "its weight is shared with another module: gathered as it is"
            continue
        w = layer.weight
        layer.weight = nn.Parameter(Fp8ShardWeight(w.detach(), weakref.ref(layer)),
                                    requires_grad=w.requires_grad)  # fmt: skip
        layer.fp8_reason += "; under FSDP2 its weight is all-gathered in FP8"
    for name, why in skipped.items():
        layer = model.get_submodule(name)
        layer.fp8_reason += f"; under FSDP2 its weight is not all-gathered in FP8: {why}"
    return skipped
