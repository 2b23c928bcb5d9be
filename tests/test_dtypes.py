"""Dtype and device-type parsing, per-device defaults and their reasons, and error messages."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import mixprec
from mixprec.dtypes import (
    dtype_name,
    parse_device_type,
    parse_dtype,
    resolve_dtype,
)


@pytest.mark.parametrize(
    "name,dtype",
    [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
     ("fp16", torch.float16), ("half", torch.float16), ("Float16", torch.float16),
     ("fp32", torch.float32), (torch.float16, torch.float16)],
)  # fmt: skip
def test_parse_dtype_names(name, dtype):
    assert parse_dtype(name) is dtype


def test_dtype_name_is_short_form():
    assert dtype_name(torch.bfloat16) == "bf16"
    assert dtype_name(torch.float16) == "fp16"
    assert dtype_name(torch.float32) == "fp32"


def test_unknown_dtype_lists_options():
    with pytest.raises(mixprec.PolicyError, match="unknown dtype 'fp12'.*Valid dtypes:.*'bf16'"):
        parse_dtype("fp12")  # (fp8 names point to the FP8 rule: tests/test_policy.py)


def test_non_16_bit_compute_dtype_says_how_to_run_fp32():
    with pytest.raises(mixprec.PolicyError, match=r"autocast\(\.\.\., enabled=False\)"):
        parse_dtype("fp32", low_only=True)
    with pytest.raises(mixprec.PolicyError, match="'bf16' or 'fp16'"):
        parse_dtype(torch.float64, low_only=True)


def test_dtype_of_wrong_type():
    with pytest.raises(mixprec.PolicyError, match="torch.dtype or a name"):
        parse_dtype(16)  # type: ignore[arg-type]


def test_device_types():
    assert parse_device_type("cuda:1") == "cuda"
    assert parse_device_type(torch.device("cpu")) == "cpu"
    with pytest.raises(mixprec.PolicyError, match="unknown device type 'gpu'.*'cuda'"):
        parse_device_type("gpu")


def test_defaults_carry_reasons():
    cuda, cpu = mixprec.default_dtype("cuda"), mixprec.default_dtype("cpu")
    assert cuda.dtype is torch.float16 and "tensor cores" in cuda.reason
    assert cpu.dtype is torch.bfloat16 and "100x slower" in cpu.reason


def test_resolve_order_argument_policy_default():
    assert resolve_dtype("cpu", "fp16", torch.bfloat16).reason == "requested by the dtype argument"
    assert resolve_dtype("cpu", None, torch.float16) == (torch.float16, "set by the policy")
    assert resolve_dtype("cpu", None).dtype is torch.bfloat16


def test_bf16_on_a_gpu_without_bf16_names_the_fix():
    with (
        mock.patch.object(torch.cuda, "is_available", lambda: True),
        mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: False),
        mock.patch.object(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100"),
        pytest.raises(mixprec.AutocastError, match="Tesla V100 has no bf16.*dtype='fp16'"),
    ):
        mixprec.autocast("cuda", dtype="bf16")
