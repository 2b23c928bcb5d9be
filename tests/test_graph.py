"""Graph-level AMP (`mixprec.compile`, `mixprec.AmpBackend`): the policy applied to whole
captured graphs. References: eager ``torch.autocast`` where the policy is torch's, eager
``mixprec.autocast`` with the same policy otherwise; dynamo's own frame count for graph breaks;
an eager cast count for the cast pass."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig, ResNet50, seed_mlp
from tests.helpers import CastCounter

pytestmark = pytest.mark.compile

dynamo = pytest.importorskip("torch._dynamo")
lists = pytest.importorskip("torch.testing._internal.autocast_test_lists")
from torch._dynamo.testing import CompileCounter  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA_RULES = mixprec.Policy(table="cuda")


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _same(got, want) -> bool:
    g, w = _flat(got), _flat(want)
    return [t.dtype for t in g] == [t.dtype for t in w] and all(
        torch.equal(a, b) for a, b in zip(g, w, strict=True)
    )


# ------------------------------------------------------------- the regression of the issue


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_loss_runs_in_fp32(backend):
    if backend == "inductor":
        pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8)
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))

    def f(x, y):
        return F.cross_entropy(lin(x), y)

    with torch.autocast("cpu", dtype=BF16):
        want = f(x, y)
    got = mixprec.compile(f, backend=backend, dtype=BF16, kernels="native")(x, y)
    assert got.dtype == want.dtype == FP32
    if backend == "inductor":
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(got, want)


# -------------------------------------------------------- torch's autocast lists, as graphs

# One graph per list: each op is its own call on its own inputs, so the ops do not interact,
# and one trace per list instead of one per op (a trace's fixed cost, guards and all, was most
# of each op's 0.1-0.3 s). A mismatch names every op that differs.


def _run_ops(cases, region):
    """Each (id, call, args) case's result, eagerly in `region` and as one compiled graph."""
    with region():
        want = [call(*args) for _, call, args in cases]

    def every_op():
        return [call(*args) for _, call, args in cases]

    return want, every_op


def _differ(cases, got, want) -> list[str]:
    return [i for (i, _, _), g, w in zip(cases, got, want, strict=True) if not _same(g, w)]


_CPU = lists.AutocastCPUTestLists(torch.device("cpu"))
_CPU_LISTS = {"torch_16": (torch, False), "nn_16": (torch._C._nn, False),
              "torch_fp32": (torch, True), "nn_fp32": (torch._C._nn, True)}  # fmt: skip


def _low(args, dtype):
    return tuple(
        a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def _cpu_case(module, entry, fp32_list):
    args = _low(entry[1], BF16) if fp32_list else entry[1]
    return entry[0], _caller(module, entry[0], entry[2] if len(entry) > 2 else {}), args


@pytest.mark.parametrize("name", list(_CPU_LISTS))
def test_cpu_lists_as_graphs_equal_torch_autocast(name):
    module, fp32_list = _CPU_LISTS[name]
    cases = [_cpu_case(module, e, fp32_list) for e in getattr(_CPU, name)]
    want, every_op = _run_ops(cases, lambda: torch.autocast("cpu", dtype=BF16))
    got = mixprec.compile(every_op, backend="eager", kernels="native", dtype=BF16,
                          fullgraph=True)()  # fmt: skip
    assert not _differ(cases, got, want)


_ALL = lists.AutocastTestLists(torch.device("cpu"))
_MODULES = {"torch_fp16": torch, "torch_fp32": torch, "torch_need_autocast_promote": torch,
            "nn_fp16": torch._C._nn, "nn_fp32": torch._C._nn, "linalg_fp16": torch._C._linalg,
            "methods_fp16": None, "methods_fp32": None}  # fmt: skip


def _cuda_cases(name):
    module, out = _MODULES[name], []
    for e in getattr(_ALL, name):
        if isinstance(e[1], str) or (len(e) > 2 and e[2] is True):
            continue  # einsum's entry is malformed in torch's list; the list's own skip flag
        if e[0] in ("cudnn_convolution", "cudnn_convolution_transpose", "cdist"):
            continue  # no CPU fp16
        kwargs = e[2] if len(e) > 2 and isinstance(e[2], dict) else {}
        out.append((e[0], _caller(module, e[0], kwargs), e[1]))
    return out


def _caller(module, op, kwargs):
    if module is None:  # a Tensor method, called on the first argument
        return lambda *a: getattr(a[0], op)(*a[1:], **kwargs)
    fn = getattr(module, op)
    return lambda *a: fn(*a, **kwargs)


@pytest.mark.parametrize("name", list(_MODULES))
def test_cuda_table_as_graphs_equal_eager_engine(name):
    cases = _cuda_cases(name)
    want, every_op = _run_ops(cases, lambda: mixprec.autocast("cpu", dtype=BF16, policy=CUDA_RULES))
    got = mixprec.compile(every_op, backend="eager", kernels="native", dtype=BF16,
                          policy=CUDA_RULES, fullgraph=True)()  # fmt: skip
    assert not _differ(cases, got, want)


# ---------------------------------------------------------- models, forward and backward


def _grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _step(model, fn, *batch):
    model.zero_grad(set_to_none=True)
    loss = fn(*batch)
    loss.backward()
    return loss.detach(), _grads(model)


def _equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(
        torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)
    )


