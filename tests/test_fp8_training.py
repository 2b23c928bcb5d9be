"""FP8 layers inside training: initialize, skipped steps, TrainStep capture, checkpoints, compile,
diagnostics, and short training runs against bf16. CPU only; about half a minute.

- A step the loss scaler skips leaves every FP8 history and scale bitwise as it was, as it
  leaves the optimizer's state: a run with skipped batches ends bitwise equal to a run that
  never saw them (parameters, optimizer state and FP8 state).
- TrainStep's captured path (the kernel-replay stand-in for a CUDA graph, which replays aten
  and custom ops with no Python and refuses host reads) gives the eager step's numbers bit for
  bit, FP8 state included; so the FP8 scales update on the device without a sync.
- A checkpoint restores the FP8 state: a resumed run equals the uninterrupted one bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import mixprec
from mixprec.bench.data import token_stream
from mixprec.bench.models import GPT, GPTConfig, seed_mlp
from mixprec.fp8 import Fp8Linear, fp8_layers
from tests.helpers import uncompiled_step
from tests.replay_backend import install

RECIPES = ["tensorwise", "delayed", "rowwise"]


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 4))  # fmt: skip


def _batches(n: int, inf_at=(), seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(24, 16, generator=g)
        if i in inf_at:
            x[0, 0] = math.inf
        out.append((x, torch.randint(0, 4, (24,), generator=g)))
    return out


def _fp8_state(model: nn.Module) -> list[torch.Tensor]:
    return [t for _, m in fp8_layers(model) for t in (m.fp8_history, m.fp8_scale)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bitwise equal (NaN losses of skipped steps included)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(_bits(x), _bits(y)) for x, y in zip(a, b, strict=True)
    )


def _opt_state(opt) -> list[torch.Tensor]:
    return [v for s in opt.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor)]  # fmt: skip


# ------------------------------------------------------------------ skipped steps


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_skipped_step_leaves_fp8_state_as_it_leaves_the_optimizer(level, recipe):
    batches, skipped = _batches(9), {2, 5, 6}

    def run(use: list[int], poison: set[int]):
        model = _mlp()
        model, opt = mixprec.initialize(
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, dtype="bf16",
            fp8=recipe, loss_scale=1024.0,
        )  # fmt: skip
        states = []
        for i in use:
            x, y = batches[i]
            opt.zero_grad()
            loss = F.cross_entropy(model(x).float(), y)
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if i in poison:  # an overflow in one gradient only: the forward was finite
                    next(p for p in model.parameters() if p.grad is not None).grad[0] = math.inf
            before = [t.clone() for t in _fp8_state(model)]
            opt.step()
            if i in poison:
                assert bool(opt.scaler.step_skipped(opt.optimizer))
                assert _bitwise(_fp8_state(model), before)  # nothing moved on the skip
            states.append(before)
        return model, opt

    a, opt_a = run(list(range(9)), skipped)
    b, opt_b = run([i for i in range(9) if i not in skipped], set())
    assert len(fp8_layers(a)) == 2
    assert _bitwise(list(a.state_dict().values()), list(b.state_dict().values()))
    assert _bitwise(_opt_state(opt_a), _opt_state(opt_b))
    assert _bitwise(_fp8_state(a), _fp8_state(b))
    if recipe == "delayed":  # the history advanced once per step that ran: 6 entries
        hist = fp8_layers(a)[0][1].fp8_history
        assert int((hist[0] > 0).sum()) == 6


# ------------------------------------------------------------------ TrainStep capture


@pytest.mark.parametrize("recipe", RECIPES)
def test_replayed_fp8_trainstep_equals_eager_steps_with_overflows(recipe):
    batches = _batches(10, inf_at={4, 7})
    kw = dict(opt_level="O1", dtype="bf16", fp8=recipe, loss_scale=1024.0)
    eager_model, replay_model = _mlp(), _mlp()
    eager = uncompiled_step(eager_model, torch.optim.AdamW(eager_model.parameters(), lr=1e-2,
                            fused=True), F.cross_entropy, capture="eager", **kw)  # fmt: skip
    step = uncompiled_step(replay_model, torch.optim.AdamW(replay_model.parameters(), lr=1e-2,
                           fused=True), F.cross_entropy, warmup=2, **kw)  # fmt: skip
    backend = install(step)
    ref = [eager(x, y) for x, y in batches]
    got = [step(x, y) for x, y in batches]
    assert backend.captured == 1 and step.captured, step.reason
    assert backend.replayed == len(batches) - 3  # overflowing steps 4 and 7 among the replays
    assert _bitwise(ref, got)
    assert sum(not torch.isfinite(v) for v in got) == 2
    assert _bitwise(list(eager_model.state_dict().values()),
                    list(replay_model.state_dict().values()))  # fmt: skip
    assert _bitwise(_fp8_state(eager_model), _fp8_state(replay_model))


def test_checkpoint_restores_fp8_state_and_resumes_bit_for_bit():
    batches = _batches(8)

    def fresh():
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, uncompiled_step(model, opt, F.cross_entropy, opt_level="O2",
                                      dtype="bf16", fp8="delayed", capture="eager")  # fmt: skip

    model, step = fresh()
    for x, y in batches:
        step(x, y)
    model2, step2 = fresh()
    for x, y in batches[:4]:
        step2(x, y)
    saved = step2.state_dict()
    assert any(k.endswith("fp8_history") for k in saved["model"])
    model3, step3 = fresh()
    step3.load_state_dict(saved)
    assert _bitwise(_fp8_state(model3), _fp8_state(model2))
    for x, y in batches[4:]:
        step3(x, y)
    assert _bitwise(list(model3.state_dict().values()), list(model.state_dict().values()))


def test_a_dcp_checkpoint_of_another_fp8_recipe_or_without_fp8_is_refused_saying_so(tmp_path):
    """DCP loads what the model asks for: an FP8 checkpoint loaded into a model without FP8
    dropped the amax histories and scales silently, and another recipe failed with a bare
    size mismatch. Both are refused before anything changes, naming the recipe."""

    def fresh(**kw):
        model = _mlp()
        return mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2",
                                  dtype="bf16", **kw)  # fmt: skip

    model, opt = fresh(fp8="delayed")
    for x, y in _batches(2):
        with mixprec.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    mixprec.save_checkpoint(str(tmp_path / "ck"), model, opt)
    for kw, match in [({"fp8": "tensorwise"}, "amax history of 16 step.*another FP8 recipe"),
                      ({}, "FP8 layer state .* no place for.*same fp8= recipe")]:  # fmt: skip
        other, other_opt = fresh(**kw)
        before = [t.clone() for t in other.state_dict().values()]
        with pytest.raises(mixprec.DistributedError, match=match):
            mixprec.load_checkpoint(str(tmp_path / "ck"), other, other_opt)
        assert _bitwise(before, list(other.state_dict().values()))
    again, again_opt = fresh(fp8="delayed")
    mixprec.load_checkpoint(str(tmp_path / "ck"), again, again_opt)  # the same recipe loads
    assert _bitwise(_fp8_state(again), _fp8_state(model))


# ------------------------------------------------------------------ module swap and casts


def test_to_fp8_shares_parameters_hooks_and_keeps_fp8_state_in_fp32():
    model = _mlp()
    seen = []
    model[2].register_forward_hook(lambda m, a, o: seen.append(type(m).__name__))
    weights = [p for p in model.parameters()]
    mixprec.to_fp8(model, "delayed")
    assert [p for p in model.parameters()] == weights  # the same Parameter objects
    assert isinstance(model[2], Fp8Linear) and not isinstance(model[0], Fp8Linear)
    model(torch.randn(3, 16))
    assert seen == ["Fp8Linear"]
    model.bfloat16()
    assert model[2].weight.dtype is torch.bfloat16
    assert all(t.dtype is torch.float32 for t in _fp8_state(model))
    o2 = _mlp()
    o2, _ = mixprec.initialize(o2, torch.optim.SGD(o2.parameters(), lr=0.1), "O2", dtype="bf16",
                               fp8="delayed")  # fmt: skip
    assert o2[2].weight.dtype is torch.bfloat16 and o2[2].fp8_scale.dtype is torch.float32
    with pytest.raises(mixprec.PolicyError, match="already runs FP8 recipe"):
        mixprec.to_fp8(model, "tensorwise")


def test_a_layer_called_twice_before_backward_records_both_gradients():
    layer = Fp8Linear(16, 16, bias=False, recipe="delayed")
    a, b = torch.randn(4, 16), torch.randn(4, 16)
    (layer(a).sum() + (layer(b) * 100).sum()).backward()  # a siamese use of one layer
    ref = Fp8Linear(16, 16, bias=False, recipe="delayed")
    ref.weight.data.copy_(layer.weight)
    (ref(b) * 100).sum().backward()
    assert layer.pending_grad_amax().item() == ref.pending_grad_amax().item() > 0
    mixprec.fp8_update([layer])
    assert layer.fp8_history[2, 0].item() == ref.pending_grad_amax().item()


# ------------------------------------------------------------------ presets and policy


def test_describe_and_initialize_turn_fp8_on_with_reasons():
    text = str(mixprec.describe("O2", device_type="cpu", fp8="rowwise"))
    assert "With FP8" in text and "rowwise: dynamic rowwise, e4m3/e4m3" in text
    assert "fp8 layers             = auto" in text
    options = mixprec.describe("O1", device_type="cpu", policy="fp8=all")
    assert options.fp8 is not None and options.fp8.name == "tensorwise"  # the policy turned it on
    assert mixprec.describe("O1", device_type="cpu", policy="fp8=all", fp8=False).fp8 is None
    with pytest.raises(mixprec.PolicyError, match="O0 is the fp32 baseline"):
        mixprec.describe("O0", device_type="cpu", fp8="tensorwise")
    model = _mlp()
    model, _ = mixprec.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                  dtype="bf16", policy="fp8=auto+!2")  # fmt: skip
    assert [n for n, _ in fp8_layers(model)] == ["4"]


def test_policy_module_rules_round_trip_and_explain_their_decisions():
    p = mixprec.Policy.from_string("compute=bf16,fp32=softmax,fp8=auto+!blocks.1.*")
    assert str(p) == "compute=bf16,fp32=softmax,fp8=auto+!blocks.1.*"
    assert mixprec.Policy.from_string(str(p)) == p
    plan = {d.module: d for d in p.plan_fp8(GPT(GPTConfig.tiny()))}
    assert "first linear layer" in plan["blocks.0.attn.qkv"].reason
    assert "last linear layer" in plan["head"].reason
    assert plan["blocks.0.fc"].fp8 and "selected by fp8=auto" in plan["blocks.0.fc"].reason
    assert not plan["blocks.1.fc"].fp8 and "kept out of FP8 by fp8=!blocks.1.*" in str(
        plan["blocks.1.fc"]
    )
    odd = mixprec.Policy().fp8("all").plan_fp8(nn.Sequential(nn.Linear(10, 16)))
    assert not odd[0].fp8 and "in_features=10 not a multiple of 16" in odd[0].reason
    with pytest.raises(mixprec.PolicyError, match="ops cannot be moved to 'fp8'"):
        mixprec.Policy().move("mm", to="fp8")
    with pytest.raises(mixprec.PolicyError, match="without a scope"):
        mixprec.Policy.from_string("fp8@cuda=auto")
    with pytest.raises(mixprec.PolicyError, match="no spaces"):
        mixprec.Policy().fp8("blocks 1")


@settings(max_examples=100, deadline=None)
@given(
    edits=st.lists(st.tuples(st.sampled_from(["fp32", "lower", "promote"]),
                             st.sampled_from(["softmax", "mm", "gelu"])), max_size=3),
    rules=st.lists(st.tuples(st.booleans(), st.sampled_from(["auto", "all", "head", "blocks.*.fc",
                                                             "blocks.?.attn.*"])), max_size=4),
)  # fmt: skip
def test_module_rules_round_trip_with_op_edits(edits, rules):
    p = mixprec.Policy(compute="bf16")
    for cat, op in edits:
        p = p.move(op, to=cat)
    for keep_out, sel in rules:
        p = p.fp8(("!" if keep_out else "") + sel)
    assert mixprec.Policy.from_string(str(p)) == p
    assert ("fp8=" in str(p)) == bool(rules)


def test_explain_shows_fp8_layers_with_reason_scales_and_error():
    model = GPT(GPTConfig.tiny())
    plan = mixprec.explain(model, torch.randint(0, 512, (2, 16)), device_type="cpu",
                           policy="fp8=auto")  # fmt: skip
    assert plan.fp8 is None and sum(d.fp8 for d in plan.fp8_plan) == 7
    assert "FP8 plan of the policy's rules" in str(plan)
    mixprec.to_fp8(model)
    report = mixprec.explain(model, torch.randint(0, 512, (2, 16)), device_type="cpu")
    rows = [r for r in report.rows if r["op"] == "mixprec::fp8_linear"]
    assert len(rows) == 7 and all(r["category"] == "fp8" for r in rows)
    assert "selected by fp8=auto" in rows[0]["reason"]
    assert len(report.fp8) == 7 and all(0.005 < s.error < 0.1 for s in report.fp8)
    assert report.flops["forward"]["fp8"] > 0
    assert not any(m.measure_error for _, m in fp8_layers(model))  # only during explain


def test_watch_checks_fp8_models_and_reports_their_error():
    model = GPT(GPTConfig.tiny())
    mixprec.to_fp8(model, "delayed")
    with mixprec.watch_nonfinite(model, fp8_error=True) as watch:
        model(torch.randint(0, 512, (2, 16))).float().sum().backward()
    assert watch.first is None
    report = watch.fp8()
    assert all(s.error is not None and s.amax[2] > 0 for s in report)
    assert "FP8 layers: 7" in str(report) and report.to_json().startswith("[")


@pytest.mark.compile
def test_compiled_fp8_model_matches_eager_and_updates_state():
    x = torch.randn(24, 16)
    eager, compiled = _mlp(), _mlp()
    for m in (eager, compiled):
        mixprec.to_fp8(m, "delayed")
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ref = eager(x)
    ref.float().sum().backward()
    fn = mixprec.compile(compiled, dtype="bf16", backend="aot_eager", kernels="native")
    out = fn(x)
    out.float().sum().backward()
    assert torch.equal(out, ref)
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    for (_, a), (_, b) in zip(fp8_layers(eager), fp8_layers(compiled), strict=True):
        assert torch.equal(a.fp8_fwd, b.fp8_fwd) and torch.equal(a.fp8_bwd, b.fp8_bwd)
        assert a.fp8_bwd[0] > 0  # the compiled backward recorded the gradient's amax


# ------------------------------------------------------------------ training against bf16


def _train(model, fp8, batches, loss_of, lr):
    model, opt = mixprec.initialize(model, torch.optim.AdamW(model.parameters(), lr=lr), "O1",
                                    dtype="bf16", **({"fp8": fp8} if fp8 else {}))  # fmt: skip
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_of(model, batch)
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return sum(losses[-10:]) / 10, losses[0]


def _mlp_task():
    torch.manual_seed(0)
    teacher = torch.randn(64, 8)
    data = [(x, x @ teacher) for x in torch.randn(100, 32, 64)]

    def make():
        torch.manual_seed(1)
        return nn.Sequential(seed_mlp(64, 4), nn.Linear(64, 8))

    def loss_of(model, batch):
        return F.mse_loss(model(batch[0]).float(), batch[1])

    return make, data, loss_of, 0.15


def _gpt_task():
    def make():
        torch.manual_seed(1)
        return GPT(GPTConfig.tiny())

    def loss_of(model, tokens):
        logits = model(tokens[:, :-1]).float()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return make, token_stream(512, 8, 33, 40), loss_of, 0.03


TASKS = {"mlp": _mlp_task, "gpt": _gpt_task}


@pytest.fixture(scope="module")
def bf16_runs():
    """The bf16 (O1) reference run of each task, trained once for all recipes."""
    out = {}
    for name, task in TASKS.items():
        make, data, loss_of, _ = task()
        out[name] = _train(make(), None, data, loss_of, 3e-3)
    return out


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_training_tracks_bf16_on_the_seed_mlp_and_gpt(recipe, task, bf16_runs):
    # Same seed, same batches: FP8's loss curve must stay close to bf16's. (The seed-to-seed
    # comparison over a few hundred steps is benchmarks/fp8_training.py.)
    make, data, loss_of, tol = TASKS[task]()
    ref_end, ref_start = bf16_runs[task]
    end, start = _train(make(), recipe, data, loss_of, 3e-3)
    assert start == pytest.approx(ref_start, rel=0.05)
    assert end < 0.8 * start  # it learned
    assert abs(end - ref_end) <= tol * ref_end, (end, ref_end)


def test_the_fp8_step_makes_no_tensor_from_host_data():
    # A CUDA graph cannot record a host-to-device copy of Python values (torch.tensor(list)
    # on the device): the FP8 forward, backward and update must build every tensor on the
    # device. On the CPU such a tensor shows up as aten.lift_fresh.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func._overloadpacket)
            return func(*args, **(kwargs or {}))

    for recipe in RECIPES:
        model = _mlp()
        mixprec.to_fp8(model, recipe)
        model(torch.randn(4, 16)).sum().backward()  # first call: lazy set-up, probes
        with Ops() as ops:
            model(torch.randn(4, 16)).sum().backward()
            mixprec.fp8_update(model, skipped=torch.zeros(()))
        assert torch.ops.mixprec.fp8_linear in ops.seen
        assert torch.ops.aten.lift_fresh not in ops.seen, recipe


def test_a_layer_with_large_fp8_error_is_reported_with_the_edit_that_keeps_it_out():
    model = nn.Sequential(nn.Linear(32, 32))
    mixprec.to_fp8(model, "tensorwise", policy="fp8=all")
    with torch.no_grad():
        model[0].weight[:, 0] = 0.0  # input feature 0 does not reach the output ...
    x = torch.randn(64, 32)
    x[:, 0] = 1e5  # ... but sets the tensorwise scale: the other inputs fall below e4m3's range
    report = mixprec.explain(model, x, device_type="cpu").fp8
    (layer,) = report.layers
    assert layer.large_error and layer.error > 0.1
    assert report.suggestions() == [
        f"0: FP8 error {layer.error:.1%} > 10%; keep it in the low dtype with policy.fp8('!0')"
    ]
    assert "suggested: 0: FP8 error" in str(report)


@pytest.mark.compile
def test_compiled_fp8_trainstep_equals_its_eager_steps():
    # TrainStep(compile=...) under O1 re-traces model and loss through mixprec's graph backend
    # (the FP8 ops are single nodes there, their state updates included) and compiles the
    # update after backward, the FP8 scale update included. aot_eager runs the same kernels,
    # so losses and FP8 state agree bit for bit; the compiled update holds the lr as a tensor
    # (SGD then multiplies by it instead of taking it as alpha), hence the weights' last ulp.
    batches = _batches(4)
    runs = []
    for compile_arg in (False, {"backend": "aot_eager", "kernels": "native"}):
        model = _mlp()
        step = uncompiled_step(model, torch.optim.SGD(model.parameters(), lr=0.05),
                               F.cross_entropy, opt_level="O1", dtype="bf16", fp8="delayed",
                               compile=compile_arg, capture="eager")  # fmt: skip
        losses = [step(x, y) for x, y in batches]
        runs.append((losses, _fp8_state(model), [p.detach() for p in model.parameters()]))
    (ref, ref_state, ref_params), (got, state, params) = runs
    assert _bitwise(ref, got) and _bitwise(ref_state, state)
    torch.testing.assert_close(params, ref_params, rtol=1e-6, atol=1e-7)
    assert int((state[0][0] > 0).sum()) == len(batches)  # the history advanced every step
