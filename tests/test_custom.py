"""User code under autocast: custom_fwd/custom_bwd against torch.amp's, the half_function family,
custom ops from torch.library, and banned ops."""

from __future__ import annotations

import pytest
import torch

import mixprec
from mixprec import Policy
from tests.helpers import scaled_dot

BF16, FP32 = torch.bfloat16, torch.float32


def _function_class(fwd_deco, bwd_deco):
    class MyMM(torch.autograd.Function):
        @staticmethod
        @fwd_deco
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            ctx.fwd_dtype = torch.mm(a, b).dtype
            return a.mm(b)

        @staticmethod
        @bwd_deco
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            ctx.bwd_dtype = torch.mm(grad, b.t()).dtype
            return grad.mm(b.t()), a.t().mm(grad)

    return MyMM


@pytest.mark.parametrize("cast_inputs", [None, torch.float32], ids=["no-cast", "cast-fp32"])
def test_custom_fwd_bwd_match_torch(cast_inputs):
    results = []
    for amp, region in (
        (torch.amp, lambda: torch.autocast("cpu")),
        (mixprec, lambda: mixprec.autocast("cpu")),
    ):
        fn = _function_class(
            amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs),
            amp.custom_bwd(device_type="cpu"),
        )
        torch.manual_seed(0)
        a = torch.randn(4, 4, requires_grad=True)
        b = torch.randn(4, 4, requires_grad=True)
        with region():
            out = fn.apply(a, b)
        out.float().sum().backward()
        ctx = out.grad_fn
        results.append((out.dtype, ctx.fwd_dtype, ctx.bwd_dtype, out, a.grad, b.grad))
    (t_dt, t_fwd, t_bwd, t_out, t_ga, t_gb), (m_dt, m_fwd, m_bwd, m_out, m_ga, m_gb) = results
    assert (m_dt, m_fwd, m_bwd) == (t_dt, t_fwd, t_bwd)
    assert torch.equal(t_out, m_out) and torch.equal(t_ga, m_ga) and torch.equal(t_gb, m_gb)
    if cast_inputs is None:
        assert m_dt == BF16 and m_bwd == BF16  # backward re-entered the forward's region
    else:
        assert m_dt == FP32 and m_bwd == FP32  # forward ran with autocast off, and backward


def test_custom_bwd_reenters_the_forward_policy():
    policy = Policy().move("mm", to="fp32")
    fn = _function_class(
        mixprec.custom_fwd(device_type="cpu"), mixprec.custom_bwd(device_type="cpu")
    )
    a = torch.randn(3, 3, requires_grad=True)
    with mixprec.autocast("cpu", policy=policy):
        out = fn.apply(a, torch.randn(3, 3))
    out.sum().backward()
    assert out.grad_fn.bwd_dtype == FP32  # the policy travelled to backward


def test_custom_fwd_outside_region_is_plain():
    fn = _function_class(
        mixprec.custom_fwd(device_type="cpu", cast_inputs=torch.bfloat16),
        mixprec.custom_bwd(device_type="cpu"),
    )
    out = fn.apply(torch.randn(2, 2, requires_grad=True), torch.randn(2, 2))
    assert out.dtype == FP32


def test_custom_bwd_without_custom_fwd_says_so():
    fn = _function_class(lambda f: f, mixprec.custom_bwd(device_type="cpu"))
    out = fn.apply(torch.randn(2, 2, requires_grad=True), torch.randn(2, 2))
    with pytest.raises(RuntimeError, match="not decorated with mixprec.custom_fwd"):
        out.sum().backward()


def test_custom_fwd_bad_device_type():
    with pytest.raises(mixprec.PolicyError, match="unknown device type"):
        mixprec.custom_fwd(device_type="gpu")


# ------------------------------------------------------------------------ half_function family