def _assert_same_as_torch(model, fn, got, *batch):
    """`got` (loss, gradients) equals `fn`'s eager run bit for bit, or, where torch's own
    AOTAutograd runs other kernels than eager (torch 2.11 decomposes BERT's backward
    differently), ``torch.compile(fn, backend="aot_eager")``'s: the kernels that a
    mixprec.compile'd function under aot_eager runs too."""
    want = _step(model, fn, *batch)
    if _equal(got, want):
        return
    torch._dynamo.reset()
    aot = _step(model, torch.compile(fn, backend="aot_eager"), *batch)
    torch._dynamo.reset()
    assert not _equal(aot, want), "mixprec.compile differs from eager where torch's AOT does not"
    assert _equal(got, aot)


def _bench_models():
    torch.manual_seed(0)
    mlp = seed_mlp(width=32, depth=3)
    gpt = GPT(GPTConfig.tiny())
    resnet = ResNet50(num_classes=10, width=8).eval()  # eval: no batch-statistics update
    g = torch.Generator().manual_seed(1)
    return [
        ("mlp", mlp, (torch.randn(8, 32, generator=g), torch.randint(0, 32, (8,), generator=g)),
         lambda m: lambda x, y: F.cross_entropy(m(x), y)),
        ("gpt", gpt, (torch.randint(0, 512, (2, 16), generator=g),),
         lambda m: lambda ids: F.cross_entropy(m(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())),
        ("resnet50", resnet, (torch.randn(2, 3, 32, 32, generator=g),
                              torch.randint(0, 10, (2,), generator=g)),
         lambda m: lambda x, y: F.cross_entropy(m(x), y)),
    ]  # fmt: skip


@pytest.mark.parametrize("which", ["mlp", "gpt", "resnet50"])
def test_bench_models_equal_eager_torch_autocast(which):
    _, model, batch, make = next(m for m in _bench_models() if m[0] == which)
    loss_fn = make(model)

    def eager(*b):
        with torch.autocast("cpu", dtype=BF16):
            return loss_fn(*b)

    want = _step(model, eager, *batch)
    compiled = mixprec.compile(loss_fn, backend="aot_eager", kernels="native", dtype=BF16)
    got = _step(model, compiled, *batch)
    assert got[0].dtype == want[0].dtype == FP32
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


def test_inductor_within_tolerance_and_cuda_rules():
    pytest.importorskip("torch._inductor")
    _, model, batch, make = _bench_models()[1]
    loss_fn = make(model)

    def eager(*b):
        with mixprec.autocast("cpu", dtype=BF16, policy=CUDA_RULES):
            return loss_fn(*b)

    want = _step(model, eager, *batch)
    got = _step(model, mixprec.compile(loss_fn, dtype=BF16, policy=CUDA_RULES), *batch)
    # inductor fuses bf16 work into fp32 kernels and reorders reductions: a few bf16 ulps.
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)


