"""Backward ops a CPU graph leaves to torch's kernels (`mixprec.graph.lowering`).

References: the uncompiled model for the gradients (the kept kernel changes only the order of
fp32 sums), and torch's profiler for which kernel ran (ATen's op, or inductor's loop in its
place).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor import lowering as inductor_lowering
from torch.profiler import ProfilerActivity, profile

import mixprec
from mixprec.graph import lowering

pytestmark = pytest.mark.compile


class _Tokens(nn.Module):
    """Token and position tables, a Linear in bf16 under the policy, a loss."""

    def __init__(self, vocab: int, width: int, sparse: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width, sparse=sparse)
        self.pos = nn.Embedding(16, width)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return nn.functional.cross_entropy(self.out(h).float().flatten(0, 1), idx.flatten())


def _grads_and_kernels(model: nn.Module, run, idx: torch.Tensor):
    model.zero_grad(set_to_none=True)
    run(idx).backward()  # compiles (outside the profile)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = run(idx)
        loss.backward()
    names = {e.name for e in prof.events()}
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, names


def test_a_cpu_graph_computes_the_embedding_gradient_with_torchs_kernel(monkeypatch):
    # With CI set, inductor's implicit fallback refuses an op that has a decomposition; mixprec
    # registers the fallback itself, so a CI machine compiles the same graph.
    monkeypatch.setenv("CI", "1")
    torch.manual_seed(0)
    model = _Tokens(96, 32)
    idx = torch.randint(0, 96, (4, 16))
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = model(idx)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    amp = mixprec.AmpBackend(dtype="bf16", kernels="auto")
    loss, grads, names = _grads_and_kernels(model, torch.compile(model, backend=amp), idx)
    kept = [c for c in amp.kernel_choices if c.route == "aten"]
    assert [(c.op, c.shapes) for c in kept] == [
        ("aten.embedding_dense_backward", ((96, 32), (4, 16))),
        ("aten.embedding_dense_backward", ((16, 32), (16,))),
    ]
    assert "atomic adds" in str(kept[0]) and "aten.embedding_dense_backward" in amp.kernel_summary()
    assert "aten::embedding_dense_backward" in names  # ATen's kernel ran, not a generated loop
    assert torch.ops.aten.embedding_dense_backward.default in inductor_lowering.lowerings
    torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5)
    for name, grad in ref.items():  # the same sums, another order
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_native_kernels_and_sparse_tables_keep_inductors_decomposition():
    torch.manual_seed(0)
    model = _Tokens(80, 24)  # other shapes than above: compiled-graph caches ignore the table
    idx = torch.randint(0, 80, (2, 16))
    amp = mixprec.AmpBackend(dtype="bf16", kernels="native")
    _, _, names = _grads_and_kernels(model, torch.compile(model, backend=amp), idx)
    assert not [c for c in amp.kernel_choices if c.route == "aten"]
    assert "aten::embedding_dense_backward" not in names  # inductor's own loop

    # What the choice reads: a sparse table has no dense backward; a GPU keeps the loop.
    assert lowering.kept_whole(_embedding_graph(sparse=True), "cpu", "auto") == []
    dense = _embedding_graph(sparse=False)
    assert [c.route for c in lowering.kept_whole(dense, "cpu", "auto")] == ["aten"]
    assert lowering.kept_whole(dense, "cuda", "auto") == []
    assert lowering.kept_whole(dense, "cpu", "native") == []


def _embedding_graph(sparse: bool) -> torch.fx.GraphModule:
    def lookup(w, i):
        return torch.ops.aten.embedding.default(w, i, -1, False, sparse)

    gm = torch.fx.symbolic_trace(lookup)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            big = node.name == "w"
            node.meta["val"] = torch.empty(8, 4) if big else torch.zeros(3, dtype=torch.long)
    return gm


def test_trainstep_o2_forward_graph_keeps_it_too():
    torch.manual_seed(0)
    model = _Tokens(64, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 64, (2, 16))
    step = mixprec.TrainStep(model, opt, compute_loss=lambda m, i: m(i), opt_level="O2",
                             dtype="bf16")  # fmt: skip
    for _ in range(3):
        step(idx)
    assert "aten.embedding_dense_backward" in step.explain()
