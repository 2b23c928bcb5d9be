"""Three gaps left by earlier work, each pinned by the case that showed it:

- graph-level AMP cast the tensors of a list argument (a custom op's ``Tensor[]``,
  ``torch.cat``/``torch.stack``) nowhere, where eager ``mixprec.autocast`` casts each;
- ``explain`` missed a ping-pong whose fp32 value passes through an op that keeps it (relu, a
  view) before it is cast down again;
- ``--variants O1,,O2`` (and ``--modes``) dropped the empty item silently.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mixprec
from mixprec.bench.train import MODES
from mixprec.bench.variants import VARIANTS

BF16, FP32 = torch.bfloat16, torch.float32

# ------------------------------------------------------------------ graph: list arguments

_SEEN: list[tuple[torch.dtype, ...]] = []


@torch.library.custom_op("mixprec_leftovers::weighted_sum", mutates_args=())
def _weighted_sum(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    _SEEN.append((*(x.dtype for x in xs), w.dtype))
    out = w.clone()
    for x in xs:
        out = out + x.to(w.dtype)
    return out


@_weighted_sum.register_fake
def _(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(w)


def _call_custom(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mixprec_leftovers.weighted_sum([a, b], w)


def _mixed() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4), torch.randn(4, dtype=BF16), torch.randn(4)


def _compilers(policy: mixprec.Policy):
    # mixprec.compile (a region around the call) and AmpBackend alone (no region while dynamo
    # traces: only the re-trace applies the policy).
    yield mixprec.compile(_call_custom, policy=policy, backend="aot_eager", kernels="native")
    torch._dynamo.reset()
    backend = mixprec.AmpBackend(policy=policy, backend="aot_eager", kernels="native")
    yield torch.compile(_call_custom, backend=backend)


@pytest.mark.parametrize("category", ["lower", "fp32", "promote"])
def test_custom_op_list_argument_is_cast_in_the_graph_as_in_eager(category):
    policy = mixprec.Policy().move(torch.ops.mixprec_leftovers.weighted_sum, to=category)
    a, b, w = _mixed()
    _SEEN.clear()
    with mixprec.autocast("cpu", policy=policy):
        want = _call_custom(a, b, w)
    (eager,) = _SEEN
    assert eager == {"lower": (BF16,) * 3, "fp32": (FP32,) * 3, "promote": (FP32,) * 3}[category]
    for compiled in _compilers(policy):
        _SEEN.clear()
        got = compiled(a, b, w)
        seen = list(_SEEN)
        assert seen == [eager], (category, seen)  # was (fp32, bf16, ...): the list uncast
        assert got.dtype == want.dtype and torch.equal(got, want)
    torch._dynamo.reset()


@pytest.mark.parametrize("op", [torch.cat, torch.stack])
@pytest.mark.parametrize("move", [None, "lower", "fp32"])
def test_cat_and_stack_lists_in_the_graph_path_equal_eager_and_torch(op, move):
    policy = None if move is None else mixprec.Policy().move(op.__name__, to=move)
    a, b, _ = _mixed()

    def f(a, b):
        return op([a, b]) * 2

    with mixprec.autocast("cpu", policy=policy):
        want = f(a, b)
    if move is None:  # the default policy is torch.autocast's CPU lists: promote
        with torch.autocast("cpu", dtype=BF16):
            assert torch.equal(f(a, b), want)
    torch._dynamo.reset()
    backend = mixprec.AmpBackend(policy=policy, backend="aot_eager", kernels="native")
    got = torch.compile(f, backend=backend)(a, b)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # The cast is an explicit node of the graph, so the report names it.
    (report,) = backend.reports
    assert report.after == 1 and op.__name__ in report.casts[0].reason
    torch._dynamo.reset()


# ------------------------------------------------------------------ explain: ping-pong


class _View(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1).view(x.shape[0], -1)


class _Residual(nn.Module):
    """The normed value is added to another computed one (a residual stream) before the next
    linear: a new value, so no chain pairs the norm's up-cast with that down-cast."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
        self.skip, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stream = self.skip(x).float() * 2
        return self.b(self.norm(self.a(x)) + stream)