def test_compile_mode_and_options_reach_the_inner_backend(monkeypatch):
    """torch.compile hands a callable backend its mode and options: the cast pass takes them
    and configures the compiler behind it (inductor's cudagraph trees, max-autotune, ...)."""
    pytest.importorskip("torch._inductor")
    seen = []

    def spy(gm, example_inputs, **kwargs):
        seen.append(kwargs)
        return gm.forward

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    x = torch.randn(4, 8)
    f = mixprec.compile(lambda x: model(x).sum(), backend=spy, mode="max-autotune")
    with mixprec.autocast("cpu"):
        assert _same(f(x), model(x).sum())
    assert seen == [{"mode": "max-autotune"}]
    torch._dynamo.reset()
    made = []

    class Recording(torch._TorchCompileInductorWrapper):
        def __init__(self, *args):
            made.append(args)
            super().__init__(*args)

    monkeypatch.setattr(torch, "_TorchCompileInductorWrapper", Recording)
    opts = {"epilogue_fusion": False}
    f = mixprec.compile(lambda x: model(x).sum(), dtype=BF16, options=opts)
    with mixprec.autocast("cpu", dtype=BF16):
        want = model(x).sum()
    torch.testing.assert_close(f(x), want, rtol=2e-2, atol=2e-2)
    assert made == [(None, opts, None)]


def test_the_region_of_a_step_taking_token_ids_is_their_device():
    """A language model's step takes int64 ids only: the region around each call (and the
    backend's) is on their device, not on the CPU for want of a floating input."""
    from tests.conftest import fake_cuda

    amp = mixprec.AmpBackend()
    with fake_cuda():
        ids = torch.zeros(2, 8, dtype=torch.long, device="cuda")
        weight = torch.zeros(8, 8, device="cuda")
        assert amp.region([ids]) == ("cuda", FP16)
        assert amp.region([ids, weight]) == ("cuda", FP16)
    assert amp.region([torch.zeros(3, dtype=torch.long)]) == ("cpu", BF16)
    assert amp.region([]) == ("cpu", BF16)


# -------------------------------------------------- policy edits, user functions, regions


def test_edits_reach_what_a_plain_compile_cannot():
    # mse_loss is behind torch._C._nn: under plain torch.compile no function mode sees it and
    # torch's lists apply (fp32); here the edit applies, as in eager.
    x = torch.randn(4, 8, dtype=BF16)
    policy = mixprec.Policy().move("mse_loss", to="passthrough")

    def f(x):
        return F.mse_loss(x, x * 2)

    with mixprec.autocast("cpu", policy=policy):
        assert f(x).dtype == BF16
    assert mixprec.compile(f, backend="aot_eager", kernels="native", policy=policy)(x).dtype == BF16


def test_user_function_is_one_unit():
    seen = {}

    @mixprec.float_function
    def island(x, w):
        seen["enabled"] = torch.is_autocast_enabled("cpu")
        return x @ w

    a, w = torch.randn(4, 4), torch.randn(4, 4)

    def f(a, w):
        return island(a.bfloat16(), w), a @ w

    with mixprec.autocast("cpu"):
        want = f(a, w)
    got = mixprec.compile(f, backend="aot_eager", kernels="native")(a, w)
    assert [t.dtype for t in got] == [FP32, BF16]
    assert _same(got, want) and seen["enabled"] is False


def test_model_code_branching_on_torch_state_and_nested_disable():
    a = torch.randn(8, 8)

    def f(a):
        on = torch.is_autocast_enabled("cpu")
        low = a @ a
        with torch.autocast("cpu", enabled=False):
            high = a @ a
        return low * on, high

    low, high = mixprec.compile(f, backend="aot_eager", kernels="native", fullgraph=True)(a)
    assert (low.dtype, high.dtype) == (BF16, FP32)
    assert torch.equal(high, a @ a) and low.abs().sum() > 0


