"""Scenarios the distributed tests run on every rank of a `RankPool` (and their references).

Each scenario is ``fn(rank, world, ...)`` and returns plain data (tensors, floats, strings) for
the test to compare. The data of a step is a global batch of ``8 * world // 2`` rows... every
rank takes its contiguous slice, so rank r of `world` sees what a single process sees in the
r-th micro-batch of a gradient-accumulation step over the same global batch.

Why the references are bit-for-bit: a 2-rank reduction computes (g0 + g1) / 2, or g0/2 + g1/2
(DDP divides first), in the gradient's dtype. Halving is exact in binary floating point and a
sum of two terms does not depend on their order, so one process computing the same two
micro-batches and adding their halves in the same dtype gets the same bits. Where the
reduction's dtype is fp32 (FSDP2's reduce_dtype, fp32 gradients), the reference accumulates in
fp32 (two ``scale_loss`` blocks: O2 moves each block's bf16 gradients into fp32 masters); where
it is bf16 (DDP's bucket for an O2/O3 model), autograd sums the micro-batches' bf16
contributions before anything else (one block over both losses). A single process on the
concatenated batch differs in rounding (one matmul over all rows), not in meaning: that
comparison has a tolerance.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mixprec

ROWS = 4  # rows of the global batch per rank (per micro-batch in the references)
INF_STEP = 2


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


def batch(step: int, parts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(ROWS * parts, 8, generator=g)
    return x, torch.randint(0, 4, (ROWS * parts,), generator=g)


def part(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[r * ROWS : (r + 1) * ROWS]


def poison(x: torch.Tensor, step: int, r: int, inf_rank: int | None) -> torch.Tensor:
    """The input of micro-batch `r`, with an inf in one row at INF_STEP on `inf_rank`."""
    if inf_rank is not None and r == inf_rank and step == INF_STEP:
        x = x.clone()
        x[0, 0] = float("inf")
    return x


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).float(), y)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered, for a DTensor: a collective, called on every rank)."""
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Equal lists of tensors, bit for bit."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def environment(env: dict[str, str], restore: tuple[str, ...] = ()) -> Iterator[None]:
    """`env` in ``os.environ`` for the block (warnings silenced), then every variable it named,
    and those in `restore` (which the block may set), as they were: a pooled process runs
    scenario after scenario."""
    saved = {k: os.environ.get(k) for k in (*env, *restore)}
    os.environ.update(env)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launched(rank: int, world: int) -> contextlib.AbstractContextManager[None]:
    """The environment ``torchrun`` / ``accelerate launch`` / Lightning's launcher give the
    process of rank `rank` (the pool already joined the gloo group, which they all reuse)."""
    return environment({"LOCAL_RANK": str(rank), "RANK": str(rank), "NODE_RANK": "0",
                        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                        "OMP_NUM_THREADS": "1"})  # fmt: skip


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [full(p) for p in model.parameters()]


@contextlib.contextmanager
def counting_all_reduce():
    """Count ``torch.distributed.all_reduce`` calls (the scaler's agreement; DDP reduces in C++)."""
    calls: list[int] = []
    real = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    with mock.patch.object(dist, "all_reduce", counted):
        yield calls


def _opt(model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)


def _overrides(dynamic: bool) -> dict[str, Any]:
    # bf16 needs no loss scaling; "dynamic" runs the scaler anyway, to test its skips on a CPU.
    return {"loss_scale": "dynamic"} if dynamic else {}


# ----------------------------------------------------------------------------- scaler on FSDP2


