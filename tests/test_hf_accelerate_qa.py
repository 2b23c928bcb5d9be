"""Probes of the Accelerate and Transformers integrations as their users drive them, each against
the framework's own mixed precision (or fp32): Accelerate's documented ways of leaving the
autocast region, saving an O2 model for ``from_pretrained``, and a Trainer retrained by
``model_init`` (hyperparameter search)."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate.utils import AutocastKwargs  # noqa: E402

from mixprec.integrations.accelerate import AmpAccelerator  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    _reset_accelerate()
    yield
    _reset_accelerate()


class _Fp32Block(torch.nn.Module):
    """Accelerate's documented way to run a block in fp32 inside the model's autocast."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.accelerator = None

    def forward(self, x):
        h = self.a(x)
        with self.accelerator.autocast(AutocastKwargs(enabled=False)):
            return h, self.b(h.float())


def _fp32_block(accelerator):
    model = _Fp32Block()
    model = accelerator.prepare(model)
    model.accelerator = accelerator
    return model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1)))


def test_accelerate_autocast_handler_disables_the_region_as_accelerate_does():
    """``accelerator.autocast(AutocastKwargs(enabled=False))`` was ignored: the block ran in
    bf16 (2.6e-3 from fp32 on outputs of about 1) where Accelerate's own bf16 runs it in fp32."""
    h, out = _fp32_block(AmpAccelerator(accelerate.Accelerator(cpu=True), "O1", "bf16"))
    _reset_accelerate()
    ref_h, ref_out = _fp32_block(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    assert h.dtype == ref_h.dtype == torch.float32  # the model's outputs, cast back to fp32
    assert out.dtype == ref_out.dtype == torch.float32
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)