def test_o1_region_inside_the_graph_and_after_it():
    # A region opened and closed inside the captured code (an O1 model's hooks) must not switch
    # the backend's own region off for the code after it (the loss).
    lin = torch.nn.Linear(8, 8)

    def f(x, y):
        with mixprec.autocast("cpu"):
            h = lin(x)
        return F.cross_entropy(h, y), h

    x, y = torch.randn(4, 8), torch.randint(0, 8, (4,))
    loss, h = mixprec.compile(f, backend="aot_eager", kernels="native")(x, y)
    assert (loss.dtype, h.dtype) == (FP32, BF16)


# ------------------------------------------------------------------------ graph breaks


# One block each: every op of a block runs in it, and dynamo traced a second block for seconds
# more (a third of these tests' time) without reaching any code the first did not.
def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  attn_implementation="eager",
                                  reorder_and_upcast_attn=True)  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _hf_bert():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=64, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  attn_implementation="eager")  # fmt: skip
    return transformers.BertForMaskedLM(cfg)


@pytest.mark.parametrize("make", [_hf_gpt2, _hf_bert], ids=["gpt2", "bert"])
def test_hf_models_equal_torch_autocast_and_add_no_graph_break(make):
    model = make()
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    def eager(ids):
        with torch.autocast("cpu", dtype=BF16):
            return loss(ids)

    compiled = mixprec.compile(loss, backend="aot_eager", kernels="native", dtype=BF16)
    got = _step(model, compiled, ids)
    _assert_same_as_torch(model, eager, got, ids)
    torch._dynamo.reset()
    counter = CompileCounter()
    with torch.autocast("cpu", dtype=BF16):
        torch.compile(loss, backend=counter)(ids)
    assert len(compiled.mixprec_backend.reports) == counter.frame_count  # no break of ours


def test_timm_vit_equals_torch_autocast():
    try:
        import timm
    except Exception as exc:  # timm imports torchvision, which a CPU-only torch cannot load
        pytest.skip(f"timm cannot be imported here: {type(exc).__name__}")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32,
                              patch_size=8, num_classes=10, depth=2)  # fmt: skip
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    def loss(x):
        return model(x).float().pow(2).mean()

    def eager(x):
        with torch.autocast("cpu", dtype=BF16):
            return loss(x)

    want = _step(model, eager, x)
    got = _step(model, mixprec.compile(loss, backend="aot_eager", kernels="native", dtype=BF16), x)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))


# ----------------------------------------------------------------------------- the cast pass


def _llama():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   max_position_embeddings=64,
                                   attn_implementation="eager")  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("make", [_llama, _hf_bert], ids=["llama", "bert"])
def test_cast_modes_against_eager_casts(make):
    # exact: never more casts than eager autocast, values and gradients bit for bit;
    # minimal: fewer casts and bytes than eager, values within bf16 rounding.
    model = make()
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def loss(ids):
        return model(input_ids=ids, labels=ids).loss

    counter = CastCounter()
    with counter, mixprec.autocast("cpu"):
        want_loss = loss(ids)  # forward only: the casts the policy makes
    eager_casts = sum(n for (src, dst), n in counter.casts.items() if src != dst)
    region = lambda i: _in_region(loss, i)  # noqa: E731
    want = _step(model, region, ids)
    got = {}
    for mode in ("exact", "minimal"):
        torch._dynamo.reset()
        compiled = mixprec.compile(loss, backend="aot_eager", kernels="native", casts=mode)
        got[mode] = (_step(model, compiled, ids), compiled.mixprec_backend.reports)
    (exact, rex), (minimal, rmin) = got["exact"], got["minimal"]
    assert torch.equal(want[0], want_loss)
    _assert_same_as_torch(model, region, exact, ids)
    before = sum(r.before for r in rex)  # the casts eager autocast makes on the captured graph
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        assert before <= eager_casts
    # else: torch 2.11's dynamo captures another BERT program (an fp32 op before each softmax,
    # also in its own torch.compile(torch.autocast) graph), which needs two more casts.
    assert sum(r.after for r in rex) <= before
    assert sum(r.after for r in rmin) < eager_casts
    assert sum(r.bytes_after for r in rmin) < sum(r.bytes_after for r in rex)
    torch.testing.assert_close(minimal[0], want[0], rtol=1e-2, atol=1e-2)
    assert all(c.reason for r in rmin for c in r.casts)


