"""TrainStep on a GPU: captured steps against eager ones, step for step, overflows included.

Skipped without CUDA. The reference is the same TrainStep run with capture='eager' over an
optimizer built with the settings capture chooses (capturable=True), so the two differ only in
how the kernels are launched.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.gpu,
]

OVERFLOWS = {4, 5, 13}


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.LayerNorm(128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).cuda()


def _batches(n: int = 24, batch: int = 32, overflows=OVERFLOWS):
    g = torch.Generator(device="cuda").manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(batch, 64, device="cuda", generator=g)
        if i in overflows:
            x[0, 0] = float("inf")
        out.append((x, torch.randint(0, 10, (batch,), device="cuda", generator=g)))
    return out


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, capturable=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}


def _pair(level: str, dtype: str, opt: str, **kw):
    steps = []
    for capture in ("eager", "auto"):
        model = _model()
        steps.append(mixprec.TrainStep(model, OPTIMIZERS[opt](model.parameters()),
                                       F.cross_entropy, opt_level=level, dtype=dtype,
                                       capture=capture, **kw))  # fmt: skip
    return steps


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.isnan(a).item() or torch.isnan(b).item():
        return bool(torch.isnan(a).item() and torch.isnan(b).item())
    return torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "level,dtype,opt",
    [("O1", "fp16", "sgd"), ("O1", "fp16", "adam"), ("O1", "bf16", "adam"),
     ("O2", "fp16", "adam"), ("O1", "fp16", "adamw-fused"), ("O3", "bf16", "sgd")],
)  # fmt: skip
def test_captured_steps_agree_with_eager_steps(level, dtype, opt):
    eager, captured = _pair(level, dtype, opt, clip_grad_norm=1.0)
    # Without a loss scaler (bf16) nothing skips an inf batch: both runs would agree on NaN
    # weights and prove nothing, so those configurations train on finite batches.
    overflows = OVERFLOWS if eager.scaler is not None else ()
    modes = []
    for x, y in _batches(overflows=overflows):
        a, b = eager(x, y), captured(x, y)
        modes.append(captured.captured)
        assert _close(a, b), (a, b)
    assert modes[:2] == [False, False] and all(modes[3:]), captured.explain()
    assert captured.captures == 1 and "replaying" in captured.reason
    for p, q in zip(eager.model.parameters(), captured.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-4)
    if eager.scaler is not None:
        assert eager.scaler.stats()["losses"] == captured.scaler.stats()["losses"]


def test_replays_never_synchronise():
    _, step = _pair("O1", "fp16", "adam")
    batches = _batches(overflows={8})
    for x, y in batches[:4]:
        step(x, y)
    assert step.captured
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[4:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert step.captured


def test_new_input_shapes_get_their_own_graphs():
    _, step = _pair("O1", "fp16", "sgd", warmup=1)
    for n in (32, 32, 16, 16, 32):
        x, y = _batches(1, batch=n, overflows=())[0]
        step(x, y)
    assert step.captures == 2 and step.captured and "32x64" in step.reason


def test_lr_schedules_adam_on_device_sgd_recaptures():
    for opt, recaptures in (("adam", 1), ("sgd", 4)):  # lr changes after steps 6, 12, 18
        eager, captured = _pair("O1", "fp16", opt)
        scheds = [torch.optim.lr_scheduler.StepLR(s.optimizer, step_size=6, gamma=0.5)
                  for s in (eager, captured)]  # fmt: skip
        for x, y in _batches(overflows=()):
            assert _close(eager(x, y), captured(x, y))
            for s in scheds:
                s.step()
        assert captured.captures == recaptures, (opt, captured.explain())


def test_checkpoint_round_trip_and_capture_resumes():
    _, step = _pair("O2", "fp16", "adam")
    batches = _batches()
    for x, y in batches[:8]:
        step(x, y)
    saved = step.state_dict()
    _, resumed = _pair("O2", "fp16", "adam")
    resumed.load_state_dict(saved)
    for x, y in batches[8:]:
        assert _close(step(x, y), resumed(x, y))
    assert resumed.captured


def test_compile_with_capture():
    eager, _ = _pair("O1", "bf16", "adam")
    model = _model()
    step = mixprec.TrainStep(model, OPTIMIZERS["adam"](model.parameters()), F.cross_entropy,
                             dtype="bf16", compile=True)  # fmt: skip
    for x, y in _batches(12, overflows=()):
        a, b = eager(x, y), step(x, y)
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    assert step.captured, step.explain()


def test_compiled_step_is_what_gets_captured_and_skips_without_syncs():
    # compile=True on CUDA: the compiled step (forward graph, update graph) is recorded into the
    # CUDA graph; overflows are skipped inside the replay, and replays never synchronise.
    eager, _ = _pair("O1", "fp16", "adam")
    model = _model()
    step = mixprec.TrainStep(model, OPTIMIZERS["adam"](model.parameters()), F.cross_entropy,
                             dtype="fp16", compile={"kernels": "native"})  # fmt: skip
    batches = _batches()
    for x, y in batches[:4]:
        assert _close(eager(x, y), step(x, y))
    assert step.captured and step.graphs_compiled == 2, step.explain()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [step(x, y) for x, y in batches[4:]]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = [eager(x, y) for x, y in batches[4:]]
    assert all(_close(a, b) for a, b in zip(want, got, strict=True))
    assert eager.scaler.stats()["losses"] == step.scaler.stats()["losses"]
