"""Model code that talks to torch's autocast API keeps its meaning inside mixprec regions.

Model libraries protect numerically sensitive code through torch's API: they ask
``torch.is_autocast_enabled(device)`` and ``torch.get_autocast_dtype(device)``, open
``torch.autocast(device, enabled=False)`` around fp32 islands, and decorate autograd Functions
with ``torch.amp.custom_fwd``/``custom_bwd``. Every test here runs the same code under
``torch.autocast`` (the reference) and under ``mixprec.autocast`` and compares; and checks that
an edited policy is still mixprec's decision, never overridden by torch's dispatcher.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

import mixprec
from tests.helpers import CastCounter

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _mm(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def _both(**kw):
    """The reference region and mixprec's, with the same arguments."""
    return [("torch", lambda: torch.autocast("cpu", **kw)),
            ("mixprec", lambda: mixprec.autocast("cpu", **kw))]  # fmt: skip


# ------------------------------------------------------------------ what model code reads


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_torch_sees_the_region_state(dtype):
    seen = {}
    for name, region in _both(dtype=dtype, cache_enabled=False):
        with region():
            seen[name] = (
                torch.is_autocast_enabled("cpu"),
                torch.is_autocast_enabled(),  # no argument: CUDA's flag, off in a CPU region
                torch.get_autocast_dtype("cpu"),
                torch.is_autocast_cache_enabled(),
            )
        assert not torch.is_autocast_enabled("cpu") and torch.is_autocast_cache_enabled()
    assert seen["mixprec"] == seen["torch"] == (True, False, dtype, False)


def test_state_is_restored_after_nesting_and_errors():
    before = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    with pytest.raises(ZeroDivisionError), mixprec.autocast("cpu", dtype=FP16):
        with mixprec.autocast("cpu", enabled=False):
            assert not torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == FP16
        raise ZeroDivisionError
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before
    assert mixprec.eager.mode.find_mode() is None


def test_disabled_mixprec_region_switches_torch_off_too():
    a, b = _mm(4, 4)
    with torch.autocast("cpu"), mixprec.autocast("cpu", enabled=False):
        assert not torch.is_autocast_enabled("cpu")
        assert torch.mm(a, b).dtype == FP32
    with torch.autocast("cpu"):
        assert torch.mm(a, b).dtype == BF16


# ---------------------------------------------------- nested torch.autocast inside mixprec


def test_nested_torch_disable_runs_fp32_like_torch():
    a, b = _mm(8, 8)
    out = {}
    for name, region in _both():
        with region():
            with torch.autocast("cpu", enabled=False):
                inner = torch.mm(a, b)
                flag = torch.is_autocast_enabled("cpu")
            after = torch.mm(a, b)
        out[name] = (inner.dtype, flag, after.dtype, inner)
    assert out["mixprec"][:3] == out["torch"][:3] == (FP32, False, BF16)
    assert torch.equal(out["mixprec"][3], out["torch"][3])
    assert not mixprec.is_autocast_enabled("cpu")


def test_nested_torch_disable_also_hides_the_mixprec_region():
    with mixprec.autocast("cpu"), torch.autocast("cpu", enabled=False):
        assert not mixprec.is_autocast_enabled("cpu")
        assert mixprec.get_autocast_policy("cpu") is None
    with mixprec.autocast("cpu"):
        assert mixprec.is_autocast_enabled("cpu")


def test_nested_torch_dtype_change_keeps_the_policy():
    # The edited policy (layer_norm in fp32, which torch's CPU list leaves alone) stays in force
    # when model code switches the dtype with a nested torch.autocast, as torch's own nested
    # regions keep everything but the dtype.
    policy = mixprec.Policy().move("layer_norm", to="fp32")
    a, b = _mm(8, 8)
    with mixprec.autocast("cpu", policy=policy), torch.autocast("cpu", dtype=FP16):
        assert mixprec.get_autocast_dtype("cpu") == FP16
        assert torch.mm(a, b).dtype == FP16
        assert F.layer_norm(a.half(), (8,)).dtype == FP32
    with torch.autocast("cpu", dtype=FP16):
        assert F.layer_norm(a.half(), (8,)).dtype == FP16  # torch's list: not listed


