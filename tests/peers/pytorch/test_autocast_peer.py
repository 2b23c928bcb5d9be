# Adapted from PyTorch, test/test_autocast.py as shipped with the torch 2.13 release line (torch
# 2.13.0, git cf30153c): the version with TestAutocastCPU, TestAutocastDeviceType and
# test_autocast_called_with_non_callable, from before the lists moved to get_autocast_test_lists
# (absent from torch 2.13's torch.testing._internal). Unchanged, it gives 19 passed, 6 skipped
# with torch.autocast on torch 2.13 on a CPU. `_run_autocast_outofplace` is copied from torch
# 2.13's torch/testing/_internal/autocast_test_lists.py (TestAutocast), under the same license.
#
# What changed (docs/migration.md, "Running PyTorch's autocast tests", gives the reasons):
# - every region under test is opened by ``mixprec.autocast`` where the original opens
#   ``torch.autocast``/``torch.amp.autocast`` (including the helper's two regions and the one in
#   CustomLinear.backward); torch's lists, inputs and reference computations are unchanged;
# - test_autocast_fast_dtype asks ``mixprec.get_autocast_dtype``;
# - test_invalid_device matches mixprec's message (the type, RuntimeError, is torch's) and
#   drops its second half, which tests ``torch.amp.is_autocast_available``;
# - test_non_string_device: mixprec accepts a ``torch.device`` (a documented extension) and
#   raises torch's ValueError for other non-strings;
# - skipped with the reason: test_cpu_autocast_deprecated_warning (``torch.cpu.amp``'s own
#   deprecation), test_cast_cache_is_global and test_cache_disabled (torch's cast cache); the
#   MPS-only class TestAutocastMPS is not adapted.
#
# PyTorch's license (BSD 3-Clause) follows.
#
# Copyright (c) 2016-     Facebook, Inc            (Adam Paszke)
# Copyright (c) 2014-     Facebook, Inc            (Soumith Chintala)
# Copyright (c) 2011-2014 Idiap Research Institute (Ronan Collobert)
# Copyright (c) 2012-2014 Deepmind Technologies    (Koray Kavukcuoglu)
# Copyright (c) 2011-2012 NEC Laboratories America (Koray Kavukcuoglu)
# Copyright (c) 2011-2013 NYU                      (Clement Farabet)
# Copyright (c) 2006-2010 NEC Laboratories America (Ronan Collobert, Leon Bottou, Iain Melvin,
#                         Jason Weston)
# Copyright (c) 2006      Idiap Research Institute (Samy Bengio)
# Copyright (c) 2001-2004 Idiap Research Institute (Ronan Collobert, Samy Bengio, Johnny
#                         Mariethoz)
# and the other PyTorch contributors listed in PyTorch's LICENSE.
#
# All rights reserved.
#
# Redistribution and use in source and binary forms, with or without modification, are
# permitted provided that the following conditions are met:
#
# 1. Redistributions of source code must retain the above copyright notice, this list of
#    conditions and the following disclaimer.
#
# 2. Redistributions in binary form must reproduce the above copyright notice, this list of
#    conditions and the following disclaimer in the documentation and/or other materials
#    provided with the distribution.
#
# 3. Neither the names of Facebook, Deepmind Technologies, NYU, NEC Laboratories America and
#    IDIAP Research Institute nor the names of its contributors may be used to endorse or
#    promote products derived from this software without specific prior written permission.
#
# THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY EXPRESS
# OR IMPLIED WARRANTIES, INCLUDING, BUT NOT LIMITED TO, THE IMPLIED WARRANTIES OF
# MERCHANTABILITY AND FITNESS FOR A PARTICULAR PURPOSE ARE DISCLAIMED. IN NO EVENT SHALL THE
# COPYRIGHT OWNER OR CONTRIBUTORS BE LIABLE FOR ANY DIRECT, INDIRECT, INCIDENTAL, SPECIAL,
# EXEMPLARY, OR CONSEQUENTIAL DAMAGES (INCLUDING, BUT NOT LIMITED TO, PROCUREMENT OF SUBSTITUTE
# GOODS OR SERVICES; LOSS OF USE, DATA, OR PROFITS; OR BUSINESS INTERRUPTION) HOWEVER CAUSED
# AND ON ANY THEORY OF LIABILITY, WHETHER IN CONTRACT, STRICT LIABILITY, OR TORT (INCLUDING
# NEGLIGENCE OR OTHERWISE) ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE, EVEN IF ADVISED
# OF THE POSSIBILITY OF SUCH DAMAGE.
"""PyTorch's autocast unit tests (torch 2.13) with ``mixprec.autocast`` as the region."""

