"""The pure scale update: against torch's kernel, against a plain-Python model of the rule, and
its invariants (bounds, hysteresis, growth timing, never inf) as hypothesis properties."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mixprec import PolicyError, ScaleConfig, ScalerConfigError, update_scale
from mixprec.scaling import init_state
from mixprec.scaling.state import HISTORY, update_scale_, updates_in_place

f32 = np.float32
TINY = f32(np.finfo(np.float32).tiny)


def _run(config: ScaleConfig, init: float, flags: list[bool]):
    state = init_state(init, config, "cpu")
    out = []
    for f in flags:
        state = update_scale(state, torch.tensor(float(f)), config)
        out.append((state.scale.item(), int(state.growth_tracker), int(state.hysteresis_tracker)))
    return state, out


def _reference(config: ScaleConfig, init: float, flags: list[bool]):
    """The rule in plain Python with fp32 arithmetic (numpy), step by step."""
    scale, growth, hyst = f32(init), 0, config.hysteresis
    out = []
    for overflow in flags:
        if not config.dynamic:
            pass
        elif overflow:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = f32(scale * f32(config.backoff_factor))
                floor = TINY if config.min_scale is None else f32(config.min_scale)
                scale = max(scale, floor)
        else:
            growth += 1
            if config.consecutive_hysteresis:
                hyst = config.hysteresis
            if growth == config.growth_interval:
                growth = 0
                hyst = config.hysteresis
                with np.errstate(over="ignore"):
                    grown = f32(scale * f32(config.growth_factor))
                if config.max_scale is not None:
                    grown = min(grown, f32(config.max_scale))
                if math.isfinite(grown):
                    scale = grown
        out.append((float(scale), growth, hyst))
    return out


@settings(max_examples=60, deadline=None)
@given(
    # (fewer than ~150 consecutive overflows: below that torch and mixprec agree exactly)
    flags=st.lists(st.booleans(), min_size=1, max_size=60),
    interval=st.integers(1, 5),
    init=st.sampled_from([1.0, 2.0**16, 3.0e38]),
)
def test_matches_torch_amp_update_scale(flags, interval, init):
    config = ScaleConfig(growth_interval=interval)
    _, ours = _run(config, init, flags)
    scale = torch.tensor(init)
    tracker = torch.tensor(0, dtype=torch.int32)
    for f, (s, g, _) in zip(flags, ours, strict=True):
        torch._amp_update_scale_(scale, tracker, torch.tensor(float(f)), 2.0, 0.5, interval)
        assert (scale.item(), int(tracker)) == (s, g)


configs = st.builds(
    ScaleConfig,
    growth_factor=st.sampled_from([2.0, 1.5, 4.0]),
    backoff_factor=st.sampled_from([0.5, 0.25, 0.9]),
    growth_interval=st.integers(1, 6),
    hysteresis=st.integers(1, 4),
    consecutive_hysteresis=st.booleans(),
    min_scale=st.sampled_from([None, 1.0, 64.0]),
    max_scale=st.sampled_from([None, 2.0**20, 2.0**24]),
    dynamic=st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(config=configs, flags=st.lists(st.booleans(), max_size=80))
def test_matches_plain_python_model(config, flags):
    init = 2.0**16
    state, ours = _run(config, init, flags)
    assert ours == _reference(config, init, flags)
    # counters
    assert int(state.steps) == len(flags) and int(state.skipped) == sum(flags)
    assert int(state.last_skip) == (max(i for i, f in enumerate(flags) if f) if any(flags) else -1)


@settings(max_examples=120, deadline=None)
@given(
    config=configs,
    # counts, not only 0/1: found_inf counts the non-finite gradients
    found=st.lists(st.sampled_from([0.0, 0.0, 1.0, 3.0]), max_size=70),
    init=st.sampled_from([1.0, 2.0**16, 3.0e38, 1e-38]),
)
def test_in_place_update_is_the_pure_update_bit_for_bit(config, found, init):
    """The scaler's in-place update (fewer kernels per step) for the configurations it takes:
    every field of the state, after every step, equals the pure function's."""
    if not updates_in_place(config):
        config = dataclasses.replace(config, hysteresis=1, max_scale=None, dynamic=True)
    if not updates_in_place(config):  # a factor fp32 cannot hold (0.9)
        config = dataclasses.replace(config, backoff_factor=0.5)
    assert updates_in_place(config)
    pure = init_state(init, config, "cpu")
    mine = init_state(init, config, "cpu")
    ids = [id(t) for t in mine]
    for f in found:
        pure = update_scale(pure, torch.tensor(f), config)
        update_scale_(mine, torch.tensor(f), config)
        for name, a, b in zip(pure._fields, pure, mine, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), name
    assert [id(t) for t in mine] == ids  # in place: a captured graph keeps its addresses


