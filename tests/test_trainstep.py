"""TrainStep on the CPU: the eager step against the plain loop, and the capture logic.

The eager step must give the same losses, skip decisions and parameters, bit for bit, as the
loop a user writes by hand (mixprec.autocast + GradScaler, or initialize + scale_loss). The
capture bookkeeping (warm-up, one graph per input signature, staleness, fallbacks) is tested
with a stand-in backend that runs the step where CUDA would record it; test_trainstep_replay.py
replays recorded kernels only; the real CUDA graphs are tested in test_trainstep_cuda.py.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_unflatten

import mixprec
from mixprec.levels.model import amp_hooks
from mixprec.step import graphs
from tests.helpers import uncompiled_step

STEPS = 50
OVERFLOWS = {3, 4, 17, 30}  # steps whose input holds an inf


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


def _batches(n: int = STEPS, overflows=OVERFLOWS, batch: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(batch, 8, generator=g)
        if i in overflows:
            x[0, 0] = float("inf")
        out.append((x, torch.randint(0, 4, (batch,), generator=g)))
    return out


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
}


def _plain_loop(model, opt, scaler, batches, dtype, clip=None):
    """The hand-written loop TrainStep must reproduce."""
    losses = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        with mixprec.autocast("cpu", dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    return losses


def o1_fp16_pair(make_opt, clip, **step_kw):
    """The plain loop's run over `_batches()`, and a fresh model with its O1 fp16 TrainStep."""
    batches = _batches()
    ref_model = _model()
    ref_scaler = mixprec.GradScaler("cpu", growth_interval=5)
    ref = _plain_loop(ref_model, make_opt(ref_model.parameters()), ref_scaler, batches,
                      torch.float16, clip)  # fmt: skip
    model = _model()
    step = uncompiled_step(model, make_opt(model.parameters()), F.cross_entropy, dtype="fp16",
                           scaler=mixprec.GradScaler("cpu", growth_interval=5),
                           clip_grad_norm=clip, **step_kw)  # fmt: skip
    return batches, ref, ref_model, ref_scaler, model, step


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise equal (NaN losses of skipped steps included)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True)
    )


def _params_equal(m1: torch.nn.Module, m2: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))


# ------------------------------------------------------------------ eager step == the plain loop


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.5])
def test_o1_fp16_step_equals_the_plain_loop_with_overflows(opt_name, clip):
    batches, ref, ref_model, ref_scaler, model, step = o1_fp16_pair(OPTIMIZERS[opt_name], clip)
    losses = [step(x, y) for x, y in batches]
    assert _same(losses, ref)
    assert sum(not torch.isfinite(v) for v in losses) == len(OVERFLOWS)
    assert _params_equal(model, ref_model)
    ours, theirs = step.scaler.stats()["losses"][0], ref_scaler.stats()["losses"][0]
    assert ours == theirs  # scale, trackers, skip count, last skip
    # The planted overflows, plus natural ones (2**16 at the start, growth every 5 steps).
    assert ours["skipped"] > len(OVERFLOWS)
    assert not step.captured and "compile=False was requested" in step.reason


def test_default_scaler_of_the_opt_level_matches_torch_defaults():
    batches = _batches(20, overflows={2})
    ref_model = _model()
    ref_scaler = mixprec.GradScaler("cpu")
    ref = _plain_loop(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.05), ref_scaler,
                      batches, torch.float16)  # fmt: skip
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.05),
                           F.cross_entropy, dtype=torch.float16)  # fmt: skip
    assert _same([step(x, y) for x, y in batches], ref)
    assert step.scaler.get_scale() == ref_scaler.get_scale() == 2.0**15


def test_o2_step_equals_initialize_and_scale_loss():
    batches = _batches(30, overflows={5, 6})
    ref_model = _model()
    ref_model, ref_opt = mixprec.initialize(
        ref_model, torch.optim.Adam(ref_model.parameters(), lr=1e-2), "O2", dtype="fp16"
    )
    ref = []
    for x, y in batches:
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref_model(x), y)
        with mixprec.scale_loss(loss, ref_opt) as scaled:
            scaled.backward()
        ref_opt.step()
        ref.append(loss.detach())

    model = _model()
    step = uncompiled_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), F.cross_entropy,
                           opt_level="O2", dtype="fp16")  # fmt: skip
    assert _same([step(x, y) for x, y in batches], ref)
    assert _params_equal(model, ref_model)
    assert model[0].weight.dtype == torch.float16 and model[1].weight.dtype == torch.float32
    assert _same(list(mixprec.master_params(step.optimizer)), list(mixprec.master_params(ref_opt)))
    assert step.optimizer.loss_scale == ref_opt.loss_scale