def _in_region(fn, *args):
    with mixprec.autocast("cpu"):
        return fn(*args)


def test_exact_rewrites_round_trips_and_duplicates():
    w = torch.nn.Parameter(torch.randn(8, 8))
    v = torch.nn.Parameter(torch.randn(8, 8))

    def f(x):
        h = F.linear(x, w)  # bf16
        return F.linear(h.float(), w), F.linear(h, v)  # upcast undone by the matmul; w twice

    def grads(out):
        sum(o.float().sum() for o in out).backward()
        got = (x.grad.clone(), w.grad.clone(), v.grad.clone())
        x.grad = w.grad = v.grad = None
        return got

    x = torch.randn(4, 8, requires_grad=True)
    with mixprec.autocast("cpu"):
        want = f(x)
    want_grads = grads(want)
    compiled = mixprec.compile(f, backend="aot_eager", kernels="native")
    got = compiled(x)
    assert _same(got, want)
    assert all(torch.equal(a, b) for a, b in zip(grads(got), want_grads, strict=True))
    report = compiled.mixprec_backend.reports[0]
    assert report.removed == {"cse": 1, "round_trip": 1}
    assert report.after == 3  # x, w and v, once each
    explicit = [c for c in report.casts if "explicit cast in the model's code" in c.reason]
    assert not explicit  # the one explicit cast (h.float()) is the round trip that went


def test_minimal_runs_gray_ops_low_and_never_moves_pinned_ops():
    # weight * h.to(low) (an RMSNorm's last line) promotes to fp32, then the next matmul casts
    # the whole activation back down: running the multiply in the low dtype removes that cast.
    norm_w = torch.nn.Parameter(torch.ones(32))
    lin = torch.nn.Linear(32, 32)

    def f(x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return lin(norm_w * h.to(BF16)).float().sum()

    x = torch.randn(64, 32, dtype=BF16)
    reports = {}
    for mode in ("exact", "minimal"):
        torch._dynamo.reset()
        compiled = mixprec.compile(f, backend="aot_eager", kernels="native", casts=mode)
        reports[mode] = (compiled(x), compiled.mixprec_backend.reports[0])
    (ve, re), (vp, rp) = reports["exact"], reports["minimal"]
    assert rp.removed.get("propagate", 0) >= 1 and rp.bytes_after < re.bytes_after
    torch.testing.assert_close(vp, ve, rtol=2e-2, atol=2e-2)  # the multiply rounds in bf16 now
    # pinned ops keep their dtypes: rsqrt (fp32 on no list here: passthrough) is not pointwise-
    # moved unless all its uses cast down; pow/mean stay as recorded
    pinned = {r.op: r.outputs for r in rp.ops if r.category in ("fp32", "fp32_output", "lower")}
    assert pinned.get("linear") == ("bf16",)


def test_cast_report_and_explain_name_each_cast():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                torch.nn.Linear(8, 4))  # fmt: skip
    compiled = mixprec.compile(model, backend="aot_eager", kernels="native", policy=CUDA_RULES)
    report = mixprec.explain(compiled, torch.randn(2, 8))
    text = str(report)
    assert "layer_norm" in text and "fp32" in text and "input of linear (lower:" in text
    rows = {r["op"]: r for r in report.rows}
    assert rows["layer_norm"]["category"] == "fp32" and rows["linear"]["category"] == "lower"
    assert '"casts"' in report.to_json()
    # Settings a compiled model cannot be explained with are refused, not silently ignored.
    with pytest.raises(mixprec.MixprecError, match=r"dtype=, policy=, backward= cannot apply"):
        mixprec.explain(compiled, torch.randn(2, 8), dtype="fp16", policy="fp32=linear",
                        backward=True)  # fmt: skip


