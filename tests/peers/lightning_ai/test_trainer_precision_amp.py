# Copyright The Lightning AI team.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Adapted from Lightning-AI/pytorch-lightning 2.6.5, tests/tests_pytorch/plugins/precision/
# test_amp.py, with MixprecPrecision at the same setting in place of Lightning's
# MixedPrecision. Changes: no scaler=Mock() (mixprec's plugins take scaler settings, and
# clip_gradients needs none here); test_optimizer_amp_scaling_support_in_step_method asserts
# mixprec's deliberate difference: an optimizer that unscales inside its step (fused Adam) is
# clipped on unscaled gradients, where Lightning's plugin raises. docs/migration.md, "Running
# Lightning's AMP tests".
from unittest.mock import Mock

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer

from tests.peers.lightning_ai.amp import trainer_plugin


def test_clip_gradients():
    """Test that `.clip_gradients()` is a no-op when clipping is disabled."""
    optimizer = Mock(spec=Optimizer)
    precision = trainer_plugin("16-mixed", device="cuda:0")
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_gradients(
        optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE
    )
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_grad_by_value.reset_mock()
    precision.clip_grad_by_norm.reset_mock()

    precision.clip_gradients(
        optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM
    )
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


def test_optimizer_amp_scaling_support_in_step_method(tmp_path):
    """An optimizer that takes over unscaling in its step (example: fused Adam) is clipped on
    unscaled gradients: mixprec unscales them before clipping (Lightning's plugin refuses to
    clip, "The current optimizer ... does not allow for gradient clipping")."""
    clip_val = 1e-3

    class FusedModel(BoringModel):
        def configure_optimizers(self):
            optimizer = torch.optim.Adam(self.parameters(), lr=0.1, fused=True)
            assert optimizer._step_supports_amp_scaling
            return optimizer

        def on_before_optimizer_step(self, optimizer):
            assert self.trainer.precision_plugin.scaler.get_scale() > 1.0
            self.unscaled = [p.grad.detach().clone() for p in self.parameters()]
            assert all(g.isfinite().all() for g in self.unscaled)

        def configure_gradient_clipping(self, optimizer, *args, **kwargs):
            super().configure_gradient_clipping(optimizer, *args, **kwargs)
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in self.unscaled]))
            coef = torch.clamp(clip_val / (norm + 1e-6), max=1.0)
            for p, g in zip(self.parameters(), self.unscaled, strict=True):
                torch.testing.assert_close(p.grad, g * coef)
            self.clipped += 1

    model = FusedModel()
    model.clipped = 0
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        # a scale that does not overflow BoringModel's fp16 gradients: every step is clipped
        plugins=[trainer_plugin("16-mixed", device="cpu", scaler={"init_scale": 2.0**8})],
        max_steps=2,
        gradient_clip_val=clip_val,
        barebones=True,
    )
    trainer.fit(model)
    assert model.clipped == 2


def test_amp_with_no_grad():
    """Test that asserts using `no_grad` context wrapper with a persistent AMP context wrapper does
    not break gradient tracking."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = trainer_plugin("bf16-mixed", device="cpu")

    with amp.autocast_context_manager():
        with torch.no_grad():
            _ = layer(x)

        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None
