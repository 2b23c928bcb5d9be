"""FP8 scaling that does what its recipe says, and plans and reports that match what runs.

- True delayed scaling (``overflow='saturate'``) casts with the delayed scale as it is: no
  amax reduction over the input or the weight precedes the cast (counted with the profiler);
  the history amax is read from the FP8 bytes, and an operand that outgrows its scale is
  clipped and recorded at twice the threshold until it fits.
- Outliers: one outlier batch raises a delayed history by at most ``max_growth`` (4x), so the
  next calm batches keep their precision; without the bound (Transformer Engine's window max)
  the probe from issue 27 loses most of it.
- The weight's cast is cached across the micro-batches of one optimizer step (quantised once,
  the same bits), and redone when the weight or the delayed scale changes.
- A recipe that converts no layer says why for each candidate; ``nn.MultiheadAttention``'s
  output projection (whose weight MHA uses directly) is never planned as FP8; ``explain``
  shows FP8 rows as running in e4m3 and layers converted but not called.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

import mixprec
from mixprec.fp8 import fp8_layers, gemm
from mixprec.fp8.convert import NoFp8LayerError
from mixprec.fp8.linear import Fp8Linear

DELAYED = mixprec.Fp8Recipe.named("delayed")
TRUE_DELAYED = DELAYED.replace(overflow="saturate")
REDUCTIONS = ("aten::aminmax", "aten::linalg_vector_norm")


@pytest.fixture(autouse=True)
def _emulated():
    gemm.set_gemm_path("emulate")  # no measurement noise in op counts
    yield
    gemm.set_gemm_path(None)


def _amax_passes(layer: nn.Module, x: torch.Tensor) -> dict[tuple, int]:
    """How many amax reductions the forward runs, by the shape reduced."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x)
    counts: dict[tuple, int] = {}
    for event in prof.events():
        if event.name in REDUCTIONS:
            shape = tuple(event.input_shapes[0])
            counts[shape] = counts.get(shape, 0) + 1
    return counts


def test_true_delayed_scaling_casts_without_an_amax_pass_first():
    torch.manual_seed(0)
    x = torch.randn(24, 32)
    rescale = Fp8Linear(32, 48, bias=False, recipe=DELAYED)
    assert _amax_passes(rescale, x) == {(24, 32): 1, (48, 32): 1}  # input and weight
    layer = Fp8Linear(32, 48, bias=False, recipe=TRUE_DELAYED)
    assert _amax_passes(layer, x) == {(24, 32): 1, (48, 32): 1}  # no history yet: dynamic
    mixprec.fp8_update([layer])
    # The scales the next cast takes: the delayed ones (the gradient, unseen: 1 for now).
    assert layer.fp8_ready and torch.equal(layer.fp8_next[:2], layer.fp8_scale[:2])
    x = x * 0.6  # an input inside the delayed scale's range (nothing reaches e4m3's max)
    assert _amax_passes(layer, x) == {}  # the delayed scales, as they are
    # The amax the history gets was read from the FP8 bytes: the input's largest magnitude
    # after rounding to e4m3 (3 mantissa bits: within 2**-4 of the true one).
    got, true = layer.fp8_fwd[0].item(), x.abs().max().item()
    assert abs(got - true) <= 2**-4 * true
    ref = torch.mm(x, layer.weight.detach().t())
    out = layer(x)
    assert (out - ref).norm() / ref.norm() < 0.06


def test_true_delayed_scaling_clips_an_outgrowing_operand_until_it_fits():
    torch.manual_seed(1)
    layer = Fp8Linear(32, 32, bias=False, recipe=TRUE_DELAYED)
    x = torch.randn(16, 32)
    layer(x)
    mixprec.fp8_update([layer])  # the history holds amax(x)
    recorded, used = [], []
    for _ in range(5):
        layer(x * 8)  # 8x the history's amax
        used.append(layer.fp8_fwd[2].item())
        recorded.append(layer.fp8_fwd[0].item())
        mixprec.fp8_update([layer])
    base = x.abs().max().item()
    # Clipped (saturated) while the scale is too large: twice the threshold is recorded, so
    # the scale halves each step. 8x is absorbed in 3 steps; there the largest value lands on
    # e4m3's max, which cannot be told from clipping, so once more twice is recorded and the
    # operand settles one power of two below the top (then its true amax is recorded).
    assert [r / base for r in recorded] == pytest.approx([2, 4, 8, 16, 8], rel=2**-4)
    assert [used[0] / u for u in used] == pytest.approx([1, 2, 4, 8, 16], rel=2**-4)


def _calm(step: int) -> torch.Tensor:
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("growth", [4.0, float("inf")], ids=["bounded", "te-window-max"])
def test_one_outlier_batch_costs_the_next_batches_little_precision(growth):
    torch.manual_seed(2)
    layer = Fp8Linear(64, 64, bias=False, recipe=DELAYED.replace(max_growth=growth))
    layer.measure_error = True
    errors = []
    for step in range(10):
        x = _calm(step) * (1e6 if step == 4 else 1.0)  # one outlier batch
        layer(x)
        errors.append(layer.fp8_error.item())
        mixprec.fp8_update([layer])
    after = errors[5:]
    history = layer.fp8_history[0]  # the input's, newest first: the outlier is entry 5
    if growth == 4.0:
        assert max(after) < 0.1  # e4m3's usual few percent
        assert history[5] == 4 * history[6:10].max()  # entered at 4x the window's largest
    else:  # the outlier's amax sets the scale for the whole window: most values underflow
        assert history[5] > 1e6 and min(after) > 0.5


