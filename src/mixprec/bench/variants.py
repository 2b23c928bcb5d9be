"""The ways of training a workload that the benchmark compares, and when each can run.

A variant that cannot run where the benchmark runs is not dropped: `Variant.available` says why,
and the row reports it (TF32 off NVIDIA GPUs).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

import mixprec
from mixprec.bench.workloads import Workload, WorkloadSize
from mixprec.dtypes import dtype_name
from mixprec.optim.report import state_tensors

__all__ = ["VARIANTS", "Variant", "tf32"]

Step = Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Variant:
    """One way to train: its name, what it is, and the dtype its matmuls run in."""

    name: str
    title: str
    low_precision: bool  # matmuls in the low dtype (for the % of peak column)

    def available(self, device: str, dtype: torch.dtype) -> tuple[bool, str]:
        """Whether this variant can run on `device` with `dtype`, and if not, why."""
        if self.name == "tf32" and device != "cuda":
            return False, "TF32 is an NVIDIA tensor-core format; CPUs have no TF32 matmuls"
        # fp16 on a CPU runs (slowly: most CPUs have no fast fp16 kernels); the budget shrinks
        # its sizes and the report says how slow it is, measured.
        return True, ""

    def compiles_when_built(self, device: str, distributed: bool = False) -> bool:
        """Whether `build` compiles (the TrainStep row off CUDA, where it is not under DDP)."""
        return self.name == "trainstep" and device != "cuda" and not distributed

    def steps_when_built(self, device: str, distributed: bool = False) -> int:
        """Training steps `build` takes: the TrainStep row compiles in two (the first creates
        the optimizer state and compiles the forward, the second compiles the update)."""
        return 2 if self.compiles_when_built(device, distributed) else 0

    def preparing(self, device: str, distributed: bool = False) -> str:
        """What building this variant does, for the progress line (compiling takes minutes)."""
        if self.compiles_when_built(device, distributed):
            return f"compiling {self.name} (first time: minutes; then cached)"
        return f"preparing {self.name}"

    def build(
        self, workload: Workload, size: WorkloadSize, device: str, dtype: torch.dtype,
        dist: Any = None,
    ) -> tuple[Step, Callable[[], None]]:  # fmt: skip
        """A function running one training step (returns the loss), and one to clean up.

        With `dist` (a DistContext of more than one rank), the model is wrapped in
        DistributedDataParallel: after ``initialize`` for the opt levels (their order), by
        TrainStep itself for the trainstep variant (on its capture stream).
        """
        torch.manual_seed(0)
        model, batch = workload.build(size.params, device)
        optimizer = workload.optimizer(model, device)
        inputs = batch[0]
        ddp = dist is not None and dist.distributed

        def wrap(m: torch.nn.Module) -> torch.nn.Module:
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(m, **dist.ddp_kwargs()) if ddp else m

        if self.name != "trainstep" and self.name not in VARIANT_LEVELS:
            model = wrap(model)  # fp32, tf32, torch.amp: nothing is cast, wrap at once
        if self.name in ("fp32", "tf32"):
            on = self.name == "tf32"

            def step() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                with tf32(on):
                    loss = workload.loss(model(inputs), batch)
                    loss.backward()
                    optimizer.step()
                return loss

            return _holding(step, model, optimizer), _noop
        if self.name == "torch.amp":
            scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)

            def step() -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=dtype):
                    out = model(inputs)
                loss = workload.loss(out, batch)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                return loss

            return _holding(step, model, optimizer), _noop
        if self.name == "trainstep":
            train_step = mixprec.TrainStep(
                model, optimizer, compute_loss=lambda m, *b: workload.loss(m(b[0]), b),
                opt_level="O1", dtype=dtype, ddp=dist.ddp_kwargs() if ddp else False,
            )  # fmt: skip

            def run() -> torch.Tensor:
                return train_step(*batch)

            if self.compiles_when_built(device, ddp) and train_step.graphs_compiled == 0:
                # Compile now (`steps_when_built`): the time is reported on its own, and the
                # warm-up that follows times the compiled step.
                start = time.perf_counter()
                built = self.steps_when_built(device, ddp)
                for _ in range(built):
                    run()
                run.compile_s = time.perf_counter() - start  # type: ignore[attr-defined]
                run.built_steps = built  # type: ignore[attr-defined]
            return _holding(run, model, optimizer), _noop
        level = self.name
        model, amp_opt = mixprec.initialize(model, optimizer, level, dtype=dtype)
        model = wrap(model)  # after initialize: O2/O3 cast the weights DDP's buckets are built for

        def step() -> torch.Tensor:
            amp_opt.zero_grad(set_to_none=True)
            loss = workload.loss(model(inputs), batch)
            with mixprec.scale_loss(loss, amp_opt) as scaled:
                scaled.backward()
            amp_opt.step()
            return loss

        return _holding(step, model, amp_opt), _noop

    def matmul_dtype(self, dtype: torch.dtype) -> str:
        """The dtype whose peak matmul rate this variant's % of peak is measured against."""
        if self.name == "tf32":
            return "tf32"
        return dtype_name(dtype) if self.low_precision else "fp32"


def _noop() -> None:
    return None


def _holding(step: Step, model: torch.nn.Module, optimizer: Any) -> Step:
    """`step`, with the training state it keeps between steps as ``step.state()``: a generator
    of tensors, buffers included (the CPU peak-memory figure counts those a compiled step
    reads unseen)."""

    def state() -> Iterator[torch.Tensor]:
        yield from (t for _, t in state_tensors(model, optimizer))
        yield from model.buffers()

    step.state = state  # type: ignore[attr-defined]
    return step


@contextlib.contextmanager
def tf32(enabled: bool) -> Iterator[None]:
    """TF32 tensor cores on or off for matmuls *and* cuDNN convolutions, restored on exit.

    The fp32 baseline needs it off explicitly: torch leaves cuDNN's TF32 on by default (only
    matmuls default to full fp32), so a plain "fp32" ResNet would run its convolutions in TF32.
    cuDNN's flag goes through ``set_flags``, which leaves every other cuDNN setting alone and
    works where ``torch.backends.disable_global_flags()`` refuses plain assignment.
    """
    prev_matmul = torch.backends.cuda.matmul.allow_tf32
    prev_cudnn = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.set_flags(_allow_tf32=enabled, _fp32_precision=None)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_matmul
        torch.backends.cudnn.set_flags(_allow_tf32=prev_cudnn, _fp32_precision=None)


#: The variants that are mixprec opt levels (initialize, then DDP).
VARIANT_LEVELS = ("O1", "O2", "O3")

VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("fp32", "fp32, no autocast (the baseline)", False),
        Variant("tf32", "fp32 weights, TF32 tensor-core matmuls", False),
        Variant("torch.amp", "torch.autocast, plus torch.amp.GradScaler for fp16", True),
        Variant("O1", "mixprec O1: autocast by op policy, fp32 weights", True),
        Variant("O2", "mixprec O2: low-precision model, fp32 master weights", True),
        Variant("O3", "mixprec O3: pure low precision", True),
        Variant(
            "trainstep",
            "mixprec TrainStep (O1): the whole step compiled (CPU) or one CUDA graph (CUDA)",
            True,
        ),
    )
}