import collections
import functools
import unittest

import pytest
import torch

pytest.importorskip("expecttest")  # torch's test utilities import it

from torch.testing._internal.autocast_test_lists import (
    AutocastCPUTestLists,
    TestAutocast,
)
from torch.testing._internal.common_device_type import (
    DeviceTypeTestBase,
    instantiate_device_type_tests,
)
from torch.testing._internal.common_utils import (
    TestCase,
    run_tests,
    skipIfTorchDynamo,
)
from torch.utils._python_dispatch import TorchDispatchMode

import mixprec

try:
    from torch.testing._internal.common_device_type import onlyAccelerator
except ImportError:  # torch 2.11 has no onlyAccelerator (mixprec: its rule, for that release)

    def onlyAccelerator(fn):
        """Skip the test on the CPU and meta devices (torch's decorator of later releases)."""

        @functools.wraps(fn)
        def only_fn(self, *args, **kwargs):
            if self.device_type in ("cpu", "meta"):
                raise unittest.SkipTest("onlyAccelerator: doesn't run on CPU or meta devices")
            return fn(self, *args, **kwargs)

        return only_fn


class TestAutocastCPU(TestAutocast):
    def setUp(self):
        super().setUp()
        self.autocast_lists = AutocastCPUTestLists(torch.device("cpu"))

    def tearDown(self):
        del self.autocast_lists
        super().tearDown()

    # torch's TestAutocast._run_autocast_outofplace, with its regions opened by mixprec.autocast.
    def _run_autocast_outofplace(
        self,
        op,
        args,
        run_as_type,
        device,
        out_type=None,
        module=torch,
        add_kwargs=None,
        amp_dtype=torch.bfloat16,
    ):
        # helper to cast args
        def cast(val, to_type):
            if isinstance(val, torch.Tensor):
                return val.to(to_type) if val.is_floating_point() else val
            elif isinstance(val, collections.abc.Iterable):
                return type(val)(cast(v, to_type) for v in val)
            else:
                return val

        if add_kwargs is None:
            add_kwargs = {}

        self.assertFalse(torch.is_autocast_enabled(device_type=device))
        with mixprec.autocast(device_type=device, dtype=amp_dtype):
            self.assertTrue(torch.is_autocast_enabled(device_type=device))

            out_type = out_type if out_type is not None else run_as_type
            output = output_method = None

            # Try module.* variant, if requested:
            if module is not None and hasattr(module, op):
                output = getattr(module, op)(*args, **add_kwargs)
                if isinstance(output, torch.Tensor):
                    self.assertTrue(
                        out_type == output.dtype,
                        f"autocast for torch.{op} produced {output.dtype}, should produce "
                        f"{out_type}",
                    )
            # Try Tensor.* variant:
            if hasattr(torch.Tensor, op):
                output_method = getattr(args[0], op)(*args[1:], **add_kwargs)
                if isinstance(output_method, torch.Tensor):
                    self.assertTrue(
                        out_type == output_method.dtype,
                        f"autocast for torch.{op} produced {output_method.dtype}, should "
                        f"produce torch.{out_type}",
                    )

            self.assertTrue(
                (output is not None) or (output_method is not None),
                f"{op} not found as an attribute on either Tensor or the requested module {module}",
            )

            # Accounts for ops that return Tensors, iterables, and other non-Tensors.
            # For example, lstm_cell returns a tuple and equal returns bool.
            def compare(first, second):
                if isinstance(first, torch.Tensor):
                    return torch.equal(first, second)
                elif isinstance(first, collections.abc.Iterable):
                    return all(compare(f, s) for f, s in zip(first, second, strict=False))
                else:
                    return first == second

            # If both torch.* and Tensor.* variants were found, check outputs are identical
            if (output is not None) and (output_method is not None):
                self.assertTrue(type(output) is type(output_method))
                comparison = compare(output, output_method)
                self.assertTrue(comparison, f"torch.{op} result did not match Tensor.{op} result")

            # Compare numerics to Python-side "autocasting" that (we expect) does the same thing
            # as the C++-side autocasting, and should be bitwise accurate.
            output_to_compare = output if output is not None else output_method
            with mixprec.autocast(device_type=device, enabled=False):
                self.assertFalse(torch.is_autocast_enabled(device_type=device))

                if module is not None and hasattr(module, op):
                    control = getattr(module, op)(*cast(args, run_as_type), **add_kwargs)
                else:
                    control = getattr(args[0].to(run_as_type), op)(
                        *cast(args[1:], run_as_type), **add_kwargs
                    )
                self.assertTrue(type(output_to_compare) is type(control))
                comparison = compare(output_to_compare, control)
                self.assertTrue(comparison, f"torch.{op} result did not match control")
            self.assertTrue(torch.is_autocast_enabled(device_type=device))
        self.assertFalse(torch.is_autocast_enabled(device_type=device))

    @skipIfTorchDynamo()
    def test_autocast_torch_expect_builtin_promote(self):
        for (
            op,
            args1,
            args2,
            out_type,
        ) in self.autocast_lists.torch_expect_builtin_promote:
            self._run_autocast_outofplace(op, args1, torch.float32, device="cpu", out_type=out_type)
            self._run_autocast_outofplace(
                op,
                args2,
                torch.float32,
                device="cpu",
                out_type=out_type,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_methods_expect_builtin_promote(self):
        for (
            op,
            args1,
            args2,
            out_type,
        ) in self.autocast_lists.methods_expect_builtin_promote:
            self._run_autocast_outofplace(
                op, args1, torch.float32, device="cpu", module=None, out_type=out_type
            )
            self._run_autocast_outofplace(
                op,
                args2,
                torch.float32,
                device="cpu",
                module=None,
                out_type=out_type,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_torch_16(self):
        for op_with_args in self.autocast_lists.torch_16:
            op, args, maybe_kwargs = self.args_maybe_kwargs(op_with_args)
            self._run_autocast_outofplace(
                op, args, torch.bfloat16, device="cpu", add_kwargs=maybe_kwargs
            )
            self._run_autocast_outofplace(
                op,
                args,
                torch.float16,
                device="cpu",
                add_kwargs=maybe_kwargs,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_nn_16(self):
        for op_with_args in self.autocast_lists.nn_16:
            op, args, maybe_kwargs = self.args_maybe_kwargs(op_with_args)
            self._run_autocast_outofplace(
                op,
                args,
                torch.bfloat16,
                device="cpu",
                module=torch._C._nn,
                add_kwargs=maybe_kwargs,
            )
            self._run_autocast_outofplace(
                op,
                args,
                torch.float16,
                device="cpu",
                module=torch._C._nn,
                add_kwargs=maybe_kwargs,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_torch_fp32(self):
        for op_with_args in self.autocast_lists.torch_fp32:
            op, args, maybe_kwargs = self.args_maybe_kwargs(op_with_args)
            self._run_autocast_outofplace(
                op, args, torch.float32, device="cpu", add_kwargs=maybe_kwargs
            )
            self._run_autocast_outofplace(
                op,
                args,
                torch.float32,
                device="cpu",
                add_kwargs=maybe_kwargs,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_nn_fp32(self):
        for op_with_args in self.autocast_lists.nn_fp32:
            op, args, maybe_kwargs = self.args_maybe_kwargs(op_with_args)
            self._run_autocast_outofplace(
                op,
                args,
                torch.float32,
                device="cpu",
                module=torch._C._nn,
                add_kwargs=maybe_kwargs,
            )
            self._run_autocast_outofplace(
                op,
                args,
                torch.float32,
                device="cpu",
                module=torch._C._nn,
                add_kwargs=maybe_kwargs,
                amp_dtype=torch.float16,
            )

    @skipIfTorchDynamo()
    def test_autocast_torch_need_autocast_promote(self):
        for op, args1, args2 in self.autocast_lists.torch_need_autocast_promote:
            self._run_autocast_outofplace(op, args1, torch.float32, device="cpu")
            self._run_autocast_outofplace(
                op, args2, torch.float32, device="cpu", amp_dtype=torch.float16
            )

    def test_autocast_rnn(self):
        if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            x = torch.randn(1, 2, 1)
            hx = torch.randn(2, 2, 1)
            cx = torch.randn(2, 2, 1)

            m = torch.nn.LSTM(1, 1, 2).to(torch.bfloat16)

            # Raise ValueError when autocast is not enabled
            with self.assertRaisesRegex(
                ValueError, r"RNN input dtype .* does not match weight dtype"
            ):
                m(x, (hx, cx))

            # Should be able to run the below case with autocast
            with mixprec.autocast(device_type="cpu"):
                m(x, (hx, cx))

    def test_autocast_disabled_with_fp32_dtype(self):
        with mixprec.autocast(device_type="cpu", dtype=torch.float32, enabled=False):
            _ = torch.ones(10)

    def test_generic_autocast(self):
        for op_with_args in self.autocast_lists.torch_16:
            op, args, maybe_kwargs = self.args_maybe_kwargs(op_with_args)
            with mixprec.autocast(device_type="cpu"):
                generic_autocast_output = getattr(torch, op)(*args, **maybe_kwargs)
            with mixprec.autocast(device_type="cpu"):
                cpu_autocast_output = getattr(torch, op)(*args, **maybe_kwargs)
            self.assertEqual(generic_autocast_output, cpu_autocast_output)

    @unittest.skip("checks torch.cpu.amp.autocast's own deprecation warning (no mixprec alias)")
    def test_cpu_autocast_deprecated_warning(self):
        with (
            self.assertWarnsRegex(
                FutureWarning,
                r"`torch.cpu.amp.autocast\(args...\)` is deprecated. Please use "
                r"`torch.amp.autocast\('cpu', args...\)` instead.",
            ),
            torch.cpu.amp.autocast(),
        ):
            _ = torch.ones(10)


class CustomLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_t):
        ctx.save_for_backward(x, w_t)
        ctx.device_type = x.device.type
        return torch.nn.functional.linear(x, w_t)

    @staticmethod
    def backward(ctx, grad_output):
        x, w_t = ctx.saved_tensors
        with mixprec.autocast(device_type=ctx.device_type):
            dL_dX = torch.matmul(grad_output, w_t)
            dL_dW = torch.matmul(x.transpose(0, 1), grad_output).transpose(0, 1)
        return dL_dX, dL_dW


class WeightDTypeCastCounterMode(TorchDispatchMode):
    def __init__(self, weight, target_dtype=torch.float16):
        super().__init__()
        self.dtype_cast_counter = 0
        self.weight = weight
        self.target_dtype = target_dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if (
            func is torch.ops.aten._to_copy.default
            and args[0] is self.weight
            and kwargs["dtype"] is self.target_dtype
        ):
            self.dtype_cast_counter += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self.old_clear_cache = torch.clear_autocast_cache
        torch.clear_autocast_cache = lambda: None
        return super().__enter__()

    def __exit__(self, exc_type, exc_val, exc_tb):
        torch.clear_autocast_cache = self.old_clear_cache
        return super().__exit__(exc_type, exc_val, exc_tb)


# torch's cast cache lives in torch (cleared by torch.clear_autocast_cache, bypassed for
# torch._C._add_cached_tensor's tensors); mixprec's belongs to its region (emptied when the
# outermost region on the thread exits), so the two cache tests check what mixprec does not use.
_TORCH_CACHE = "checks torch's own cast cache (torch.clear_autocast_cache, cached tensors)"


class TestAutocastDeviceType(DeviceTypeTestBase):
    """Device-generic autocast tests that run across all device types."""

    def _get_amp_dtype(self):
        return torch.get_autocast_dtype(device_type=self.device_type)

    @unittest.skip(_TORCH_CACHE)
    @onlyAccelerator
    def test_cast_cache_is_global(self, device):
        """
        Verifies that the autocast cache is global. This is done by
        mocking out cache clearing at the end of the forward pass,
        running forward+backward with an explicit call to autocast in the
        backward, and verifying that the weight only gets cast once.
        """
        amp_dtype = self._get_amp_dtype()
        data = torch.randn(2, 3, device=device)
        weight = torch.nn.Parameter(torch.randn(4, 3, device=device))

        with WeightDTypeCastCounterMode(weight, target_dtype=amp_dtype) as mode:
            with mixprec.autocast(device_type=self.device_type):
                output = CustomLinear.apply(data, weight)
                s = output.sum()
            s.backward()

        self.assertEqual(mode.dtype_cast_counter, 1)

    @unittest.skip(_TORCH_CACHE)
    @onlyAccelerator
    def test_cache_disabled(self, device):
        """
        Verifies that when a weight is marked as a cached tensor,
        autocast does NOT cache its conversion (cast happens twice).
        """
        amp_dtype = self._get_amp_dtype()
        data = torch.randn(2, 3, device=device)
        weight = torch.nn.Parameter(torch.randn(4, 3, device=device))

        try:
            torch._C._set_cached_tensors_enabled(True)
            torch._C._add_cached_tensor(weight)

            with WeightDTypeCastCounterMode(weight, target_dtype=amp_dtype) as mode:
                with mixprec.autocast(device_type=self.device_type):
                    output = CustomLinear.apply(data, weight)
                    s = output.sum()
                s.backward()

            self.assertEqual(mode.dtype_cast_counter, 2)

        finally:
            torch._C._set_cached_tensors_enabled(False)

    @onlyAccelerator
    def test_autocast_prioritize(self, device):
        """
        Test that index_put 'promote' policy works correctly under autocast.
        See https://github.com/pytorch/pytorch/issues/132715.
        """
        dtype = self._get_amp_dtype()

        with mixprec.autocast(device_type=self.device_type, enabled=True, dtype=dtype):
            t = torch.randn([3, 4, 5], dtype=dtype, device=device, requires_grad=True)
            index = torch.randint(low=0, high=3, size=[3, 4, 5], dtype=torch.int64, device=device)
            val = torch.randn(1, dtype=dtype, device=device)

            res = torch.index_put(t, [index], val)

            loss = res.mean()
            loss.backward()

    def test_autocast_fast_dtype(self, device):
        """Verify the device reports a valid autocast fast dtype."""
        fast_dtype = mixprec.get_autocast_dtype(device_type=self.device_type)
        self.assertIn(fast_dtype, [torch.float16, torch.bfloat16])

    def test_autocast_nograd_caching_issue_158232(self, device):
        """
        Regression test for issue #158232: autocast + no_grad incompatibility.
        Ensures that exiting no_grad inside autocast restores gradient tracking.
        """
        dtype = self._get_amp_dtype()
        model = torch.nn.Linear(2, 2).to(device)
        inp = torch.randn(8, 2, device=device)

        with mixprec.autocast(self.device_type, dtype=dtype, enabled=True):
            with torch.no_grad():
                out1 = model(inp)
                self.assertFalse(out1.requires_grad, "Output in no_grad should not require grad")

            out2 = model(inp)
            self.assertTrue(
                out2.requires_grad,
                "Output should require gradients after exiting no_grad",
            )
            self.assertIsNotNone(out2.grad_fn, "Output should have grad_fn after exiting no_grad")

            loss = out2.mean()
            loss.backward()

        self.assertIsNotNone(model.weight.grad)
        self.assertIsNotNone(model.bias.grad)

    def test_autocast_inference_mode_interaction(self, device):
        """
        Test that autocast works correctly with torch.inference_mode().
        """
        dtype = self._get_amp_dtype()
        model = torch.nn.Linear(2, 2).to(device)
        inp = torch.randn(8, 2, device=device)

        # Test 1: inference_mode inside autocast
        with mixprec.autocast(self.device_type, dtype=dtype, enabled=True):
            torch.clear_autocast_cache()
            with torch.inference_mode():
                out1 = model(inp)
                self.assertFalse(out1.requires_grad)
                self.assertEqual(out1.dtype, dtype)

            # After exiting inference_mode, gradients should work
            out2 = model(inp)
            self.assertTrue(out2.requires_grad)
            out2.mean().backward()

        # Test 2: autocast inside inference_mode
        with torch.inference_mode(), mixprec.autocast(self.device_type, dtype=dtype, enabled=True):
            out = model(inp)
            self.assertFalse(out.requires_grad)
            self.assertEqual(out.dtype, dtype)

    def test_autocast_caching_still_works_with_gradients(self, device):
        """
        Verify that autocast caching functions correctly when gradients ARE enabled.
        """
        dtype = self._get_amp_dtype()
        model = torch.nn.Linear(2, 2).to(device)
        inp = torch.randn(8, 2, device=device)

        with mixprec.autocast(self.device_type, dtype=dtype, enabled=True):
            out1 = model(inp)
            out2 = model(inp)
            out3 = model(inp)

            self.assertTrue(out1.requires_grad)
            self.assertTrue(out2.requires_grad)
            self.assertTrue(out3.requires_grad)

            self.assertIsNotNone(out1.grad_fn)
            self.assertIsNotNone(out2.grad_fn)
            self.assertIsNotNone(out3.grad_fn)

            out1.mean().backward(retain_graph=True)
            out2.mean().backward(retain_graph=True)
            out3.mean().backward()

    def test_autocast_mixed_grad_contexts(self, device):
        """
        Test complex nesting of gradient contexts within autocast.
        """
        dtype = self._get_amp_dtype()
        model = torch.nn.Linear(2, 2).to(device)
        inp = torch.randn(8, 2, device=device)

        with mixprec.autocast(self.device_type, dtype=dtype, enabled=True):
            with torch.no_grad():
                out1 = model(inp)
                self.assertFalse(out1.requires_grad)

            out2 = model(inp)
            self.assertTrue(out2.requires_grad)

            with torch.no_grad():
                out3 = model(inp)
                self.assertFalse(out3.requires_grad)

            out4 = model(inp)
            self.assertTrue(out4.requires_grad)

            (out2.mean() + out4.mean()).backward()


instantiate_device_type_tests(TestAutocastDeviceType, globals(), allow_mps=True, allow_xpu=True)


class TestTorchAutocast(TestCase):
    """Tests for autocast API behavior that don't depend on any accelerator."""

    def test_invalid_device(self):
        dev = "not a real device"
        msg = f"unknown device type '{dev}'"  # torch: f"Invalid device string: '{dev}'"
        with self.assertRaisesRegex(RuntimeError, msg), mixprec.autocast(device_type=dev):
            _ = torch.tensor(1)

    def test_non_string_device(self):
        """mixprec accepts a `torch.device` for `device_type` (torch raises ValueError); other
        non-strings raise torch's ValueError"""
        dev = torch.device("cpu")
        with mixprec.autocast(device_type=dev) as region:
            self.assertEqual(region.device_type, "cpu")
            self.assertTrue(torch.is_autocast_enabled("cpu"))
        with self.assertRaisesRegex(
            expected_exception=ValueError, expected_regex="device_type must be a string"
        ):
            mixprec.autocast(device_type=0)

    def test_autocast_called_with_non_callable(self):
        """Test that autocast gives a clear error when misused as a function wrapper"""
        x = torch.randn(2, 3)
        msg = r"autocast\(\)\(func\) requires a callable, but got Tensor"
        with self.assertRaisesRegex(TypeError, msg):
            mixprec.autocast(device_type="cpu")(x)


if __name__ == "__main__":
    run_tests()