def fsdp_scaler(rank: int, world: int, impl: str, mode: str) -> dict[str, Any]:
    """Plain FSDP2 (fp32) with mixprec.GradScaler; an inf on the last rank's shard only."""
    from torch.distributed.fsdp import fully_shard

    model = net()
    fully_shard(model)
    opt = _opt(model, fused=mode == "fused")
    skip_mode = {"fused": "auto", "restore": "restore", "sync": "sync"}[mode]
    scaler = mixprec.GradScaler("cpu", init_scale=2.0**10, unscale_impl=impl, skip_mode=skip_mode)
    scales, calls, unchanged = [], [], None
    for step in range(4):
        x, y = batch(step, world)
        opt.zero_grad()
        scaler.scale(loss_of(model, part(x, rank), part(y, rank))).backward()
        if step == 1 and rank == world - 1:
            # After the reduce-scatter, on this rank's shard: only the scaler's own agreement
            # can tell the other ranks to skip.
            model[0].weight.grad.to_local().view(-1)[0] = float("inf")
        before = params_of(model)
        with counting_all_reduce() as counted:
            scaler.step(opt)
            scaler.update()
        calls.append(len(counted))
        if step == 1:
            unchanged = all(
                torch.equal(a, b) for a, b in zip(before, params_of(model), strict=True)
            )
        scales.append(scaler.get_scale())
    ref = None
    if rank == 0:  # the same training on one process: micro-batch halves summed in fp32
        ref_model = net()
        ref_opt = _opt(ref_model, fused=mode == "fused")
        for step in range(4):
            x, y = batch(step, world)
            ref_opt.zero_grad()
            for r in range(world):
                (loss_of(ref_model, part(x, r), part(y, r)) / world).backward()
            if step != 1:
                ref_opt.step()
        ref = params_of(ref_model)
    return {"scales": scales, "calls": calls, "unchanged": unchanged,
            "params": params_of(model), "ref": ref, "mode": scaler.skip_mode(opt)[0]}  # fmt: skip


# ----------------------------------------------------------------------------- levels on FSDP2


def _fsdp_model(level: str, dynamic: bool, entry: str) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    model = net()
    if entry == "torch":  # O0/O1 cast no weight: torch's own fully_shard works as it is
        fully_shard(model)
    else:
        mixprec.fully_shard(model, opt_level=level)
    return mixprec.initialize(model, _opt(model), level, **_overrides(dynamic))


def fsdp_level(rank: int, world: int, level: str, dynamic: bool, entry: str) -> dict[str, Any]:
    """A level under FSDP2, 4 steps, an inf in the last rank's input at INF_STEP (if scaled)."""
    model, opt = _fsdp_model(level, dynamic, entry)
    seen: dict[str, Any] = {}

    def look(name: str, what: Any) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            seen.setdefault(name, what(module, args, output))

        return hook

    model[0].register_forward_hook(look("linear", lambda m, a, o: (a[0].dtype, m.weight.dtype)))
    model[1].register_forward_hook(
        look("norm", lambda m, a, o: (a[0].dtype, m.weight.dtype, o.dtype))
    )
    model.register_forward_hook(look("output", lambda m, a, o: o.dtype))  # after the level's
    inf_rank = world - 1 if dynamic else None
    scales = []
    for step in range(4):
        x, y = batch(step, world)
        opt.zero_grad()
        loss = loss_of(model, poison(part(x, rank), step, rank, inf_rank), part(y, rank))
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        seen.setdefault("grad", {type(p.grad).__name__ + " " + str(p.grad.dtype)
                                 for p in model.parameters()})  # fmt: skip
        opt.step()
        scales.append(opt.loss_scale)
    stepped_are_model_params = [id(p) for p in mixprec.master_params(opt)] == [
        id(p) for p in model.parameters()
    ]
    out = {"scales": scales, "params": params_of(model), "seen": seen, "masters": len(opt._masters),
           "stepped_are_model_params": stepped_are_model_params,
           "param_dtypes": sorted({str(p.dtype) for p in model.parameters()})}  # fmt: skip
    # Every rank computes the reference: its scaler agrees across ranks too (a collective).
    out["ref"] = reference(level, dynamic, world, inf_rank, reduce="fp32")
    return out


