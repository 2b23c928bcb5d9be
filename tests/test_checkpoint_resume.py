"""mixprec.save_checkpoint / load_checkpoint in one process (no process group): resuming a
fresh job, and refusals that leave every object unchanged.

- a checkpoint in which some parameters have no optimizer state (saved at step 0, or with a
  head that never got a gradient) loads into a fresh job, which continues bit for bit as the
  uninterrupted run, and those parameters stay without state;
- the checkpoint's metadata (opt level, loss-scale setting) is checked before any tensor is
  read, so the message names the setting, not the first tensor DCP could not match;
- a loss-scale setting that differs (dynamic vs static, another static scale, another growth
  rule) is refused instead of replacing the job's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


class Net(nn.Module):
    def __init__(self, use_aux: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.aux = nn.Linear(8, 4), nn.Linear(8, 4)
        self.use_aux = use_aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.aux(x) if self.use_aux else self.body(x)


def _job(level: str = "O2", use_aux: bool = False, **kwargs):
    """aux gets no gradient unless `use_aux` (the refusals' tests use it: every parameter has
    optimizer state, so what they check does not depend on stateless parameters)."""
    model = Net(use_aux)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return mixprec.initialize(model, opt, level, dtype="bf16", **kwargs)


def _train(model, opt, steps: range) -> None:
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with mixprec.scale_loss(model(x).float().square().mean(), opt) as scaled:
            scaled.backward()
        opt.step()


def _snapshot(model, opt) -> dict:
    inner = opt.optimizer
    stepped = [p for g in inner.param_groups for p in g["params"]]  # body.w, body.b, aux...
    names = {id(p): n for n, p in zip(("bw", "bb", "aw", "ab"), stepped, strict=True)}
    state = {names[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in inner.state.items()}
    return {
        "params": [t.detach().clone() for t in model.state_dict().values()],
        "masters": [m.detach().clone() for m in opt._masters],
        "state": state,
        "scaler": None if opt.scaler is None else opt.scaler.state_dict(),
    }


def _same(a: dict, b: dict) -> bool:
    def equal(x: list, y: list) -> bool:
        return len(x) == len(y) and all(torch.equal(s, t) for s, t in zip(x, y, strict=True))

    return (
        equal(a["params"], b["params"])
        and equal(a["masters"], b["masters"])
        and a["state"].keys() == b["state"].keys()
        and all(
            a["state"][n].keys() == b["state"][n].keys()
            and all(torch.equal(a["state"][n][k], b["state"][n][k]) for k in a["state"][n])
            for n in a["state"]
        )
        and a["scaler"] == b["scaler"]
    )


@pytest.mark.parametrize("saved_at", [0, 3], ids=["step-0", "unused-head"])
def test_a_fresh_job_resumes_from_a_checkpoint_with_stateless_parameters(tmp_path, saved_at):
    path = str(tmp_path / "ck")
    model, opt = _job()
    _train(model, opt, range(saved_at))
    mixprec.save_checkpoint(path, model, opt)
    _train(model, opt, range(saved_at, saved_at + 3))
    uninterrupted = _snapshot(model, opt)

    again, again_opt = _job()
    mixprec.load_checkpoint(path, again, again_opt)
    # What had no state when saved has none now (none at all at step 0; aux never stepped).
    expected = set() if saved_at == 0 else {"bw", "bb"}
    assert set(_snapshot(again, again_opt)["state"]) == expected
    _train(again, again_opt, range(saved_at, saved_at + 3))
    resumed = _snapshot(again, again_opt)
    assert _same(resumed, uninterrupted)
    assert set(resumed["state"]) == {"bw", "bb"}  # aux: still no state after training on


def test_a_job_with_more_state_than_the_checkpoint_keeps_none_for_those_parameters(tmp_path):
    # torch's Optimizer.load_state_dict semantics: the loaded state replaces the job's.
    path = str(tmp_path / "ck")
    model, opt = _job()
    mixprec.save_checkpoint(path, model, opt)  # step 0: no state anywhere
    trained, trained_opt = _job()
    _train(trained, trained_opt, range(2))
    mixprec.load_checkpoint(path, trained, trained_opt)
    assert not trained_opt.optimizer.state
    assert _same(_snapshot(trained, trained_opt), _snapshot(model, opt))


def _unchanged_by_failed_load(path: str, model, opt) -> str:
    before = _snapshot(model, opt)
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.load_checkpoint(path, model, opt)
    assert _same(before, _snapshot(model, opt))
    return str(err.value)


def test_the_opt_level_is_checked_before_tensors_are_read(tmp_path):
    path = str(tmp_path / "o2")
    model, opt = _job("O2", use_aux=True)
    _train(model, opt, range(2))
    mixprec.save_checkpoint(path, model, opt)
    o4, o4_opt = _job("O4", use_aux=True)  # other optimizer state (8-bit codes, a key)
    _train(o4, o4_opt, range(1))
    assert _unchanged_by_failed_load(path, o4, o4_opt) == (
        "the checkpoint was saved at opt level 'O2', this job runs 'O4': initialize (or "
        "mixprec.fully_shard) with the same level. Nothing was changed."
    )


def test_a_path_that_is_not_a_checkpoint_says_so(tmp_path):
    model, opt = _job()
    message = _unchanged_by_failed_load(str(tmp_path / "nothing"), model, opt)
    assert message.startswith(
        f"the checkpoint at {str(tmp_path / 'nothing')!r} could not be read (nothing was changed): "
    )
    assert message.endswith("Pass the directory save_checkpoint wrote (or its storage_reader=).")


@pytest.mark.parametrize(
    ("saved", "loading", "message"),
    [
        (
            {"loss_scale": "dynamic"},
            {"loss_scale": 128.0},
            "the checkpoint's loss scale is dynamic (loss_scale='dynamic') and this job's is "
            "static (loss_scale=128.0)",
        ),
        (
            {"loss_scale": 128.0},
            {"loss_scale": "dynamic"},
            "the checkpoint's loss scale is static (loss_scale=128.0) and this job's is dynamic "
            "(loss_scale='dynamic')",
        ),
        (
            {"loss_scale": 256.0},
            {"loss_scale": 128.0},
            "the checkpoint's loss scale is static (loss_scale=256.0) and this job's is static "
            "(loss_scale=128.0)",
        ),
    ],
    ids=["dynamic-into-static", "static-into-dynamic", "static-256-into-128"],
)
def test_another_loss_scale_setting_is_refused(tmp_path, saved, loading, message):
    path = str(tmp_path / "ck")
    model, opt = _job(use_aux=True, **saved)
    _train(model, opt, range(2))
    mixprec.save_checkpoint(path, model, opt)
    job, job_opt = _job(use_aux=True, **loading)
    assert _unchanged_by_failed_load(path, job, job_opt) == (
        f"{message}: initialize this job with the checkpoint's setting (or pass a "
        f"mixprec.GradScaler with it as scaler=), or load a checkpoint saved with this job's. "
        f"Nothing was changed."
    )


def test_another_dynamic_growth_rule_is_refused_and_the_same_loads(tmp_path):
    path = str(tmp_path / "ck")
    model, opt = _job(use_aux=True, loss_scale="dynamic")
    _train(model, opt, range(2))
    mixprec.save_checkpoint(path, model, opt)
    job, job_opt = _job(use_aux=True, loss_scale="dynamic", max_loss_scale=2.0**10)
    assert _unchanged_by_failed_load(path, job, job_opt) == (
        "the checkpoint's dynamic loss scale moves by another rule than this job's: "
        "max_scale=16777216.0 (this job: 1024.0). Create this job's scaler with the "
        "checkpoint's settings (initialize's min_loss_scale/max_loss_scale, or a "
        "mixprec.GradScaler passed as scaler=), and change them after loading if you mean to "
        "(scaler.set_growth_interval(), ...). Nothing was changed."
    )
    static, static_opt = _job(loss_scale=128.0)  # the same static scale loads
    mixprec.save_checkpoint(str(tmp_path / "static"), static, static_opt)
    other, other_opt = _job(loss_scale=128.0)
    mixprec.load_checkpoint(str(tmp_path / "static"), other, other_opt)
    assert other_opt.scaler.state_dict() == static_opt.scaler.state_dict()