def test_dynamic_shapes():
    lin = torch.nn.Linear(8, 8)
    compiled = mixprec.compile(lambda x: F.softmax(lin(x), -1), backend="aot_eager",
                               kernels="native", dynamic=True)  # fmt: skip
    graphs = []
    for n in (3, 5, 7):
        x = torch.randn(n, 8)
        with mixprec.autocast("cpu"):
            want = F.softmax(lin(x), -1)
        assert _same(compiled(x), want)
        graphs.append(len(compiled.mixprec_backend.reports))
    # One graph for every size: the cast pass counted bytes with int(size), which specialised
    # the symbolic batch size and recompiled for each new one.
    assert graphs[0] == graphs[-1], graphs


def test_the_inner_backend_sees_which_inputs_need_gradients():
    """Inductor's C++-wrapper mode (``cpp_wrapper``) takes its example inputs from the
    placeholders' values: detached, it compiled a training graph for inference, and backward
    raised "element 0 of tensors does not require grad"."""
    seen = {}

    def inner(gm, example_inputs):
        seen["vals"] = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
        seen["inputs"] = example_inputs
        return gm.forward

    lin = torch.nn.Linear(8, 8)
    compiled = mixprec.compile(lambda x: lin(x).sum(), backend=inner, kernels="native")
    compiled(torch.randn(2, 8)).backward()
    needs = [t.requires_grad for t in seen["inputs"]]
    assert sorted(needs) == [False, True, True]  # x; the weight and the bias
    assert [v.requires_grad for v in seen["vals"]] == needs
    assert lin.weight.grad is not None
    # Called directly with real tensors (no dynamo, so no fake inputs to take the flags from).
    gm = torch.fx.symbolic_trace(lambda x, y: (x * y).sum())
    x, y = torch.randn(3, requires_grad=True), torch.randn(3)
    mixprec.AmpBackend(backend=inner, kernels="native")(gm, [x, y])
    assert [v.requires_grad for v in seen["vals"]] == [True, False]


# ------------------------------------------------------------------------- bad input


def test_bad_arguments_name_the_options():
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.AmpBackend(casts="fast")
    assert str(err.value).startswith(
        "unknown casts mode 'fast'. Valid modes: 'exact', 'minimal' or 'off' (exact: remove"
    )
    with pytest.raises(TypeError, match="policy must be a mixprec.Policy, its string form"):
        mixprec.AmpBackend(policy=42)  # type: ignore[arg-type]
    with pytest.raises(mixprec.PolicyError, match="backend must be a torch.compile backend"):
        mixprec.AmpBackend(backend=42)  # type: ignore[arg-type]
    with pytest.raises(mixprec.PolicyError, match="compute dtype must be 16-bit"):
        mixprec.compile(lambda x: x, dtype="fp32")


def test_trainstep_compile_applies_the_policy_to_the_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))  # fmt: skip
    step = mixprec.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             F.cross_entropy,
                             compile={"backend": "aot_eager", "kernels": "native"})  # fmt: skip
    torch.manual_seed(0)
    ref_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32),
                                    torch.nn.Linear(32, 4))  # fmt: skip
    ref = mixprec.TrainStep(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1),
                            F.cross_entropy, compile=False)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        got, want = step(x, y), ref(x, y)
        assert got.dtype == FP32
        if i == 0:  # the same weights: the compiled loss is the eager one, to the bit
            assert torch.equal(got, want)
        # Later steps: the compiled update holds the lr as a tensor (SGD multiplies by it
        # instead of taking it as alpha), a last-ulp difference in the weights.
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert step.amp_backend is not None and step.amp_backend.reports
    torch.testing.assert_close(list(model.parameters()), list(ref_model.parameters()),
                               rtol=1e-6, atol=1e-7)  # fmt: skip


def test_registered_backend_name():
    from importlib.metadata import entry_points

    if not any(ep.name == "mixprec" for ep in entry_points(group="torch_dynamo_backends")):
        pytest.skip("mixprec is not installed (run from a source tree): no backend entry point")
    lin = torch.nn.Linear(8, 4)
    f = torch.compile(lambda x, y: F.cross_entropy(lin(x), y), backend="mixprec")
    with mixprec.autocast("cpu"):
        assert f(torch.randn(2, 8), torch.tensor([0, 1])).dtype == FP32


