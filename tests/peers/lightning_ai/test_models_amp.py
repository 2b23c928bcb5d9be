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
# Adapted from Lightning-AI/pytorch-lightning 2.6.5, tests/tests_pytorch/models/test_amp.py,
# with MixprecPrecision at the same setting in place of Lightning's MixedPrecision
# (plugins=[...] where the original passes precision=...). Changes: on a CPU, "16-mixed" runs
# fp16 with mixprec (Lightning runs bf16 there); no @pytest.mark.flaky (pytest-rerunfailures is
# not a dependency); the gloo-on-Windows xfail becomes a skip; the SLURM test's logger and
# checkpoint callback are built directly (tests_pytorch.helpers.utils did it); the CPU
# "ddp_spawn" runs fork from a forkserver that imported Lightning (amp.spawn_strategy).
# docs/migration.md, "Running Lightning's AMP tests".
import os
from unittest import mock

import pytest
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from tests.peers.lightning_ai.amp import RunIf, spawn_strategy, trainer_plugin


class AMPTestModel(BoringModel):
    def step(self, batch):
        self._assert_autocast_enabled()
        output = self(batch)
        is_bfloat16 = self.trainer.precision_plugin.precision == "bf16-mixed"
        assert output.dtype == torch.float16 if not is_bfloat16 else torch.bfloat16
        return self.loss(output)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self._assert_autocast_enabled()
        output = self(batch)
        is_bfloat16 = self.trainer.precision_plugin.precision == "bf16-mixed"
        assert output.dtype == torch.float16 if not is_bfloat16 else torch.bfloat16
        return output

    def _assert_autocast_enabled(self):
        if self.trainer.precision_plugin.device == "cpu":
            assert torch.is_autocast_enabled("cpu")
        else:
            assert torch.is_autocast_enabled()


@pytest.mark.parametrize(
    ("strategy", "precision", "devices"),
    [
        ("single_device", "16-mixed", 1),
        ("single_device", "bf16-mixed", 1),
        pytest.param(
            "ddp_spawn",
            "16-mixed",
            2,
            marks=[RunIf(skip_windows=True), pytest.mark.slow, pytest.mark.distributed],
        ),
        pytest.param(
            "ddp_spawn",
            "bf16-mixed",
            2,
            marks=[
                RunIf(skip_windows=True),
                pytest.mark.slow,
                pytest.mark.distributed,
            ],
        ),
    ],
)
def test_amp_cpus(tmp_path, strategy, precision, devices):
    """Make sure combinations of AMP and strategies work if supported."""
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=devices,
        strategy=spawn_strategy() if strategy == "ddp_spawn" else strategy,
        plugins=[trainer_plugin(precision, "cpu")],
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    model = AMPTestModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)


@pytest.mark.parametrize(
    "precision", ["16-mixed", pytest.param("bf16-mixed", marks=RunIf(bf16_cuda=True))]
)
@pytest.mark.parametrize(
    "devices",
    [pytest.param(1, marks=RunIf(min_cuda_gpus=1)), pytest.param(2, marks=RunIf(min_cuda_gpus=2))],
)
def test_amp_gpus(tmp_path, precision, devices):
    """Make sure combinations of AMP and strategies work if supported."""
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="gpu",
        devices=devices,
        strategy=("ddp_spawn" if devices > 1 else "auto"),
        plugins=[trainer_plugin(precision, "cuda")],
    )

    model = AMPTestModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model, DataLoader(RandomDataset(32, 64)))


@RunIf(min_cuda_gpus=1)
@mock.patch.dict(
    os.environ,
    {
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_JOB_NAME": "SOME_NAME",
        "SLURM_NODEID": "0",
        "LOCAL_RANK": "0",
        "SLURM_LOCALID": "0",
        "SLURM_PROCID": "0",
    },
)
def test_amp_gpu_ddp_slurm_managed(tmp_path):
    """Make sure DDP + AMP work."""
    # simulate setting slurm flags
    model = AMPTestModel()

    # exp file to get meta
    logger = TensorBoardLogger(tmp_path, name="lightning_logs")

    # exp file to get weights
    checkpoint = ModelCheckpoint(dirpath=logger.save_dir)

    # fit model
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="gpu",
        devices=[0],
        strategy="ddp_spawn",
        plugins=[trainer_plugin("16-mixed", "cuda")],
        callbacks=[checkpoint],
        logger=logger,
    )
    trainer.fit(model)
    assert isinstance(trainer.strategy.cluster_environment, SLURMEnvironment)


@pytest.mark.parametrize("clip_val", [0, 10])
@mock.patch("torch.nn.utils.clip_grad_norm_")
def test_precision_16_clip_gradients(mock_clip_grad_norm, clip_val, tmp_path):
    """Ensure that clip gradients is only called if the value is greater than 0."""
    model = BoringModel()
    trainer = Trainer(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        max_epochs=1,
        devices=1,
        plugins=[trainer_plugin("16-mixed")],
        limit_train_batches=4,
        limit_val_batches=0,
        gradient_clip_val=clip_val,
    )
    trainer.fit(model)

    if clip_val > 0:
        mock_clip_grad_norm.assert_called()
    else:
        mock_clip_grad_norm.assert_not_called()
