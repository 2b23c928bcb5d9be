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
# Adapted from Lightning-AI/pytorch-lightning 2.6.5, tests/tests_fabric/plugins/precision/
# test_amp.py, with MixprecFabricPrecision at the same setting in place of Lightning's
# MixedPrecision. Changes: the scaler is mixprec.GradScaler (torch.amp.GradScaler there) and
# the region mixprec.autocast (torch.autocast); device=Mock() becomes "cpu" (mixprec resolves the
# opt level for a device type); mixprec's plugins take scaler *settings* (a dict), so the bf16
# test passes them and a scaler object is refused; a scaled step needs a scaled backward before
# it (mixprec checks), so the step tests run one on a real optimizer; parameter validation checks
# mixprec's settings and messages. docs/migration.md, "Running Lightning's AMP tests".
import re
from unittest.mock import Mock

import pytest
import torch

import mixprec
from tests.peers.lightning_ai.amp import fabric_plugin

# mixprec's levels (Lightning's message names O0-O3: mixprec has O4 too)
VALID_LEVELS = re.escape("Valid opt levels: 'O0', 'O1', 'O2', 'O3' or 'O4'")


def _backward(precision):
    # mixprec refuses a scaled step without a scaled backward before it: run one.
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    precision.backward(model(torch.randn(4, 2)).sum(), model)
    return optimizer


def test_amp_precision_default_scaler():
    precision = fabric_plugin("16-mixed", device="cpu")
    assert isinstance(precision.scaler, mixprec.GradScaler)


def test_amp_precision_scaler_with_bf16():
    with pytest.raises(ValueError, match="GradScaler settings as a dict"):
        fabric_plugin("bf16-mixed", device="cpu", scaler=Mock())

    # Settings are used where the level scales (fp16); bf16 runs without a scaler.
    precision = fabric_plugin("bf16-mixed", device="cpu", scaler={"init_scale": 2.0**10})
    assert precision.scaler is None
    precision = fabric_plugin("bf16-mixed", device="cpu")
    assert precision.scaler is None


def test_amp_precision_forward_context():
    """Test to ensure that the context manager correctly is set to bfloat16 on CPU and CUDA."""
    precision = fabric_plugin("16-mixed", device="cuda")
    assert precision.device == "cuda"
    assert isinstance(precision.scaler, mixprec.GradScaler)
    assert torch.get_default_dtype() == torch.float32
    with precision.forward_context():
        assert torch.get_autocast_dtype("cuda") == torch.float16

    precision = fabric_plugin("bf16-mixed", device="cpu")
    assert precision.device == "cpu"
    assert precision.scaler is None
    with precision.forward_context():
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16

    context_manager = precision.forward_context()
    assert isinstance(context_manager, mixprec.autocast)
    assert context_manager.dtype == torch.bfloat16


def test_amp_precision_backward():
    precision = fabric_plugin("16-mixed", device="cuda")
    precision.scaler = Mock()
    precision.scaler.scale = Mock(side_effect=(lambda x: x))
    tensor = Mock()
    model = Mock()
    precision.backward(tensor, model, "positional-arg", keyword="arg")
    precision.scaler.scale.assert_called_once_with(tensor)
    tensor.backward.assert_called_once_with("positional-arg", keyword="arg")


def test_amp_precision_optimizer_step_with_scaler():
    precision = fabric_plugin("16-mixed", device="cpu")
    precision.scaler = Mock()
    optimizer = _backward(precision)

    precision.optimizer_step(optimizer, keyword="arg")
    precision.scaler.step.assert_called_once_with(optimizer, keyword="arg")
    precision.scaler.update.assert_called_once()


def test_amp_precision_optimizer_step_without_scaler():
    precision = fabric_plugin("bf16-mixed", device="cpu")
    assert precision.scaler is None
    optimizer = _backward(precision)
    optimizer.step = Mock()

    precision.optimizer_step(optimizer, keyword="arg")
    optimizer.step.assert_called_once_with(keyword="arg")


def test_amp_precision_parameter_validation():
    fabric_plugin("16-mixed", "cpu")  # should not raise exception
    fabric_plugin("bf16-mixed", "cpu")

    with pytest.raises(ValueError, match=VALID_LEVELS):
        mixprec.integrations.lightning.MixprecFabricPrecision("16", device="cpu")

    with pytest.raises(ValueError, match=re.escape("dtype must be a torch.dtype or a name")):
        mixprec.integrations.lightning.MixprecFabricPrecision("O1", dtype=16, device="cpu")

    with pytest.raises(ValueError, match=VALID_LEVELS):
        mixprec.integrations.lightning.MixprecFabricPrecision("bf16", device="cpu")