def test_reflected_tensor_operators_trace():
    # Tensor.__rdiv__ & co are Python functions dynamo mis-guards as dict keys (kept out of the
    # traced memo); `1.0 / x` must compile and equal eager.
    lin = torch.nn.Linear(8, 8)

    def f(x):
        return (1.0 / (lin(x).abs() + 1) - 2.0 ** x.mean()).sum()

    x = torch.randn(4, 8)
    with mixprec.autocast("cpu"):
        want = f(x)
    assert _same(mixprec.compile(f, backend="aot_eager", kernels="native")(x), want)


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * g  # deliberately not the true derivative: must be this backward


def test_autograd_function_keeps_its_backward_and_says_so():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def f(x):
        return _Square.apply(lin(x)).float().sum()

    with mixprec.autocast("cpu"):
        want = f(x)
    want.backward()
    want_grad = lin.weight.grad.clone()
    lin.weight.grad = None
    compiled = mixprec.compile(f, backend="aot_eager", kernels="native")
    with pytest.warns(UserWarning, match="autograd_function_apply"):
        got = compiled(x)
    got.backward()
    assert torch.equal(got, want) and torch.equal(lin.weight.grad, want_grad)
    report = compiled.mixprec_backend.reports[0]
    assert report.mode == "region" and "torch.autograd.Function" in str(report)


def test_activation_checkpoint_inside_the_graph():
    from torch.utils.checkpoint import checkpoint

    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def f(x):
        return F.cross_entropy(checkpoint(block, x, use_reentrant=False), torch.zeros(4).long())

    with mixprec.autocast("cpu"):
        want = f(x)
    want.backward()
    want_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    with pytest.warns(UserWarning, match="tag_activation_checkpoint"):
        got = mixprec.compile(f, backend="aot_eager", kernels="native")(x)
    got.backward()
    assert got.dtype == FP32 and torch.equal(got, want)
    for p, g in zip(block.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_the_mode_steps_aside_while_a_compiled_graph_runs(backend, monkeypatch):
    # The graph is cast already; inside the backend's region mixprec's mode would otherwise see
    # every kernel call the graph makes (inductor's extern mm with out=) and charge its Python
    # dispatch for each, for nothing.
    from mixprec.eager.mode import AutocastMode

    torch.manual_seed(0)
    model = seed_mlp(width=32, depth=3)
    x = torch.randn(8, 32)
    compiled = mixprec.compile(model, backend=backend, dtype=BF16, kernels="native")
    want = compiled(x)
    seen = []
    original = AutocastMode.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(AutocastMode, "__torch_function__", spy)
    got = compiled(x)
    assert seen == [] and got.dtype == want.dtype and torch.equal(got, want)


def test_compile_of_a_model_keeps_the_policys_fp32_modules_as_initialize_does():
    """mixprec.compile(model, policy) applied the op rules and dropped the module rules (the
    model came back bf16 while explain said fp32): it now keeps them with initialize's hooks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    policy = mixprec.Policy().keep_fp32("2")
    ref = mixprec.initialize(copy.deepcopy(model), None, "O1", policy=policy)
    compiled = mixprec.compile(model, policy=policy, backend="aot_eager", kernels="native")
    out = compiled(x)
    assert out.dtype == torch.float32 and compiled.mixprec_fp32.names == ("2",)
    with mixprec.autocast("cpu", policy=policy):
        want = ref(x)
    assert want.dtype == torch.float32 and torch.equal(out, want)
    with pytest.raises(mixprec.PolicyError, match="no module"):
        mixprec.compile(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                        policy=mixprec.Policy().keep_fp32("9"), backend="aot_eager")  # fmt: skip


def test_a_misspelt_backend_is_refused_at_compile_time_with_the_nearest_name():
    # torch.compile itself only fails at the first call, inside dynamo's error machinery.
    with pytest.raises(
        mixprec.PolicyError, match="unknown backend 'indcutor'. Did you mean 'inductor'"
    ):
        mixprec.compile(torch.nn.Linear(2, 2), backend="indcutor")