def test_bf16_o1_without_scaler_and_o3():
    batches = _batches(10, overflows=())
    for level in ("O1", "O3"):
        model = _model()
        step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               F.cross_entropy, opt_level=level)  # fmt: skip
        assert step.scaler is None and step.options.dtype == torch.bfloat16
        x, y = batches[0]
        losses = [step(x, y) for _ in range(10)]  # one batch, ten steps: it must fit it
        assert losses[-1] < 0.9 * losses[0]
    # O1 bf16 equals the plain autocast loop without a scaler.
    ref_model = _model()
    opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref = []
    for x, y in batches:
        opt.zero_grad()
        with mixprec.autocast("cpu"):
            loss = F.cross_entropy(ref_model(x), y)
        loss.backward()
        opt.step()
        ref.append(loss.detach())
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    assert _same([step(x, y) for x, y in batches], ref)


def test_o1_gives_the_loss_the_outputs_as_computed_and_says_why():
    # The loss runs under the forward's region, as in torch.amp's loop (the test above checks
    # the values bit for bit), so O1's fp32 outputs, which serve a loss computed outside the
    # model, are not applied; the printed options say why. A caller's choice wins.
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                           dtype="fp16")  # fmt: skip
    x, _ = _batches(1)[0]
    assert step.options.cast_model_outputs is None and model(x).dtype == torch.float16
    assert "= None       (TrainStep runs the loss in the forward's region)" in str(step.options)
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                           dtype="fp16", cast_model_outputs="fp32")  # fmt: skip
    assert model(x).dtype == torch.float32 and "(set by the caller)" in str(step.options)


def test_compute_loss_and_lr_scheduler():
    batches = _batches(12, overflows={4})

    def compute(model, x, y):
        out = model(x)
        return F.cross_entropy(out, y) + 1e-3 * out.float().pow(2).mean()

    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.5)
    ref_scaler = mixprec.GradScaler("cpu")
    ref = []
    for x, y in batches:
        ref_opt.zero_grad()
        with mixprec.autocast("cpu", dtype=torch.float16):
            loss = compute(ref_model, x, y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_sched.step()
        ref.append(loss.detach())

    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           compute_loss=compute, dtype="fp16")  # fmt: skip
    sched = torch.optim.lr_scheduler.StepLR(step.optimizer, step_size=3, gamma=0.5)
    losses = []
    for x, y in batches:
        losses.append(step(x, y))
        sched.step()
    assert _same(losses, ref) and _params_equal(model, ref_model)


# ------------------------------------------------------------------ checkpoints


def test_save_and_resume_continues_bitwise():
    batches = _batches(30, overflows={3, 20})

    def make():
        model = _model()
        return uncompiled_step(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                               F.cross_entropy, opt_level="O2", dtype="fp16")  # fmt: skip

    full = make()
    expected = [full(x, y) for x, y in batches]
    first = make()
    losses = [first(x, y) for x, y in batches[:15]]
    blob = pickle.dumps(first.state_dict())
    resumed = make()
    resumed.load_state_dict(pickle.loads(blob))
    losses += [resumed(x, y) for x, y in batches[15:]]
    assert _same(losses, expected)
    assert _params_equal(resumed.model, full.model)


def test_bad_state_dict_is_refused_and_changes_nothing():
    model = _model()
    step = uncompiled_step(model, torch.optim.Adam(model.parameters(), lr=1e-2),
                           F.cross_entropy, dtype="fp16")  # fmt: skip
    for x, y in _batches(3, overflows=()):
        step(x, y)
    good = step.state_dict()
    before = copy.deepcopy(good)
    with pytest.raises(mixprec.TrainStepError, match="format"):
        step.load_state_dict({"model": {}})
    broken = copy.deepcopy(good)
    broken["model"]["0.weight"] = torch.zeros(3, 3)
    with pytest.raises(mixprec.TrainStepError, match="do not match"):
        step.load_state_dict(broken)
    broken = copy.deepcopy(good)
    broken["optimizer"]["opt_level"] = "O3"
    with pytest.raises(mixprec.MixprecError, match="opt level"):
        step.load_state_dict(broken)
    after = step.state_dict()
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    assert after["optimizer"]["scaler"] == before["optimizer"]["scaler"]


# ------------------------------------------------------------------ errors


