"""Probes of the Accelerate and Transformers integrations as their users drive them, each against
the framework's own mixed precision (or fp32): Accelerate's documented ways of leaving the
autocast region, saving an O2 model for ``from_pretrained``, and a Trainer at O2 resumed from a
checkpoint or with gradient checkpointing."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from accelerate.utils import AutocastKwargs  # noqa: E402

from mixprec.integrations.accelerate import AmpAccelerator  # noqa: E402
from tests.helpers import Tokens, reset_accelerate  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_accelerate"),
]


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
    reset_accelerate()
    ref_h, ref_out = _fp32_block(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    assert h.dtype == ref_h.dtype == torch.float32  # the model's outputs, cast back to fp32
    assert out.dtype == ref_out.dtype == torch.float32
    assert torch.equal(h, ref_h) and torch.equal(out, ref_out)


# ---------------------------------------------------------------------------- the Trainer


def _gpt2():
    torch.manual_seed(3)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)  # lm_head.weight is transformer.wte.weight


def _args(path, **kw):
    settings = dict(per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3,
                    lr_scheduler_type="linear", logging_steps=1, report_to=[], use_cpu=True,
                    save_strategy="no", max_grad_norm=1.0, disable_tqdm=True)  # fmt: skip
    return transformers.TrainingArguments(str(path), **{**settings, **kw})


def _trainer(path, **kw):
    from mixprec.integrations.engine import AmpConfig
    from mixprec.integrations.transformers import AmpTrainer

    amp = AmpConfig("O2", "fp16", scaler={"init_scale": 1024.0, "growth_interval": 1})
    return AmpTrainer(model=_gpt2(), args=_args(path, **kw), train_dataset=Tokens(16), amp=amp)


def test_trainer_o2_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    """save_steps + resume_from_checkpoint at O2 fp16, the scale growing every step: weights,
    fp32 masters, Adam's moments, the scale and the learning rate equal the uninterrupted run
    bit for bit; the tied GPT-2 embedding stays one parameter with one master."""
    full = _trainer(tmp_path, save_strategy="steps", save_steps=2)  # saving changes nothing
    full.train()
    reset_accelerate()
    resumed = _trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    logs = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (full, resumed)]
    assert logs[0] == logs[1]
    assert full.amp_scaler.get_scale() == resumed.amp_scaler.get_scale() == 2.0**14
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    inner = [t.optimizer.optimizer.optimizer for t in (full, resumed)]
    for a, b in zip(*(o.param_groups[0]["params"] for o in inner), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)
        assert torch.equal(inner[0].state[a]["exp_avg_sq"], inner[1].state[b]["exp_avg_sq"])
    model = resumed.model
    assert model.lm_head.weight is model.transformer.wte.weight  # the tie survived O2
    masters = model.state_dict()
    tied = masters["lm_head.weight"], masters["transformer.wte.weight"]
    assert tied[0].dtype == torch.float32 and tied[0].data_ptr() == tied[1].data_ptr()


def test_trainer_o2_gradient_checkpointing_changes_nothing(tmp_path):
    """Activation checkpointing recomputes the blocks in backward: the same bits as without."""
    plain = _trainer(tmp_path / "a")
    plain.train()
    reset_accelerate()
    ckpt = _trainer(tmp_path / "b", gradient_checkpointing=True)
    ckpt.train()
    for a, b in zip(plain.model.parameters(), ckpt.model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------- Accelerate at O2


def test_accelerate_o2_save_pretrained_loads_back_exactly_in_fp32(tmp_path):
    """docs/integrations.md, Limits: save_pretrained writes config dtype float16 at O2 (the live
    weights'), so a plain from_pretrained rounds the fp32 masters; dtype=torch.float32 is exact."""
    acc = AmpAccelerator(accelerate.Accelerator(cpu=True), "O2", "fp16")
    model = _gpt2()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = Tokens(16).ids[:4]
    for _ in range(2):
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    acc.unwrap_model(model).save_pretrained(str(tmp_path))
    masters = acc.unwrap_model(model).state_dict()
    plain = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path))
    assert plain.dtype == torch.float16  # the documented limit
    exact = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path), dtype=torch.float32)
    for name, value in exact.state_dict().items():
        assert torch.equal(value, masters[name]), name