def reference(level: str, dynamic: bool, world: int, inf_rank: int | None, reduce: str,
              steps: int = 4, concat: bool = False) -> list[torch.Tensor]:  # fmt: skip
    """One process, no wrapper: the micro-batches of every rank, reduced as the engine does.

    reduce="fp32": each micro-batch's gradients are added in fp32 (FSDP2's fp32 reduction):
    one scale_loss block per micro-batch. reduce="param": added in the parameter's dtype
    (DDP's bucket): one block over all micro-batches. concat=True: one forward over the whole
    global batch instead (the tolerance comparison).
    """
    model = net()
    model, opt = mixprec.initialize(model, _opt(model), level, **_overrides(dynamic))
    for step in range(steps):
        x, y = batch(step, world)
        opt.zero_grad()
        if concat:
            xs = torch.cat([poison(part(x, r), step, r, inf_rank) for r in range(world)])
            with mixprec.scale_loss(loss_of(model, xs, y), opt) as scaled:
                scaled.backward()
        elif reduce == "fp32":
            for r in range(world):
                loss = loss_of(model, poison(part(x, r), step, r, inf_rank), part(y, r))
                with mixprec.scale_loss(loss / world, opt) as scaled:
                    scaled.backward()
        else:
            loss = sum(
                loss_of(model, poison(part(x, r), step, r, inf_rank), part(y, r)) / world
                for r in range(world)
            )
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
    return [full(m) for m in mixprec.master_params(opt)]


# ----------------------------------------------------------------------------- DDP


