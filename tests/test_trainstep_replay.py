"""TrainStep's captured path on the CPU, with a backend that replays kernels only.

`tests/replay_backend.py` records a step's aten ops and replays them with no Python, autograd
or host reads, like a CUDA graph. A replayed step must equal the eager step bit for bit: any
per-step decision TrainStep left on the host (found_inf read back, a Python step counter, a
host lr) would freeze at its capture-time value and break the equality. These tests stand in
for test_trainstep_cuda.py's capture-vs-eager agreement until a GPU runs that file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mixprec
from tests.helpers import uncompiled_step
from tests.replay_backend import install
from tests.test_trainstep import OVERFLOWS, _batches, _model, _params_equal, _same, o1_fp16_pair

CAPTURABLE = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


@pytest.mark.parametrize("opt_name", sorted(CAPTURABLE))
@pytest.mark.parametrize("clip", [None, 0.5])
def test_replayed_o1_fp16_steps_equal_the_plain_loop_with_overflows(opt_name, clip):
    pair = o1_fp16_pair(CAPTURABLE[opt_name], clip, warmup=2)
    batches, ref, ref_model, ref_scaler, model, step = pair
    backend = install(step)
    losses, captured = [], []
    for x, y in batches:
        losses.append(step(x, y))
        captured.append(step.captured)
    assert backend.captured == 1, step.reason
    assert captured[:2] == [False, False] and all(captured[2:])
    assert backend.replayed == len(batches) - 2 - 1  # the capture run itself executes
    # Overflowing steps are among the replays: skip decisions are made on the device.
    assert all(captured[i] for i in OVERFLOWS)
    assert _same(losses, ref)
    assert _params_equal(model, ref_model)
    assert step.scaler.stats()["losses"][0] == ref_scaler.stats()["losses"][0]


def test_replayed_o2_and_o3_steps_equal_their_eager_steps():
    for level, dtype in (("O2", "fp16"), ("O3", "bf16")):
        batches = _batches(24, overflows={9, 10} if dtype == "fp16" else set())
        eager_model, replay_model = _model(), _model()
        eager = uncompiled_step(eager_model, torch.optim.SGD(eager_model.parameters(),
                                lr=0.05, momentum=0.9), F.cross_entropy, opt_level=level,
                                dtype=dtype, capture="eager")  # fmt: skip
        step = uncompiled_step(replay_model, torch.optim.SGD(replay_model.parameters(),
                               lr=0.05, momentum=0.9), F.cross_entropy, opt_level=level,
                               dtype=dtype, warmup=1)  # fmt: skip
        backend = install(step)
        ref = [eager(x, y) for x, y in batches]
        got = [step(x, y) for x, y in batches]
        assert backend.captured == 1 and step.captured, (level, step.reason)
        assert _same(got, ref), level
        assert _params_equal(replay_model, eager_model), level


def test_a_host_read_in_the_step_refuses_capture_and_falls_back():
    def compute_loss(model, x, y):
        loss = F.cross_entropy(model(x), y)
        if loss.item() > 1e9:  # a host read: a sync on a GPU, not capturable
            raise AssertionError("unreachable")
        return loss

    batches = _batches(8, overflows=())
    ref_model, model = _model(), _model()
    ref = uncompiled_step(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05),
                          compute_loss=compute_loss, dtype="bf16", capture="eager")  # fmt: skip
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.05),
                           compute_loss=compute_loss, dtype="bf16", warmup=1)  # fmt: skip
    install(step)
    got = [step(x, y) for x, y in batches]
    assert _same(got, [ref(x, y) for x, y in batches])
    assert not step.captured and "capture failed" in step.reason and "capturing" in step.reason
    assert _params_equal(model, ref_model)


def test_replay_of_a_new_input_shape_uses_its_own_graph():
    shapes = [8, 8, 8, 4, 4, 4, 8, 4]
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
               for n in shapes]  # fmt: skip
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05, momentum=0.9)
    ref = uncompiled_step(ref_model, ref_opt, F.cross_entropy, dtype="fp16", capture="eager")
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                           F.cross_entropy, dtype="fp16", warmup=1)  # fmt: skip
    backend = install(step)
    got = [step(x, y) for x, y in batches]
    assert _same(got, [ref(x, y) for x, y in batches])
    assert backend.captured == 2 and _params_equal(model, ref_model)


def test_replay_with_a_step_schedule_on_a_device_lr_recaptures_nothing():
    """Adam's lr on the device (TrainStep's prepare): a schedule changes it without recapture."""
    batches = _batches(20, overflows={7})
    ref_model, model = _model(), _model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    ref = uncompiled_step(ref_model, ref_opt, F.cross_entropy, dtype="fp16", capture="eager")
    step = uncompiled_step(model, opt, F.cross_entropy, dtype="fp16", warmup=1)
    backend = install(step)
    step._prepare()  # what TrainStep does on a CUDA device: capturable settings, device lr
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    got, want = [], []
    for x, y in batches:
        got.append(step(x, y))
        want.append(ref(x, y))
        sched.step()
        ref_sched.step()
    assert backend.captured == 1, step.reason
    torch.testing.assert_close(torch.stack(got), torch.stack(want), equal_nan=True)
    for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("make_opt", [CAPTURABLE["sgd-momentum"], CAPTURABLE["adamw-fused"]])
def test_hand_written_scaler_step_replays_like_eager(make_opt):
    """scale -> backward -> unscale_ -> clip -> step -> update, recorded once and replayed."""
    from torch.utils._pytree import tree_flatten

    from tests.replay_backend import KernelReplay

    def make():
        model = _model()
        return model, make_opt(model.parameters()), mixprec.GradScaler("cpu", growth_interval=3)

    def body(model, opt, scaler, x, y):
        opt.zero_grad(set_to_none=False)  # the graph writes the same .grad tensors every time
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        scaler.step(opt)
        scaler.update()
        return loss.detach()

    batches = _batches(16, overflows={5, 6, 11})
    ref_parts = make()
    ref = [body(*ref_parts, x, y) for x, y in batches]

    model, opt, scaler = make()
    got = [body(model, opt, scaler, *batches[i]) for i in range(2)]  # state and grads exist
    static = [t.clone() for t in batches[2]]
    leaves, spec = tree_flatten(static)
    backend = KernelReplay()
    graph, loss = backend.capture(lambda x, y: body(model, opt, scaler, x, y), leaves, spec)
    got.append(loss.clone())
    for x, y in batches[3:]:
        static[0].copy_(x)
        static[1].copy_(y)
        backend.replay(graph)
        got.append(loss.clone())
    assert _same(got, ref)
    assert _params_equal(model, ref_parts[0])
    ours, theirs = scaler.stats()["losses"][0], ref_parts[2].stats()["losses"][0]
    assert ours == theirs  # scale, trackers, update and skip counts: all updated on the device
    assert theirs["skipped"] >= 3


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("opt_name", ["sgd", "sgd-momentum", "adamw-fused"])
def test_capture_waits_for_the_step_that_creates_the_optimizer_state(opt_name, level):
    # fp16 from scratch: the first steps overflow at the initial scale (ResNet-50 on the H200
    # run), so every warm-up step was skipped and created no optimizer state. The step that
    # creates it is decided on the host (`mixprec.scaling.skip`), which a capture cannot
    # record: the capture failed and the step ran eagerly for good. It now waits for that step.
    batches = _batches(8, overflows={0, 1, 2})
    eager_model, model = _model(), _model()
    eager = uncompiled_step(eager_model, CAPTURABLE[opt_name](eager_model.parameters()),
                            F.cross_entropy, opt_level=level, dtype="fp16",
                            capture="eager")  # fmt: skip
    step = uncompiled_step(model, CAPTURABLE[opt_name](model.parameters()), F.cross_entropy,
                           opt_level=level, dtype="fp16", warmup=2)  # fmt: skip
    backend = install(step)
    ref = [eager(x, y) for x, y in batches]
    got, captured, reasons = [], [], []
    for x, y in batches:
        got.append(step(x, y))
        captured.append(step.captured)
        reasons.append(step.reason)
    assert captured == [False] * 4 + [True] * 4, reasons
    assert "has not created its state" in reasons[2] and "overflowed" in reasons[2]
    assert backend.captured == 1
    assert _same(got, ref) and _params_equal(model, eager_model)
    assert step.scaler.stats()["losses"][0] == eager.scaler.stats()["losses"][0]