def test_errors_say_what_to_do():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(mixprec.PolicyError, match="exactly one of loss_fn"):
        uncompiled_step(model, opt)
    with pytest.raises(mixprec.PolicyError, match="'auto', 'compile', 'cuda_graph' or 'eager'"):
        uncompiled_step(model, opt, F.cross_entropy, capture="graph")
    with pytest.raises(mixprec.PolicyError, match="warmup=0"):
        uncompiled_step(model, opt, F.cross_entropy, warmup=0)
    with pytest.raises(mixprec.PolicyError, match="clip_grad_norm"):
        uncompiled_step(model, opt, F.cross_entropy, clip_grad_norm=-1)
    with pytest.raises(mixprec.PolicyError, match="mixprec.GradScaler takes the same"):
        uncompiled_step(model, opt, F.cross_entropy, scaler=torch.amp.GradScaler("cpu"))
    untouched = _model()
    with pytest.raises(mixprec.TrainStepError, match="CUDA graphs need a CUDA device"):
        uncompiled_step(untouched, torch.optim.SGD(untouched.parameters(), lr=0.1),
                        F.cross_entropy, opt_level="O2", capture="cuda_graph")  # fmt: skip
    # Refused before initialize: no hooks, weights still fp32.
    assert amp_hooks(untouched) is None and untouched[0].weight.dtype == torch.float32
    with pytest.raises(mixprec.PolicyError, match="unknown opt level"):
        uncompiled_step(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                        F.cross_entropy, opt_level="O5")  # fmt: skip

    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           compute_loss=lambda m, x: m(x))  # fmt: skip
    with pytest.raises(mixprec.TrainStepError, match="one-element tensor"):
        step(torch.randn(2, 8))
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    with pytest.raises(mixprec.TrainStepError, match=r"step\(x, y\)"):
        step(torch.randn(2, 8))


def test_a_scaler_with_several_losses_is_refused_before_initialize():
    # One loss per TrainStep: refused at construction in every capture mode, with the fix,
    # and before initialize touched the model (a corrected call can follow).
    for capture in ("auto", "compile", "eager"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(mixprec.TrainStepError, match="a scaler with num_losses=2, and a "
                           "TrainStep trains one loss.*Sum the losses into one"):  # fmt: skip
            mixprec.TrainStep(model, opt, F.cross_entropy, dtype="fp16", capture=capture,
                              scaler=mixprec.GradScaler("cpu", num_losses=2))  # fmt: skip
        assert amp_hooks(model) is None
    with pytest.raises(mixprec.TrainStepError, match="got num_losses=3"):
        uncompiled_step(model, opt, F.cross_entropy, dtype="fp16", num_losses=3)
    model, opt = mixprec.initialize(model, opt, "O1", dtype="fp16", num_losses=2)
    with pytest.raises(mixprec.TrainStepError, match="an optimizer initialized with num_losses=2"):
        uncompiled_step(model, opt, F.cross_entropy)


def test_misuse_found_by_a_new_user_is_named_with_its_fix():
    x, y = _batches(1, overflows=())[0]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(mixprec.PolicyError, match=r"is a class: pass an instance, loss_fn="):
        uncompiled_step(model, opt, torch.nn.CrossEntropyLoss)
    with pytest.raises(mixprec.PolicyError, match="unknown key 'backnd'. Did you mean 'backend'"):
        mixprec.TrainStep(model, opt, F.cross_entropy, compile={"backnd": "aot_eager"})
    other = _model()
    with pytest.raises(mixprec.MixprecError, match="holds none of the model's parameters"):
        uncompiled_step(model, torch.optim.SGD(other.parameters(), lr=0.1), F.cross_entropy)
    assert amp_hooks(model) is None  # refused before initialize changed anything
    step = uncompiled_step(model, opt, compute_loss=lambda m, a, b: (F.cross_entropy(m(a), b), 0))
    with pytest.raises(mixprec.TrainStepError, match="got tuple. Return only the loss tensor"):
        step(x, y)
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    with torch.no_grad(), pytest.raises(mixprec.TrainStepError, match=r"under torch.no_grad"):
        step(x, y)
    step(x, y)
    assert step.reason.startswith("running eagerly: compile=False was requested"), step.reason


def test_eager_capture_mode_and_explain():
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           F.cross_entropy, capture="eager")  # fmt: skip
    x, y = _batches(1, overflows=())[0]
    loss = step(x, y)
    assert loss.shape == () and not loss.requires_grad
    assert step.reason == "running eagerly: capture='eager' was requested"
    text = step.explain()
    assert "O1" in text and "bfloat16" in text and "eager" in text


# ------------------------------------------------------------------ capture logic (stand-in)


