"""Two CPU processes over gloo, data-parallel by hand: only rank 1 sees an inf gradient, and
both ranks skip that step, keep equal scales and end with identical parameters."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist

import mixprec
from tests.dist_pool import free_port
from tests.fork_server import context

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _worker(rank: int, world: int, port: int, results: dict, per_loss: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # same initial model on every rank
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, num_losses=2 if per_loss else 1)
        scales = []
        for step in range(6):
            torch.manual_seed(100 * step + rank)  # different data per rank
            x = torch.randn(8, 4)
            opt.zero_grad()
            if per_loss:
                y = model(x)
                with scaler.scaled(y.pow(2).mean(), opt, loss_id=0) as s:
                    s.backward(retain_graph=True)
                with scaler.scaled(y.abs().mean(), opt, loss_id=1) as s:
                    s.backward()
                    if rank == 1 and step == 2:
                        model.weight.grad[0, 0] = float("inf")
            else:
                scaler.scale(model(x).pow(2).mean()).backward()
            for p in model.parameters():  # average gradients by hand (what DDP does)
                dist.all_reduce(p.grad)
                p.grad /= world
            if not per_loss and rank == 1 and step in (2, 4):
                # After the gradient all-reduce, as with sharded gradients (FSDP): only rank 1
                # can see this overflow, so only the scaler's own agreement makes rank 0 skip.
                model.weight.grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            scales.append([e["scale"] for e in scaler.stats()["losses"]])
        results[rank] = (scales, [p.detach().clone() for p in model.parameters()])
    finally:
        gc.collect()  # DDP objects in reference cycles go while the group exists
        dist.destroy_process_group()


@pytest.mark.parametrize("per_loss", [False, True], ids=["one-scale", "per-loss"])
def test_all_ranks_skip_together(per_loss):
    ctx = context(__name__)  # forked from a server that imported torch, mixprec and this module
    with ctx.Manager() as manager:
        out = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_worker, args=(r, 2, port, out, per_loss)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        (s0, p0), (s1, p1) = out[0], out[1]
    assert s0 == s1
    if per_loss:
        assert [s[1] for s in s0] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0]
        assert [s[0] for s in s0] == [1024.0] * 6  # loss 0 saw no overflow
    else:
        assert [s[0] for s in s0] == [1024.0, 1024.0, 512.0, 512.0, 256.0, 256.0]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))
    assert all(torch.isfinite(t).all() for t in p0)