def test_nested_torch_cache_flag_is_followed():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 8)
    counts = {}
    for cache in (True, False):
        counter = CastCounter()
        with counter, mixprec.autocast("cpu"), torch.autocast("cpu", cache_enabled=cache):
            for _ in range(3):
                lin(x)
        counts[cache] = counter.casts[(FP32, BF16)]
    assert counts == {True: 2 + 3, False: 3 * 3}  # weights cast once when cached


def test_nested_mixprec_region_inherits_cache_flag():
    lin = torch.nn.Linear(8, 8)
    counter = CastCounter()
    with mixprec.autocast("cpu", cache_enabled=False), mixprec.autocast("cpu", dtype=BF16):
        assert not torch.is_autocast_cache_enabled()
        with counter:
            lin(torch.randn(2, 8))
            lin(torch.randn(2, 8))
    assert counter.casts[(FP32, BF16)] == 2 * 3


@pytest.mark.filterwarnings("ignore:.*is deprecated:DeprecationWarning")
def test_torch_helpers_deprecated_spellings_follow_too():
    # timm's fast_norm falls back to these on older torch.
    with mixprec.autocast("cpu", dtype=FP16):
        assert torch.is_autocast_cpu_enabled() and torch.get_autocast_cpu_dtype() == FP16


# ------------------------------------------------------------- torch.amp.custom_fwd / bwd


class _CastToFp32(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.inner = (torch.is_autocast_enabled("cpu"), torch.mm(a, b).dtype)
        return torch.mm(a, b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return torch.mm(grad, b.t()), torch.mm(a.t(), grad)


class _FollowRegion(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return torch.mm(a, b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        ctx.bwd_dtype = torch.mm(grad, b.t()).dtype
        return torch.mm(grad, b.t()), torch.mm(a.t(), grad)


@pytest.mark.parametrize("fn", [_CastToFp32, _FollowRegion], ids=["cast_inputs", "follow"])
def test_torch_custom_fwd_bwd_like_torch(fn):
    results = {}
    for name, region in _both():
        a, b = (t.requires_grad_() for t in _mm(6, 6))
        with region():
            out = fn.apply(a.bfloat16() if fn is _CastToFp32 else a, b)
        out.float().sum().backward()
        results[name] = (out, a.grad, b.grad)
    (ot, at, bt), (om, am, bm) = results["torch"], results["mixprec"]
    assert om.dtype == ot.dtype == (FP32 if fn is _CastToFp32 else BF16)
    assert torch.equal(om, ot) and torch.equal(am, at) and torch.equal(bm, bt)


def test_torch_custom_fwd_cast_inputs_runs_forward_with_autocast_off():
    a, _ = _mm(4, 4)
    seen = {}

    class Keep(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
        def forward(ctx, x):
            seen["enabled"] = torch.is_autocast_enabled("cpu")
            seen["mm"] = torch.mm(x, x).dtype
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    with mixprec.autocast("cpu"):
        Keep.apply(a.bfloat16())
    assert seen == {"enabled": False, "mm": FP32}


# -------------------------------------------------- the policy stays mixprec's decision


@pytest.mark.parametrize("op", ["mm", "linear", "bmm", "baddbmm", "addmm", "conv2d", "matmul"])
@pytest.mark.parametrize("to", ["passthrough", "fp32"])
def test_edited_policy_is_not_overridden_by_torch_dispatcher(op, to):
    # torch's CPU list lowers these; with torch's autocast state on in the region, its dispatcher
    # would cast them again below the mode unless mixprec keeps it out.
    policy = mixprec.Policy().move(op, to=to)
    g = torch.Generator().manual_seed(0)
    args = {
        "mm": lambda: (torch.mm, torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g)),
        "matmul": lambda: (torch.matmul, torch.randn(4, 4, generator=g), torch.randn(4, 4)),
        "linear": lambda: (F.linear, torch.randn(2, 4, generator=g), torch.randn(3, 4)),
        "bmm": lambda: (torch.bmm, torch.randn(2, 3, 4, generator=g), torch.randn(2, 4, 3)),
        "baddbmm": lambda: (
            torch.baddbmm,
            torch.randn(2, 3, 3),
            torch.randn(2, 3, 4),
            torch.randn(2, 4, 3),
        ),
        "addmm": lambda: (torch.addmm, torch.randn(3, 3), torch.randn(3, 4), torch.randn(4, 3)),
        "conv2d": lambda: (F.conv2d, torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)),
    }[op]()
    fn, *tensors = args
    with mixprec.autocast("cpu", policy=policy):
        assert torch.is_autocast_enabled("cpu")
        out = fn(*tensors)
    assert out.dtype == FP32
    assert torch.equal(out, fn(*tensors))


def test_composites_follow_an_edited_inner_op():
    # tensordot's C++ body calls mm: moving mm moves tensordot, and torch's dispatcher must not
    # lower the inner mm behind the policy's back.
    a, b = _mm(4, 4)
    with mixprec.autocast("cpu", policy=mixprec.Policy().move("mm", to="passthrough")):
        assert torch.tensordot(a, b, dims=1).dtype == FP32
        assert torch.einsum("ij,jk->ik", a, b).dtype == BF16  # einsum's inner op is bmm
    with mixprec.autocast("cpu", policy=mixprec.Policy().move("bmm", to="passthrough")):
        assert torch.einsum("ij,jk->ik", a, b).dtype == FP32


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: F.max_pool3d(x, 2),
        lambda x: torch.trace(x[0, 0, 0]),
        lambda x: F.pad(x[0, 0], (1, 1), mode="reflect"),
    ],
    ids=["max_pool3d", "trace", "reflection_pad"],
)
def test_other_base_table_is_not_overridden(fn):
    # The CUDA table leaves these alone; torch's CPU list (its dispatcher) runs them in fp32.
    x = torch.randn(1, 1, 4, 4, 4, dtype=BF16)
    try:
        fn(x)
    except NotImplementedError as e:  # torch 2.11 has no bf16 trace on the CPU
        pytest.skip(f"this torch cannot run it in bf16: {e}")
    with mixprec.autocast("cpu", policy=mixprec.Policy(table="cuda")):
        assert fn(x).dtype == BF16
    with mixprec.autocast("cpu"):
        assert fn(x).dtype == FP32
    with torch.autocast("cpu"):
        assert fn(x).dtype == FP32


def test_user_function_body_runs_with_all_autocast_off():
    seen = {}

    @mixprec.float_function
    def island(x, w):
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        return x @ w

    a, b = _mm(4, 4)
    with mixprec.autocast("cpu"):
        out = island(a.bfloat16(), b)
    assert out.dtype == FP32 and seen == {"enabled": False}
    assert torch.equal(out, a.bfloat16().float() @ b)


def test_known_deviations_keep_their_documented_dtype():
    # GRUCell on CPU: documented as computed in its input dtype (docs/policy.md); torch's
    # dispatcher would otherwise mix precisions inside it.
    cell = torch.nn.GRUCell(4, 4)
    x, h = torch.randn(2, 4), torch.randn(2, 4)
    with mixprec.autocast("cpu"):
        out = cell(x, h)
    assert out.dtype == FP32 and torch.equal(out, cell(x, h))


# ------------------------------------------------------------ activation checkpointing


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)
    )