class _StandIn:
    """A capture backend that runs the step where CUDA would record it, and again on replay."""

    executes_on_capture = True

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.captured = 0
        self.replayed = 0

    def capture(self, body, inputs, spec):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured += 1
        loss = body(*tree_unflatten(inputs, spec))
        return [body, inputs, spec, loss], loss

    def replay(self, graph):
        body, inputs, spec, loss = graph
        self.replayed += 1
        loss.copy_(body(*tree_unflatten(inputs, spec)))


def _capturing(step: mixprec.TrainStep, **kw) -> _StandIn:
    backend = _StandIn(**kw)
    step._backend = backend
    step._blocked = None
    return backend


def _sgd_step(**kw):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return uncompiled_step(model, opt, F.cross_entropy, dtype="fp16", **kw)


def test_warmup_then_capture_then_replay_on_new_batches():
    batches = _batches(12, overflows={6})
    reference = _sgd_step()
    expected = [reference(x, y) for x, y in batches]
    step = _sgd_step(warmup=2)
    backend = _capturing(step)
    got, modes = [], []
    for x, y in batches:
        got.append(step(x, y))
        modes.append(step.captured)
    assert modes == [False, False] + [True] * 10
    assert backend.captured == 1 and backend.replayed == 9
    # Replays read the batch copied into the static inputs: same numbers as eager steps.
    assert _same(got, expected) and _params_equal(step.model, reference.model)
    assert step.reason.startswith("replaying the CUDA graph captured for input [16x8 float32")
    assert step.scaler.stats() == reference.scaler.stats()


def test_one_graph_per_input_signature_with_a_bounded_cache():
    step = _sgd_step(warmup=1, max_graphs=2)
    backend = _capturing(step)
    sizes = [4, 4, 8, 8, 16, 16, 4, 4]
    for n in sizes:
        x, y = _batches(1, overflows=(), batch=n)[0]
        step(x, y)
    # 4: warm, capture; 8: warm, capture; 16: warm, capture (evicts 4); 4 again: warm, capture.
    assert backend.captured == 4 and len(step._graphs) == 2
    assert "4x8 float32" in step.reason


def test_lr_change_invalidates_and_recaptures_after_warmup():
    step = _sgd_step(warmup=2)
    backend = _capturing(step)
    batches = _batches(10, overflows=())
    for x, y in batches[:4]:
        step(x, y)
    assert backend.captured == 1 and step.captured
    step.optimizer.param_groups[0]["lr"] = 0.01
    step(*batches[4])
    assert not step.captured
    assert "lr of param group 0 (0.05 -> 0.01)" in step.reason
    step(*batches[5])
    assert not step.captured and "warming up" in step.reason
    step(*batches[6])
    assert step.captured and backend.captured == 2


def test_a_per_step_schedule_never_captures_a_stale_graph():
    step = _sgd_step(warmup=2)
    backend = _capturing(step)
    sched = torch.optim.lr_scheduler.ExponentialLR(step.optimizer, gamma=0.9)
    for x, y in _batches(8, overflows=()):
        step(x, y)
        sched.step()
    assert backend.captured == 0 and "changed since the last step" in step.reason


def test_freezing_layers_and_eval_mode_invalidate():
    step = _sgd_step(warmup=1)
    _capturing(step)
    batches = _batches(6, overflows=())
    step(*batches[0])
    step(*batches[1])
    assert step.captured
    step.model[0].weight.requires_grad_(False)
    step(*batches[2])
    assert "which parameters require grad" in step.reason
    step.model.eval()
    step(*batches[3])
    assert "model.training (True -> False)" in step.reason


def test_loading_a_state_dict_drops_the_graphs():
    step = _sgd_step(warmup=1)
    backend = _capturing(step)
    batches = _batches(6, overflows=())
    for x, y in batches[:3]:
        step(x, y)
    saved = step.state_dict()
    step.load_state_dict(saved)
    assert not step._graphs
    step(*batches[3])
    assert not step.captured
    step(*batches[4])
    assert step.captured and backend.captured == 2


def test_inputs_that_cannot_be_captured_run_eagerly_and_say_why():
    step = _sgd_step(warmup=1)
    _capturing(step)
    x, y = _batches(1, overflows=())[0]
    step(x.clone().requires_grad_(), y)
    assert not step.captured and "requires grad" in step.reason

    model = _model()
    other = uncompiled_step(
      model, torch.optim.SGD(model.parameters(), lr=0.1), warmup=1,
      compute_loss=lambda m, x, y, cfg: F.cross_entropy(m(x), y),
  )  # fmt: skip
    backend = _capturing(other)
    other(x, y, {"scale": 1.0, "tags": ("a", "b")})  # nested and hashable: part of the key
    other(x, y, {"scale": 1.0, "tags": ("a", "b")})
    assert other.captured and backend.captured == 1
    other(x, y, {"scale": 1.0, "tags": bytearray(b"a")})
    assert not other.captured and "neither a tensor nor hashable" in other.reason