def test_float_function_casts_inputs_and_runs_body_unautocast():
    seen = {}

    @mixprec.float_function
    def attention(q, k):
        seen["in"] = (q.dtype, k.dtype)
        seen["inner_mm"] = torch.mm(q, k.t()).dtype  # body runs with autocast off
        return torch.mm(q, k.t())

    q = torch.randn(2, 4, dtype=BF16)
    with mixprec.autocast("cpu"):
        out = attention(q, torch.randn(3, 4))
    assert seen == {"in": (FP32, FP32), "inner_mm": FP32} and out.dtype == FP32
    assert attention(q, q).dtype == BF16  # outside a region: the plain function
    assert attention.__name__ == "attention"


def test_half_and_promote_functions():
    @mixprec.half_function
    def half(a, b):
        return a * b

    @mixprec.promote_function
    def promote(a, b):
        return torch.cat([a, b])

    with mixprec.autocast("cpu"):
        assert half(torch.randn(2), torch.randn(2)).dtype == BF16
        assert promote(torch.randn(2, dtype=BF16), torch.randn(2, dtype=BF16)).dtype == BF16
        assert promote(torch.randn(2, dtype=BF16), torch.randn(2)).dtype == FP32


def test_policy_overrides_a_decorated_default():
    q = torch.randn(2, 4)
    with mixprec.autocast("cpu"):
        assert scaled_dot(q, q).dtype == FP32
    with mixprec.autocast("cpu", policy=Policy().move(scaled_dot, to="lower")):
        assert scaled_dot(q, q).dtype == BF16
    reason = Policy().decide(scaled_dot, device_type="cpu").reason
    assert "registered as fp32 by its mixprec decorator" in reason


# ----------------------------------------------------------------------------------- custom ops


@pytest.fixture(scope="module")
def custom_op():
    lib = torch.library.Library("mixprectest", "DEF")
    lib.define("scale(Tensor x, Tensor y) -> Tensor")
    lib.impl("scale", lambda x, y: x * y, "CPU")
    yield torch.ops.mixprectest.scale
    del lib


def test_custom_ops_pass_through_by_default_and_move(custom_op):
    x, y = torch.randn(4), torch.randn(4)
    with mixprec.autocast("cpu"):
        assert custom_op(x, y).dtype == FP32
    for target in ("mixprectest::scale", custom_op):
        with mixprec.autocast("cpu", policy=Policy().move(target, to="lower")):
            assert custom_op(x, y).dtype == BF16
            assert custom_op.default(x, y).dtype == BF16
    assert str(Policy().move(custom_op, to="lower")) == "lower=mixprectest::scale"


# ---------------------------------------------------------------------------------- banned ops


def test_banned_op_raises_with_the_fix():
    policy = Policy().move("mm", to="banned")
    with mixprec.autocast("cpu", policy=policy), pytest.raises(mixprec.BannedOpError) as err:
        torch.mm(torch.randn(2, 2), torch.randn(2, 2))
    assert "policy.move('mm', to='fp32')" in str(err.value)
    with mixprec.autocast("cpu", policy=policy):
        torch.mm(torch.randn(2, 2, device="meta"), torch.randn(2, 2, device="meta"))  # other dev


def test_binary_cross_entropy_is_allowed_on_cpu():
    with mixprec.autocast("cpu"):
        out = torch.nn.functional.binary_cross_entropy(torch.rand(3), torch.rand(3))
    assert out.dtype == FP32


@pytest.mark.parametrize(
    "decorate, name",
    [
        (mixprec.half_function, "half_function"),
        (mixprec.float_function, "float_function"),
        (lambda f: mixprec.custom_fwd(f, device_type="cpu"), "custom_fwd"),
        (lambda f: mixprec.custom_bwd(f, device_type="cpu"), "custom_bwd"),
    ],
)
def test_decorators_refuse_non_callables(decorate, name):
    with pytest.raises(TypeError) as err:
        decorate(42)
    assert str(err.value) == (
        f"mixprec.{name} decorates a function, got int 42. Use it as @mixprec.{name} "
        f"(or @mixprec.{name}(...)) on a def."
    )