def _ddp(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def ddp_level(rank: int, world: int, level: str, dynamic: bool, order: str) -> dict[str, Any]:
    """A level under DDP (plain loop or TrainStep), an inf in the last rank's input (if scaled)."""
    inf_rank = world - 1 if dynamic else None
    model = net()
    opt = _opt(model)
    step_fn = None
    if order == "initialize-then-ddp":
        model, opt = mixprec.initialize(model, opt, level, **_overrides(dynamic))
        model = _ddp(model)
    elif order == "ddp-then-initialize":
        model, opt = mixprec.initialize(_ddp(model), opt, level, **_overrides(dynamic))
    elif order == "trainstep-given-ddp":  # initialize, DDP, then TrainStep sees the wrapper
        model, opt = mixprec.initialize(model, opt, level, **_overrides(dynamic))
        step_fn = mixprec.TrainStep(_ddp(model), opt, compute_loss=loss_of)
        model = step_fn.model
    else:  # TrainStep wraps: initialize, then DDP
        step_fn = mixprec.TrainStep(model, opt, compute_loss=loss_of, opt_level=level, ddp=True,
                                    **_overrides(dynamic))  # fmt: skip
        model, opt = step_fn.model, step_fn.optimizer
    scales, calls = [], []
    for step in range(4):
        x, y = batch(step, world)
        xr, yr = poison(part(x, rank), step, rank, inf_rank), part(y, rank)
        with counting_all_reduce() as counted:
            if step_fn is not None:
                step_fn(xr, yr)
            else:
                opt.zero_grad()
                with mixprec.scale_loss(loss_of(model, xr, yr), opt) as scaled:
                    scaled.backward()
                opt.step()
            scales.append(opt.loss_scale)  # flushes the deferred update of a plain loop
        calls.append(len(counted))
    out = {"scales": scales, "calls": calls,
           "masters": [full(m) for m in mixprec.master_params(opt)],
           "params": params_of(model)}  # fmt: skip
    if step_fn is not None:
        out["reason"], out["explain"] = step_fn.reason, step_fn.explain()
    out["ref"] = reference(level, dynamic, world, inf_rank, reduce="param")
    out["concat"] = reference(level, dynamic, world, inf_rank, reduce="param", concat=True)
    return out


def ddp_errors(rank: int, world: int) -> dict[str, str]:
    """Messages of the orders of wrapping that cannot work, and TrainStep's misuses."""
    out = {}
    for level in ("O2", "O3"):
        model = net()
        try:
            mixprec.initialize(_ddp(model), _opt(model), level)
        except mixprec.DistributedError as err:
            out[level] = str(err)
    try:
        model = net()
        mixprec.TrainStep(_ddp(model), _opt(model), compute_loss=loss_of, ddp=True)
    except mixprec.DistributedError as err:
        out["twice"] = str(err)
    model = net()
    model, _ = mixprec.initialize(model, _opt(model), "O2")
    try:
        mixprec.initialize(_ddp(model), _opt(model), "O1")
    except mixprec.MixprecError as err:
        out["initialized"] = str(err)
    return out


# ----------------------------------------------------------------------------- FSDP2 misuse


def fsdp_errors(rank: int, world: int) -> dict[str, str]:
    """Every way to combine an opt level with FSDP2 that cannot work, and its message."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    model = net()
    fully_shard(model)
    try:
        mixprec.initialize(model, _opt(model), "O2")
    except mixprec.DistributedError as err:
        out["torch_sharded_O2"] = str(err)
    model = net()
    mixprec.initialize(model, _opt(model), "O2")
    try:
        fully_shard(model)
    except Exception as err:  # torch's own message: the reason mixprec.fully_shard exists
        out["torch_after_O2"] = str(err)
    try:
        mixprec.initialize(model, _opt(model), "O2")
    except mixprec.MixprecError as err:
        out["O2_twice"] = str(err)
    model = net()
    fully_shard(model[0])
    try:
        mixprec.fully_shard(model, opt_level="O2")
    except mixprec.DistributedError as err:
        out["presharded"] = str(err)
    model = net()
    mixprec.fully_shard(model, opt_level="O2")
    for key, kwargs in (("level", {"opt_level": "O1"}), ("option", {"keep_batchnorm_fp32": False})):
        try:
            mixprec.initialize(model, _opt(model), **({"opt_level": "O2"} | kwargs))
        except mixprec.DistributedError as err:
            out[key] = str(err)
    mixprec.initialize(model, _opt(model), "O2")
    try:
        mixprec.initialize(model, _opt(model), "O2")
    except mixprec.MixprecError as err:
        out["initialize_twice"] = str(err)
    return out


# ----------------------------------------------------------------------------- memory


def fsdp_memory(rank: int, world: int, width: int) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer state on this rank, three ways."""
    from benchmarks.fsdp_memory import measure

    return measure(width=width, depth=2, batch=4, device="cpu", dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- checkpoints


def _sharded_o2(dynamic: bool) -> tuple[nn.Module, Any]:
    model = net()
    mixprec.fully_shard(model, opt_level="O2")
    return mixprec.initialize(model, _opt(model), "O2", **_overrides(dynamic))


def _plain_o2(dynamic: bool) -> tuple[nn.Module, Any]:
    model = net()
    return mixprec.initialize(model, _opt(model), "O2", **_overrides(dynamic))


def train_steps(model: nn.Module, opt: Any, steps: range, world: int, ranks: list[int],
                reduce: str = "fp32") -> None:  # fmt: skip
    """Steps of the global batch; this process runs micro-batches `ranks`.

    Several micro-batches are summed as `reference` describes: in fp32 (one scale_loss block
    each) or in the parameters' dtype (one block over all of them).
    """
    for step in steps:
        x, y = batch(step, world)
        opt.zero_grad()
        losses = [
            loss_of(model, poison(part(x, r), step, r, world - 1), part(y, r)) / len(ranks)
            for r in ranks
        ]
        for loss in losses if reduce == "fp32" else [sum(losses)]:
            with mixprec.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()


def ckpt_fsdp(rank: int, world: int, path: str, mode: str) -> dict[str, Any]:
    """mode 'save': 6 steps, saving after 3; 'resume': load that, run steps 3-6 (same world)."""
    model, opt = _sharded_o2(dynamic=True)
    if mode == "save":
        train_steps(model, opt, range(3), world, [rank])
        if rank == 0 and os.path.exists(path):
            shutil.rmtree(path)
        dist.barrier()
        mixprec.save_checkpoint(path, model, opt)
        train_steps(model, opt, range(3, 6), world, [rank])
    else:
        mixprec.load_checkpoint(path, model, opt)
        train_steps(model, opt, range(3, 6), world, [rank])
    return {"params": params_of(model), "scale": opt.loss_scale,
            "stats": opt.scaler.stats()}  # fmt: skip


def ckpt_load_only(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load a checkpoint into a fresh sharded O2 job (any world size); return what it holds."""
    model, opt = _sharded_o2(dynamic=True)
    mixprec.load_checkpoint(path, model, opt)
    state = {k: full(v) for k, v in opt.optimizer.state[next(iter(model.parameters()))].items()}
    return {"params": params_of(model), "scale": opt.loss_scale, "state0": state}


def ckpt_ddp_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """DDP O2 (plain loop): 3 steps, save, 3 more; the checkpoint holds the fp32 masters."""
    model, opt = _plain_o2(dynamic=True)
    model = _ddp(model)
    if rank == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()
    for step in range(6):
        if step == 3:
            mixprec.save_checkpoint(path, model, opt)
        x, y = batch(step, world)
        opt.zero_grad()
        loss = loss_of(model, poison(part(x, rank), step, rank, world - 1), part(y, rank))
        with mixprec.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return {"masters": [full(m) for m in mixprec.master_params(opt)], "scale": opt.loss_scale}


def ddp_four_ranks(rank: int, world: int, path: str) -> dict[str, Any]:
    """4 ranks, O1 under DDP (TrainStep), an inf on rank 2 only; then an FSDP2 save on 4."""
    model = net()
    step_fn = mixprec.TrainStep(model, _opt(model), compute_loss=loss_of, opt_level="O1",
                                ddp=True, loss_scale="dynamic")  # fmt: skip
    scales = []
    for step in range(4):
        x, y = batch(step, world)
        step_fn(poison(part(x, rank), step, rank, 2), part(y, rank))
        scales.append(step_fn.optimizer.loss_scale)
    model, opt = _sharded_o2(dynamic=True)
    train_steps(model, opt, range(3), world, [rank])
    if rank == 0 and os.path.exists(path):
        shutil.rmtree(path)
    dist.barrier()
    mixprec.save_checkpoint(path, model, opt)
    return {"scales": scales, "params": params_of(step_fn.model.module),
            "sharded": params_of(model), "scale": opt.loss_scale}  # fmt: skip


def ckpt_accumulate(rank: int, world: int, path: str, mode: str, width: int,
                    reduce: str = "fp32") -> dict[str, Any]:  # fmt: skip
    """One process (sharded over `world`=1, or none) running `width` micro-batches per step.

    mode 'resume': load `path`, run steps 3-6. mode 'save': steps 0-3, save, steps 3-6.
    """
    make = _sharded_o2 if dist.is_initialized() else _plain_o2
    model, opt = make(dynamic=True)
    if mode == "save":
        train_steps(model, opt, range(3), width, list(range(width)), reduce)
        if os.path.exists(path):
            shutil.rmtree(path)
        mixprec.save_checkpoint(path, model, opt)
    else:
        mixprec.load_checkpoint(path, model, opt)
    train_steps(model, opt, range(3, 6), width, list(range(width)), reduce)
    return {"params": [full(m) for m in mixprec.master_params(opt)], "scale": opt.loss_scale}


def fsdp_trainstep(rank: int, world: int) -> dict[str, Any]:
    """TrainStep on a model mixprec.fully_shard prepared (O2, scaled): eager, same numbers."""
    model = net()
    mixprec.fully_shard(model, opt_level="O2")
    step_fn = mixprec.TrainStep(model, _opt(model), compute_loss=loss_of, opt_level="O2",
                                loss_scale="dynamic")  # fmt: skip
    with counting_all_reduce() as counted:
        for step in range(4):
            x, y = batch(step, world)
            step_fn(poison(part(x, rank), step, rank, world - 1), part(y, rank))
    return {"params": params_of(model), "reason": step_fn.reason, "calls": len(counted),
            "ref": reference("O2", True, world, world - 1, reduce="fp32")}  # fmt: skip


def capture_rules(rank: int, world: int) -> dict[str, str | None]:
    """PyTorch's DDP capture rules as TrainStep checks them, NCCL simulated on this CPU group."""
    from torch.distributed.fsdp import fully_shard

    from mixprec.distributed import ddp as rules

    cuda = torch.device("cuda", 0)
    out: dict[str, str | None] = {"gloo": rules.capture_blocker(_ddp(net()), cuda, True)}
    sharded = net()
    fully_shard(sharded)
    out["fsdp"] = rules.capture_blocker(sharded, cuda, False)
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    cases = {
        "old_nccl": ((2, 9, 5), env, _ddp(net()), True),
        "error_handling": ((2, 21, 5), {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, net(), False),
        "old_variable": ((2, 21, 5), {"NCCL_ASYNC_ERROR_HANDLING": "0"}, net(), False),
        "ddp_elsewhere": ((2, 21, 5), env, _ddp(net()), False),
        "unused": ((2, 21, 5), env, torch.nn.parallel.DistributedDataParallel(
            net(), find_unused_parameters=True), True),
        "ok": ((2, 21, 5), env, _ddp(net()), True),
    }  # fmt: skip
    for name, (version, variables, model, built_here) in cases.items():
        with (
            mock.patch.object(rules, "backend_for", lambda device: "nccl"),
            mock.patch.object(torch.cuda.nccl, "version", lambda v=version: v),
            mock.patch.dict(os.environ, variables, clear=False),
        ):
            for var in rules._ERROR_HANDLING_VARS:
                if var not in variables:
                    os.environ.pop(var, None)
            out[name] = rules.capture_blocker(model, cuda, built_here)
    return out


def ddp_no_sync(rank: int, world: int, level: str, dtype: str, order: str) -> dict[str, Any]:
    """Two micro-batches per step, the first under DDP's no_sync(); with fp16, an inf in the
    last rank's first micro-batch at step 1. Every rank must end with the same weights and
    skips."""
    import contextlib

    model = net()
    opt = _opt(model)
    if order == "initialize-then-ddp":
        model, opt = mixprec.initialize(model, opt, level, dtype=dtype)
        ddp = _ddp(model)
    elif order == "ddp-then-initialize":
        ddp, opt = mixprec.initialize(_ddp(model), opt, level, dtype=dtype)
    else:  # the drop-in scaler with its scaled() blocks
        ddp = _ddp(model)
        scaler = mixprec.GradScaler("cpu")
    skipped = []
    for step in range(3):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        x, y = batch(step, 2 * world)
        for mb in range(2):
            xr, yr = part(x, 2 * rank + mb), part(y, 2 * rank + mb)
            if step == 1 and mb == 0 and dtype == "fp16":
                xr = poison(xr, INF_STEP, rank, world - 1)
            with ddp.no_sync() if mb == 0 else contextlib.nullcontext():
                if order == "drop-in":
                    with mixprec.autocast("cpu", dtype=torch.float16):
                        loss = loss_of(ddp, xr, yr)
                    with scaler.scaled(loss, opt) as scaled:
                        scaled.backward()
                else:
                    with mixprec.scale_loss(loss_of(ddp, xr, yr), opt) as scaled:
                        scaled.backward()
        if order == "drop-in":
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        skipped.append(same(before, list(model.parameters())))
    out = {"params": params_of(model), "skipped": skipped}
    if level == "O2":
        out["masters"] = [full(m) for m in mixprec.master_params(opt)]
        # A step straight after a no_sync backward would step local, still scaled gradients.
        opt.zero_grad()
        with ddp.no_sync(), mixprec.scale_loss(loss_of(ddp, xr, yr), opt) as scaled:
            scaled.backward()
        try:
            opt.step()
            out["refused"] = None
        except mixprec.ScalerStateError as err:
            out["refused"] = str(err)
        out["unchanged"] = same(params_of(model), out["params"])
    return out