def _checkpointed(block, region, **kw):
    block.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with region:
        y = checkpoint.checkpoint(block, x, **kw)
    y.float().sum().backward()
    return y, x.grad, [p.grad for p in block.parameters()]


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_equals_torch_autocast(reentrant):
    block = _block()
    ref = _checkpointed(block, torch.autocast("cpu"), use_reentrant=reentrant)
    got = _checkpointed(block, mixprec.autocast("cpu"), use_reentrant=reentrant)
    assert got[0].dtype == BF16
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2], strict=True))


def test_checkpoint_with_an_edited_policy_needs_the_context_fn():
    block = _block()
    policy = mixprec.Policy().move("layer_norm", to="fp32")
    with pytest.raises(checkpoint.CheckpointError):  # recomputed under torch's lists
        _checkpointed(block, mixprec.autocast("cpu", policy=policy), use_reentrant=False)
    got = _checkpointed(
        block,
        mixprec.autocast("cpu", policy=policy),
        use_reentrant=False,
        context_fn=mixprec.checkpoint_context,
    )
    block.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        y = block(x)
    y.float().sum().backward()
    assert got[0].dtype == FP32
    assert torch.equal(got[0], y) and torch.equal(got[1], x.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(got[2], block.parameters(), strict=True))


def test_checkpoint_context_outside_a_region_is_a_no_op():
    block = _block()
    a = _checkpointed(block, contextlib.nullcontext(), use_reentrant=False,
                      context_fn=mixprec.checkpoint_context)  # fmt: skip
    b = _checkpointed(block, contextlib.nullcontext(), use_reentrant=False)
    assert torch.equal(a[0], b[0]) and a[0].dtype == FP32