def test_a_failed_capture_falls_back_and_keeps_the_numbers():
    batches = _batches(8, overflows={5})
    reference = _sgd_step()
    expected = [reference(x, y) for x, y in batches]
    step = _sgd_step(warmup=2)
    _capturing(step, fail=True)
    got = [step(x, y) for x, y in batches]
    assert _same(got, expected) and _params_equal(step.model, reference.model)
    assert "capture failed (RuntimeError: operation not permitted" in step.reason
    strict = _sgd_step(warmup=1, capture="eager")
    _capturing(strict, fail=True)
    strict.capture_mode = "cuda_graph"
    strict(*batches[0])
    with pytest.raises(mixprec.TrainStepError, match="cannot capture"):
        strict(*batches[1])


def test_state_left_on_the_cpu_blocks_capture_with_the_fix():
    # A GPU model whose optimizer keeps a counter on the CPU, emulated with a meta parameter.
    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    opt = torch.optim.Adagrad([param], lr=0.1)
    opt.state[param]["step"] = torch.tensor(1.0)
    reason = graphs.capture_blocker(opt, torch.device("meta"))
    assert reason is not None and "keeps state 'step' on cpu" in reason and "capturable" in reason
    assert graphs.capture_blocker(torch.optim.SGD([param], lr=0.1), torch.device("meta")) is None


def test_prepare_makes_adam_capturable_with_a_device_lr():
    param = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.Adam([param], lr=1e-3)
    notes = graphs.prepare(opt, torch.device("cpu"))
    group = opt.param_groups[0]
    assert group["capturable"] is True and isinstance(group["lr"], torch.Tensor)
    assert len(notes) == 2 and "capturable=True" in notes[0] and "device tensor" in notes[1]
    sgd = torch.optim.SGD([param], lr=0.1)
    assert graphs.prepare(sgd, torch.device("cpu")) == [] and sgd.param_groups[0]["lr"] == 0.1


def test_on_skip_reports_replayed_overflows():
    events = []
    scaler = mixprec.GradScaler("cpu", on_skip=events.append, check_every=4)
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.05), F.cross_entropy,
                           dtype="fp16", scaler=scaler, warmup=1)  # fmt: skip
    _capturing(step)
    for x, y in _batches(12, overflows={2, 9}):
        step(x, y)
    assert [e.step for e in events] == [2, 9]


# ------------------------------------------------------------------ a batch that does not fit


def _frames(tb) -> list[str]:
    out = []
    while tb is not None:
        out.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return out


def test_a_batch_that_does_not_fit_gives_a_short_error_naming_element_shape_and_cause():
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(mixprec.TrainStepError) as info:
        step(torch.randn(16, 5), torch.randint(0, 4, (16,)))  # the model takes 8 features
    err = info.value
    message = str(err)
    assert message.startswith("batch element 0 (shape (16, 5), float32) does not fit the model")
    assert "module '0' (Linear(in_features=8, out_features=32, bias=True)) raised RuntimeError" in (
        message
    )
    assert "mat1 and mat2 shapes cannot be multiplied (16x5 and 8x32)" in message
    assert "batch[1] (target): shape (16,), int64" in message
    # The model's own error is chained; neither traceback walks through mixprec's machinery.
    assert isinstance(err.__cause__, RuntimeError)
    mixprec_dir = str(__import__("pathlib").Path(mixprec.__file__).parent)
    assert not any(f.startswith(mixprec_dir) for f in _frames(err.__cause__.__traceback__))
    assert len(_frames(err.__traceback__)) <= 2  # this test's line and TrainStep.__call__
    # Nothing changed, and the next good batch trains.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    loss = step(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    assert torch.isfinite(loss)


def test_a_target_that_does_not_fit_names_the_models_output():
    model = _model()
    step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy,
                           opt_level="O2")  # fmt: skip
    with pytest.raises(mixprec.TrainStepError) as info:
        step(torch.randn(16, 8), torch.randint(0, 4, (15,)))
    message = str(info.value)
    assert message.startswith("the target does not fit the model's output: loss_fn raised")
    assert "The model's output: shape (16, 4), float32" in message
    assert "batch[1] (target): shape (15,), int64" in message
    with pytest.raises(mixprec.TrainStepError, match="compute_loss raised ValueError"):
        uncompiled_step(model, step.optimizer, compute_loss=lambda m, x, y: F.cross_entropy(
          m(x), y))(torch.randn(16, 8), torch.randint(0, 4, (15,)))  # fmt: skip