def test_a_real_level_shift_is_adopted_without_clipping():
    layer = Fp8Linear(64, 64, bias=False, recipe=DELAYED)
    layer.measure_error = True
    errors = []
    for step in range(12):
        layer(_calm(step) * (1e4 if step >= 4 else 1.0))
        errors.append(layer.fp8_error.item())
        mixprec.fp8_update([layer])
    assert max(errors) < 0.1  # capped by the current amax: nothing clips meanwhile
    assert layer.fp8_history[0, 0] > 1e4  # the history reached the new level (4x per step)


def test_the_weight_is_cast_once_per_optimizer_step():
    torch.manual_seed(3)
    layer = Fp8Linear(32, 48, recipe="tensorwise")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    xs = [torch.randn(8, 32) for _ in range(3)]
    passes = [_amax_passes(layer, x).get((48, 32), 0) for x in xs]
    assert passes == [1, 0, 0]  # micro-batches 2 and 3 reuse the first cast
    outs = [layer(x) for x in xs]
    layer._weight_cache = None  # the same forwards, each quantising the weight itself
    for x, out in zip(xs, outs, strict=True):
        layer._weight_cache = None
        assert torch.equal(layer(x), out)
    sum(o.sum() for o in outs).backward()
    opt.step()  # the weight changes in place: its cast is redone
    assert _amax_passes(layer, xs[0]).get((48, 32), 0) == 1
    mixprec.fp8_update([layer])  # a new step: the cache goes with the pending amaxes
    assert layer._weight_cache is None
    assert _amax_passes(layer, xs[0]).get((48, 32), 0) == 1


def test_a_recipe_that_converts_nothing_says_why_and_changes_nothing():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(NoFp8LayerError) as err:
        mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                           fp8="delayed")  # fmt: skip
    text = str(err.value)
    assert text.startswith("FP8 (recipe 'delayed') converts no layer of Sequential: the FP8 "
                           "rules (fp8=auto) refused every linear layer:")  # fmt: skip
    assert "0 [8->16]: not fp8" in text and "in_features=8 not a multiple of 16" in text
    assert "2 [16->4]: not fp8" in text and "policy='fp8=all'" in text
    assert isinstance(err.value, mixprec.PolicyError)
    # Nothing was changed: the same model initializes without FP8.
    mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1")
    with pytest.raises(NoFp8LayerError, match="has no nn.Linear layer"):
        mixprec.to_fp8(nn.Sequential(nn.Conv1d(3, 16, 3)), "tensorwise")


def test_mha_output_projection_is_not_planned_as_fp8():
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    plan = {d.module: d for d in mixprec.Policy().fp8("all").plan_fp8(layer)}
    assert not plan["self_attn.out_proj"].fp8
    assert "passes this projection's weight straight to" in plan["self_attn.out_proj"].reason
    assert plan["linear1"].fp8 and plan["linear2"].fp8
    mixprec.to_fp8(layer, "tensorwise", policy="fp8=all")
    assert [n for n, _ in fp8_layers(layer)] == ["linear1", "linear2"]
    report = mixprec.explain(layer, torch.randn(2, 8, 64))
    assert report.fp8_not_called == [] and len(report.fp8) == 2
    assert all(row.gemm == "emulate (backward not run yet)" for row in report.fp8)


class _Bypass(nn.Module):
    """Uses its child's weight directly (as MHA does), and calls another child normally."""

    def __init__(self) -> None:
        super().__init__()
        self.direct, self.called = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.called(nn.functional.linear(x, self.direct.weight))


def test_explain_shows_fp8_formats_and_layers_that_did_not_run():
    model = _Bypass()
    mixprec.to_fp8(model, "rowwise", policy="fp8=all")
    report = mixprec.explain(model, torch.randn(4, 32))
    (row,) = [r for r in report.rows if r["op"] == "mixprec::fp8_linear"]
    assert row["ran_in"] == ["e4m3"] and row["outputs"] == ["bf16"]
    assert report.fp8_not_called == ["direct"]
    text = str(report)
    assert "direct: converted, but this forward did not call it" in text
    assert "e4m3/e4m3/e4m3" in text  # rowwise: e4m3 gradients too
    assert "gemm: each FP8 product runs torch._scaled_mm or mixprec's emulation" in text


def test_true_delayed_state_loads_ready_and_from_older_checkpoints():
    torch.manual_seed(4)
    layer = Fp8Linear(32, 32, recipe=TRUE_DELAYED)
    layer(torch.randn(4, 32, requires_grad=True)).sum().backward()
    mixprec.fp8_update([layer])
    state = layer.state_dict()
    assert "fp8_next" in state and "fp8_next" not in Fp8Linear(32, 32).state_dict()
    fresh = Fp8Linear(32, 32, recipe=TRUE_DELAYED)
    fresh.load_state_dict(state)
    assert fresh.fp8_ready and torch.equal(fresh.fp8_next, layer.fp8_next)
    x = torch.randn(4, 32)
    assert torch.equal(fresh(x), layer(x))  # the same casts: resumed exactly
    del state["fp8_next"]  # saved before fp8_next existed: the delayed scales are the next ones
    older = Fp8Linear(32, 32, recipe=TRUE_DELAYED)
    older.load_state_dict(state)
    assert older.fp8_ready and torch.equal(older.fp8_next, layer.fp8_scale)