def test_in_place_update_declines_what_it_does_not_implement():
    assert updates_in_place(ScaleConfig())
    assert not updates_in_place(ScaleConfig(hysteresis=2))
    assert not updates_in_place(ScaleConfig(max_scale=2.0**20))
    assert not updates_in_place(ScaleConfig(dynamic=False))
    assert not updates_in_place(ScaleConfig(backoff_factor=0.9))  # not exact in fp32
    assert updates_in_place(ScaleConfig(growth_factor=1.5, backoff_factor=0.25))


@settings(max_examples=100, deadline=None)
@given(
    config=configs,
    flags=st.one_of(
        st.lists(st.booleans(), max_size=120), st.just([True] * 400), st.just([False] * 400)
    ),
)
def test_invariants_bounds_never_inf_never_zero(config, flags):
    init = 2.0**16
    _, trace = _run(config, init, flags)
    for scale, growth, _ in trace:
        assert math.isfinite(scale) and scale > 0
        assert 0 <= growth < config.growth_interval
        if config.min_scale is not None:
            assert scale >= config.min_scale
        if config.max_scale is not None:
            assert scale <= max(config.max_scale, init)


@pytest.mark.parametrize("h", [1, 2, 3])
def test_hysteresis_backs_off_on_the_h_th_overflow(h):
    config = ScaleConfig(hysteresis=h, growth_interval=1000)
    _, trace = _run(config, 1024.0, [True] * (h + 1))
    scales = [s for s, _, _ in trace]
    assert scales[: h - 1] == [1024.0] * (h - 1)
    assert scales[h - 1] == 512.0 and scales[h] == 256.0  # then every overflow backs off


def test_growth_exactly_at_interval_and_never_to_inf():
    config = ScaleConfig(growth_interval=3)
    _, trace = _run(config, 8.0, [False] * 7)
    assert [s for s, _, _ in trace] == [8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]
    _, trace = _run(ScaleConfig(growth_interval=1), 3.0e38, [False] * 3)
    assert [s for s, _, _ in trace] == [pytest.approx(3.0e38, rel=1e-6)] * 3


def test_history_ring_buffer_records_used_scale_and_overflows():
    config = ScaleConfig(growth_interval=1000)
    state, _ = _run(config, 64.0, [False, True, False])
    hist = state.history.tolist()
    assert hist[:3] == [64.0, -64.0, 32.0] and all(math.isnan(v) for v in hist[3:])
    state, _ = _run(config, 64.0, [False] * (HISTORY + 2))
    assert int(state.steps) == HISTORY + 2  # wrapped around without growing


def test_update_is_pure():
    config = ScaleConfig()
    state = init_state(2.0, config, "cpu")
    before = [t.clone() for t in state]
    update_scale(state, torch.tensor(1.0), config)
    assert all(torch.equal(a, b, ) or (a.isnan().all() and b.isnan().all())
               for a, b in zip(before, state, strict=True))  # fmt: skip


@pytest.mark.parametrize(
    "kwargs,text",
    [
        ({"growth_factor": 1.0},
         "GradScaler growth_factor=1.0 is invalid: it must be a number > 1.0 (2.0 doubles the "
         "scale)."),
        ({"backoff_factor": 1.5},
         "GradScaler backoff_factor=1.5 is invalid: it must be a number in (0, 1) (0.5 halves "
         "the scale)."),
        ({"growth_interval": 0},
         "GradScaler growth_interval=0 is invalid: it must be an int >= 1."),
        ({"growth_interval": 2000.0},
         "GradScaler growth_interval=2000.0 is invalid: it must be an int >= 1."),
        ({"growth_interval": True},
         "GradScaler growth_interval=True is invalid: it must be an int >= 1."),
        ({"hysteresis": 0},
         "GradScaler hysteresis=0 is invalid: it must be an int >= 1 (1 backs off on every "
         "overflow, like torch)."),
        ({"consecutive_hysteresis": "yes"},
         "GradScaler consecutive_hysteresis='yes' is invalid: it must be True or False."),
        ({"dynamic": "False"}, "GradScaler dynamic='False' is invalid: it must be True or False."),
        ({"growth_factor": "2"},
         "GradScaler growth_factor='2' is invalid: it must be a number > 1.0 (2.0 doubles the "
         "scale)."),
        ({"min_scale": -1.0},
         "GradScaler min_scale=-1.0 is invalid: it must be None or a finite number > 0."),
        ({"max_scale": math.inf},
         "GradScaler max_scale=inf is invalid: it must be None or a finite number > 0."),
        ({"min_scale": 10.0, "max_scale": 1.0},
         "GradScaler min_scale=10.0 is above max_scale=1.0; the floor must not exceed the "
         "ceiling."),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(kwargs, text):
    with pytest.raises(ScalerConfigError) as err:
        ScaleConfig(**kwargs)
    assert str(err.value) == text
    assert isinstance(err.value, ValueError) and not isinstance(err.value, PolicyError)


def test_config_stores_numbers_as_floats():
    assert ScaleConfig(growth_factor=2, min_scale=1) == ScaleConfig(
        growth_factor=2.0, min_scale=1.0
    )
    assert isinstance(ScaleConfig(max_scale=1024).max_scale, float)