def _net(*between: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), *between, nn.Linear(32, 8))


@pytest.mark.parametrize(
    "between,ops",
    [
        ((), ["linear", "layer_norm", "linear"]),
        ((nn.ReLU(),), ["linear", "layer_norm", "relu", "linear"]),
        ((_View(),), ["linear", "layer_norm", "reshape", "view", "linear"]),
        ((nn.GELU(), nn.Dropout(0.0), _View()),
         ["linear", "layer_norm", "gelu", "dropout", "reshape", "view", "linear"]),
    ],
)  # fmt: skip
def test_ping_pong_through_ops_that_keep_the_value(between, ops):
    report = mixprec.explain(_net(*between), torch.randn(4, 16), device_type="cpu",
                             policy="fp32=layer_norm")  # fmt: skip
    (chain,) = report.ping_pong  # was none as soon as one op stood between the norm and linear
    assert [report.rows[i]["op"] for i in chain["rows"]] == ops
    assert chain["bytes"] == 4 * 32 * 4 + 4 * 32 * 2  # bf16 -> fp32 up, fp32 -> bf16 down
    assert report.summary()["ping_pong"] == 1 and "ping-pong (low" in str(report)


def test_ping_pong_stops_where_the_value_meets_another_computed_one():
    report = mixprec.explain(_Residual(), torch.randn(4, 16), device_type="cpu",
                             policy="fp32=layer_norm")  # fmt: skip
    assert report.ping_pong == []


def test_each_down_cast_of_one_up_cast_value_is_a_chain():
    torch.manual_seed(0)

    class Fork(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.norm = nn.Linear(16, 32), nn.LayerNorm(32)
            self.q, self.k = nn.Linear(32, 8), nn.Linear(32, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.a(x))
            return self.q(h) + self.k(torch.relu(h))

    report = mixprec.explain(Fork(), torch.randn(4, 16), device_type="cpu",
                             policy="fp32=layer_norm")  # fmt: skip
    paths = [c["path"] for c in report.ping_pong]
    assert paths == ["a:linear -> norm:layer_norm -> q:linear",
                     "a:linear -> norm:layer_norm -> (Fork):relu -> k:linear"]  # fmt: skip


# ------------------------------------------------------------------ CLI: comma lists


@pytest.mark.parametrize(
    "args,message",
    [
        (["bench", "--variants", "O1,,O2"], "--variants 'O1,,O2' has an empty item"),
        (["bench", "--variants", "O1,O2,"], "Drop the extra comma (--variants O1,O2)"),
        (["bench", "--variants", ",O1"], "has an empty item"),
        (["bench", "--variants", ","], "--variants ',' names nothing"),
        (["bench", "--variants", ""], "names nothing"),
        (["bench", "--variants", "O1,O2,O1"], "names 'O1' more than once"),
        (["train", "--modes", "fp32,,O1"], "--modes 'fp32,,O1' has an empty item"),
        (["train", "--modes", "fp32,O1,fp32"], "give each name once: --modes fp32,O1."),
    ],
)
def test_comma_lists_refuse_empty_and_repeated_items(args, message, capsys):
    from mixprec.cli import main

    # A bad option the command checks after the list: should the list be accepted, the command
    # stops there (with another message) instead of running a benchmark or a training.
    guard = ["--device", "nowhere"] if args[0] == "bench" else ["--model", "nowhere"]
    assert main([*args, *guard]) == 2
    out, err = capsys.readouterr()
    assert message in err, err
    valid = VARIANTS if args[0] == "bench" else MODES
    assert "Valid: " + ", ".join(valid) in err, err  # every valid name, to pick from
    assert "Traceback" not in err and not out


def test_spaces_around_names_still_work():
    from mixprec.cli import _choices

    assert _choices(" O1 , O2", list(VARIANTS), "--variants") == ["O1", "O2"]
