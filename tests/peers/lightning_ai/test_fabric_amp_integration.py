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
# test_amp_integration.py, with MixprecFabricPrecision at the same setting in place of
# Lightning's plugin (Fabric(plugins=[...]) where the original passes precision=...). Changes:
# on a CPU, "16-mixed" runs fp16 with mixprec (Lightning runs bf16 there); the model's input
# stays fp32 (mixprec leaves inputs to the op policy; Fabric's plugin casts them); the scaler
# is mixprec.GradScaler; the fused-optimizer parity test also runs on the CPU; the CPU
# "ddp_spawn" run forks from a forkserver that imported Lightning (amp.spawn_strategy).
# docs/migration.md, "Running Lightning's AMP tests".
"""Integration tests for Automatic Mixed Precision (AMP) training."""

import pytest
import torch
import torch.nn as nn
from lightning.fabric import Fabric, seed_everything

import mixprec
from tests.peers.lightning_ai.amp import RunIf, fabric_plugin, spawn_strategy


class MixedPrecisionModule(nn.Module):
    def __init__(self, expected_dtype):
        super().__init__()
        self.expected_dtype = expected_dtype
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x):
        # mixprec leaves the input to the op policy (Fabric's MixedPrecision casts it).
        assert x.dtype == torch.float32
        if x.device.type == "cpu":
            assert torch.is_autocast_enabled("cpu")
        else:
            assert torch.is_autocast_enabled()
        output = self.layer(x)
        assert output.dtype == self.expected_dtype
        return output


@pytest.mark.parametrize(
    ("accelerator", "precision", "expected_dtype"),
    [
        pytest.param(
            "cpu",
            "16-mixed",
            torch.float16,
            marks=[RunIf(skip_windows=True), pytest.mark.slow, pytest.mark.distributed],
        ),
        pytest.param(
            "cpu",
            "bf16-mixed",
            torch.bfloat16,
            marks=[
                RunIf(skip_windows=True),
                pytest.mark.slow,
                pytest.mark.distributed,
            ],
        ),
        pytest.param("cuda", "16-mixed", torch.float16, marks=RunIf(min_cuda_gpus=2)),
        pytest.param(
            "cuda", "bf16-mixed", torch.bfloat16, marks=RunIf(min_cuda_gpus=2, bf16_cuda=True)
        ),
    ],
)
def test_amp(accelerator, precision, expected_dtype):
    fabric = Fabric(
        accelerator=accelerator,
        plugins=[fabric_plugin(precision, accelerator)],
        devices=2,
        strategy=spawn_strategy("fabric") if accelerator == "cpu" else "ddp_spawn",
    )
    fabric.launch(_test_amp, expected_dtype)


def _test_amp(fabric, expected_dtype):
    model = MixedPrecisionModule(expected_dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    batch = torch.rand(2, 32, device=fabric.device)
    assert model.layer.weight.dtype == torch.float32
    assert batch.dtype == torch.float32

    output = model(batch)
    assert output.dtype == torch.float32

    loss = torch.nn.functional.mse_loss(output, torch.ones_like(output))
    fabric.backward(loss)
    assert model.layer.weight.grad.dtype == torch.float32

    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=RunIf(min_cuda_gpus=1))])
def test_amp_fused_optimizer_parity(accelerator):
    def run(fused=False):
        seed_everything(1234)
        fabric = Fabric(
            accelerator=accelerator, plugins=[fabric_plugin("16-mixed", accelerator)], devices=1
        )

        model = nn.Linear(10, 10).to(
            fabric.device
        )  # TODO: replace with individual setup_module call
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, fused=fused)

        model, optimizer = fabric.setup(model, optimizer)
        assert isinstance(fabric._precision.scaler, mixprec.GradScaler)

        data = torch.randn(10, 10, device=accelerator)
        target = torch.randn(10, 10, device=accelerator)

        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            output = model(data)
            loss = (output - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses), model.parameters()

    losses, params = run(fused=False)
    losses_fused, params_fused = run(fused=True)

    # Both the regular and the fused version of Adam produce the same losses and model weights
    torch.testing.assert_close(losses, losses_fused)
    for p, q in zip(params, params_fused, strict=True):
        torch.testing.assert_close(p, q)
