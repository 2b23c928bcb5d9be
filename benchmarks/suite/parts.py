"""The registry: every part of the GPU suite, in priority order, with its command and goals.

A part's command is the real benchmark (or pytest) with its GPU defaults, and with toy sizes on
the CPU when ``ctx.smoke``; its goals are the promises of issue 11 (item 3) and of the earlier
issues they came from. Add a part by appending a `Part` to `PARTS` (see gpu_suite.py).
"""

from __future__ import annotations

import re
from pathlib import Path

from suite import extract as ex
from suite.args import list_error, usage_error
from suite.core import Context, Goal, Part

# pytest.mark.gpu as a decorator or an item of a mark list (pytestmark = [...]), not in a string
GPU_MARK = re.compile(r"(@pytest\.mark\.gpu\b|\bpytest\.mark\.gpu\s*[,\]])")


def _gpu_test_files(ctx: Context) -> list[str]:
    """The test modules that can hold a test marked gpu: all of ``tests`` on a GPU; in smoke
    mode only the files that use the mark, which spares collecting (importing) the whole suite
    on the CPU while still checking that each of them selects its CUDA tests."""
    if not ctx.smoke:
        return ["tests"]
    files = sorted(Path(ctx.root, "tests").glob("test_*.py"))
    return [f"tests/{f.name}" for f in files if GPU_MARK.search(f.read_text())]


def _pytest(ctx: Context, xml: str, *args: str) -> list[str]:
    return [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs",
            f"--junitxml={ctx.path(xml)}", *args]  # fmt: skip


# Smoke runs of ResNet-50 run fp32 and TrainStep only: every variant runs in the MLP and GPT-2
# smoke runs, compiled ones included (even the eager backend traces the whole network for
# seconds on a CPU), and ResNet-50's own risk is its model under the step (bf16 convolutions
# take seconds per step on a CPU without bf16 units: each further row cost about 5 s). For the
# same reason each row runs one step, no warm-up: the step after it (optimizer state in place)
# runs in the MLP and GPT-2 rows.
_RESNET_SMOKE = "fp32,TrainStep O1 fp16,TrainStep O1 bf16"


def _graph_part(workload: str, priority: int, estimate: float, timeout: float,
                goals: tuple[Goal, ...], smoke_variants: str | None = None,
                smoke_warmup: int = 1) -> Part:  # fmt: skip
    name = f"d-{workload}"
    sizes = {"mlp": "seed MLP 3x4096, b512", "resnet50": "ResNet-50 32x32, b128",
             "gpt2": "GPT-2 small b8 T1024"}  # fmt: skip
    return Part(
        name=name, priority=priority, estimate_s=estimate, timeout_s=timeout,
        title=f"graph_step table: {sizes[workload]} (FP32, torch.amp, manual capture, "
        "torch.amp+compile, O1 eager, TrainStep)",
        command=lambda ctx: [ctx.python, "benchmarks/graph_step.py", "--workloads", workload,
                             "--json", ctx.path(f"{name}.json")]
        + (["--warmup", str(smoke_warmup), "--steps", "1", "--rounds", "1", "--batch", "2",
            "--compile-backend", "eager",
            *(["--variants", smoke_variants] if smoke_variants else [])] if ctx.smoke else []),
        extract=lambda ctx, log: ex.extract_graph_step(ctx, log, name),
        goals=(*goals, Goal("max peak / torch.amp peak", "<=", 1.0,
                            f"peak memory <= torch.amp on every mixprec row ({workload})")),
    )  # fmt: skip


_SMOKE_CPU = ["--device", "cpu"]
_FP8_STEP = ["--recipes", "tensorwise,delayed", "--models", "gpt2-medium"]


def _fp8_part(priority: int, name: str, part: str, extra: list[str], estimate: float,
              timeout: float, title: str, goals: tuple[Goal, ...]) -> Part:  # fmt: skip
    """Suite part ``l-fp8-NAME``: `benchmarks/fp8_gpu.py --parts PART` with `extra` options."""
    return Part(
        name=f"l-fp8-{name}", priority=priority, estimate_s=estimate, timeout_s=timeout,
        title=title,
        command=lambda ctx: [ctx.python, "benchmarks/fp8_gpu.py", "--parts", part, "--json",
                             ctx.path(f"l-fp8-{name}.json"),
                             *(["--smoke"] if ctx.smoke else extra)],
        extract=lambda ctx, log: ex.extract_fp8(ctx, log, f"l-fp8-{name}", part),
        goals=goals,
    )  # fmt: skip


# estimate_s: what each part took on the first H100 run (2026-11-27, torch 2.11), with about 20%
# margin; d-* from the H200 run (2026-11-28: 43, 105, 114 s, their manual rows crashed then);
# l-fp8-step/loss have not completed a run, so theirs are still guesses.
PARTS: list[Part] = [
    Part(
        name="a-cuda-tests", priority=10, estimate_s=110, timeout_s=420,
        title="every CUDA test (pytest -m gpu; the autocast lists are part b)",
        # Smoke: every test skips without CUDA, so rewriting their asserts (no pyc cache under
        # PYTHONDONTWRITEBYTECODE) would only cost time; the selection is what it checks.
        # A module that fails to import on the device's torch must not stop the other tests.
        command=lambda ctx: _pytest(ctx, "a.xml", "--continue-on-collection-errors",
                                    "-m", "gpu", "-k",
                                    "not test_cuda_lists_on_gpu",
                                    *(["--assert=plain"] if ctx.smoke else []),
                                    *_gpu_test_files(ctx)),
        extract=ex.extract_cuda_tests, ok_returncodes=(0, 1, 5),
        goals=(Goal("CUDA tests failing", "==", 0, "every CUDA test passes on the GPU"),),
    ),
    Part(
        name="b-autocast-lists", priority=20, estimate_s=30, timeout_s=300,
        title="torch's CUDA autocast test lists on the GPU, fp16 and bf16",
        command=lambda ctx: _pytest(ctx, "b.xml", "tests/test_autocast_lists.py", "-k",
                                    "test_cuda_lists_on_gpu" + (" or test_cpu_nn_16"
                                                                if ctx.smoke else "")),
        extract=ex.extract_autocast_lists, ok_returncodes=(0, 1),
        requires=("torch.testing._internal.autocast_test_lists",),
        goals=(Goal("fp16 entries failing", "==", 0,
                    "torch's CUDA autocast lists, fp16: every entry as torch.autocast"),
               Goal("bf16 entries failing", "==", 0,
                    "torch's CUDA autocast lists, bf16: every entry as torch.autocast")),
    ),
    Part(
        name="c-no-sync", priority=30, estimate_s=20, timeout_s=240,
        title="no host syncs: full steps under set_sync_debug_mode (SGD momentum, Adam "
        "foreach, fused AdamW, unscale_ + clip, O2, TrainStep, watch)",
        command=lambda ctx: [ctx.python, "benchmarks/no_sync.py", "--json", ctx.path("c.json")]
        + (["--device", "cpu", "--warmup", "3", "--window", "3"] if ctx.smoke else []),
        extract=ex.extract_no_sync, ok_returncodes=(0, 1),
        goals=(Goal("max syncs/step (sync-free configurations)", "==", 0,
                    "zero host syncs per step"),),
    ),
    _graph_part("mlp", 40, 60, 360, (
        Goal("TrainStep O1 fp16 / manual fp16", "<=", 1.0,
             "TrainStep <= 1.0x the manual capture, seed MLP, fp16 (time)"),
        Goal("TrainStep O1 bf16 / manual bf16", "<=", 1.0,
             "TrainStep <= 1.0x the manual capture, seed MLP, bf16 (time)"),
    )),
    _graph_part("resnet50", 41, 130, 480, (
        Goal("TrainStep O1 fp16 / manual fp16", "<=", 1.0,
             "TrainStep <= 1.0x the manual capture, ResNet-50, fp16 (time)"),
        Goal("TrainStep O1 bf16 / manual bf16", "<=", 1.0,
             "TrainStep <= 1.0x the manual capture, ResNet-50, bf16 (time)"),
        Goal("TrainStep O1 fp16 / fp32 eager", "<=", 0.2,
             "TrainStep <= 0.2x FP32 eager, ResNet-50 (time, fp16)"),
    ), smoke_variants=_RESNET_SMOKE, smoke_warmup=0),
    _graph_part("gpt2", 42, 150, 540, (
        Goal("TrainStep O1 bf16+compile / torch.amp+compile bf16", "<=", 1.0,
             "GPT-2 small: TrainStep + compile <= 1.0x torch.amp + compile (time)"),
    )),
    Part(
        name="e-scaler", priority=50, estimate_s=20, timeout_s=240,
        title="GradScaler step+update vs torch's on the seed MLP; unscale of 100M elements",
        command=lambda ctx: [ctx.python, "benchmarks/scaler_overhead.py", "--json",
                             ctx.path("e-scaler.json")]
        + ([*_SMOKE_CPU, "--rounds", "2", "--width", "64", "--batch", "16", "--steps", "2",
            "--tensors", "10", "--per-tensor", "1000"] if ctx.smoke else []),
        extract=ex.extract_scaler,
        goals=(Goal("step+update speed-up vs torch (mixprec default)", ">=", 1.3,
                    "GradScaler step+update >= 1.3x faster than torch's (seed MLP)"),
               Goal("unscale throughput vs torch (default)", ">=", 0.9,
                    "unscale throughput within 10% of torch's (100M elements)")),
    ),
    Part(
        name="e-autocast", priority=51, estimate_s=20, timeout_s=180,
        title="autocast overhead on the GPU-bound 3x4096 MLP at batch 8192",
        command=lambda ctx: [ctx.python, "benchmarks/autocast_overhead.py", "--workloads",
                             "gpu-bound", "--json", ctx.path("e-autocast.json")]
        + ([*_SMOKE_CPU, "--width", "128", "--batch", "64", "--rounds", "3", "--steps", "2"]
           if ctx.smoke else []),
        extract=ex.extract_autocast, ok_returncodes=(0, 1),  # 1: goal missed, JSON written
        goals=(Goal("mixprec / torch.autocast (gpu-bound)", "<=", 1.02,
                    "GPU-bound autocast within 2% of torch.autocast"),),
    ),
    Part(
        name="f-opt-levels", priority=60, estimate_s=45, timeout_s=300,
        title="opt_levels.py on GPT-2 small: time and peak memory per level vs torch.amp",
        command=lambda ctx: [ctx.python, "benchmarks/opt_levels.py", "--json", ctx.path("f.json")]
        + ([*_SMOKE_CPU, "--steps", "1", "--warmup", "1", "--batch", "2"] if ctx.smoke else []),
        extract=ex.extract_opt_levels,
        goals=(Goal("O2 peak / O1 peak", "<", 1.0, "O2 peak memory below O1 on GPT-2 small"),
               Goal("max peak / torch.amp peak", "<=", 1.0,
                    "peak memory <= torch.amp on every row (O1-O3, GPT-2 small)")),
    ),
    Part(
        name="g-watch", priority=70, estimate_s=75, timeout_s=300,
        title="the watch's cost on CUDA (no watch / ops=False / ops=True), no sync allowed",
        command=lambda ctx: [ctx.python, "benchmarks/watch_overhead.py", "--json",
                             ctx.path("g-watch.json")]
        # Smoke: batch 4, not the CPU size's 64, whose bf16 steps took 0.5 s each (9 of them)
        + ([*_SMOKE_CPU, "--rounds", "1", "--steps", "1", "--workloads", "mlp", "--batch", "4"]
           if ctx.smoke else []),
        extract=ex.extract_watch,
    ),
    Part(
        name="g-nan", priority=71, estimate_s=35, timeout_s=240,
        title="examples/resnet50_fp16_nan.py: fp16 vs bf16 at lr 0.1, with the watch",
        command=lambda ctx: [ctx.python, "examples/resnet50_fp16_nan.py", "--json",
                             ctx.path("g-nan.json")]
        + ([*_SMOKE_CPU, "--dtypes", "bf16", "--width", "8", "--steps", "3", "--batch", "8"]
           if ctx.smoke else []),
        extract=ex.extract_nan,
    ),
    Part(
        name="i-graph-amp", priority=75, estimate_s=150, timeout_s=420,
        title="graph-level AMP (mixprec.compile) vs torch.autocast + compile, inductor: "
        "GPT-2-like, Linear-LayerNorm ping-pong, Llama",
        command=lambda ctx: [ctx.python, "benchmarks/graph_amp.py", "--json",
                             ctx.path("i-graph-amp.json")]
        + (["--device", "cpu", "--smoke", "--rounds", "1", "--steps", "1", "--compile-backend",
            "eager", "--workloads", "gpt2"] if ctx.smoke else ["--device", "cuda"]),
        extract=ex.extract_graph_amp,
        goals=(Goal("mixprec.compile (exact) / torch.autocast+compile (gpt2-like)", "<=", 1.0,
                    "mixprec.compile <= 1.0x torch.autocast + compile (GPT-2-like, time)"),),
    ),
    Part(
        name="j-ddp", priority=76, estimate_s=25, timeout_s=240,
        title="TrainStep under DDP: the whole step, DDP's all-reduce included, one CUDA graph",
        command=lambda ctx: [ctx.python, "benchmarks/ddp_trainstep.py", "--json",
                             ctx.path("j-ddp.json")]
        # tests/test_gpu_suite.py checks the smoke run's records and the script's own checks;
        # 18 steps: the fewest that reach the inf injected at step 15 and the skip after it.
        # The ranks fork from the part, which has torch imported: a server of their own would
        # import it again (seconds of CPU a run).
        + (["--device", "cpu", "--steps", "18", "--width", "32", "--batch", "8",
            "--start-method", "fork"] if ctx.smoke else ["--nproc", "1"]),
        extract=ex.extract_ddp, ok_returncodes=(0, 1),  # 1: a check failed, JSON written
        goals=(Goal("failed checks", "==", 0,
                    "DDP step captured, equal to eager, ranks agree (TrainStep ddp=True)"),),
    ),
    Part(
        name="k-fsdp-memory", priority=77, estimate_s=35, timeout_s=240,
        title="memory per rank under FSDP2: fp32, FSDP2's policy, mixprec O2",
        command=lambda ctx: [ctx.python, "benchmarks/fsdp_memory.py", "--json",
                             ctx.path("k-fsdp.json")]
        # The ranks fork from the part (see j-ddp).
        + (["--device", "cpu", "--nproc", "2", "--width", "32", "--depth", "2",
            "--start-method", "fork"] if ctx.smoke
           else ["--device", "cuda", "--nproc", "1", "--width", "2048", "--depth", "8"]),
        extract=ex.extract_fsdp_memory,
        goals=(Goal("O2 total - FSDP2 policy total (bytes)", "==", 0,
                    "O2 on FSDP2 adds no fp32 copy beyond FSDP2's own"),),
    ),
    _fp8_part(78, "gemm", "gemm", [], 20, 300,
              "FP8 GEMM and layer forward+backward vs bf16, GPT-2-medium shapes",
              (Goal("FP8 GEMM speed-up, large shapes (min)", ">=", 1.3,
                    "FP8 GEMM >= 1.3x bf16 (MLP up/down, GPT-2 medium)"),)),
    # The step's goal needs only the captured GPT-2 medium rows (about a minute); the compiled
    # rows compile GPT-2 medium once each, so they are a part of their own (the last).
    _fp8_part(79, "step", "step", [*_FP8_STEP, "--step-variants", "captured"], 150, 400,
              "GPT-2 medium step, captured: FP8 TrainStep (tensorwise, delayed) vs bf16 "
              "TrainStep, with peak memory",
              (Goal("GPT-2 medium FP8 TrainStep / bf16 TrainStep speed-up", ">=", 1.15,
                    "GPT-2 medium step with FP8 >= 1.15x bf16 TrainStep"),)),
    _fp8_part(80, "loss", "loss", [], 240, 480,
              "GPT-2 small trained with FP8 vs bf16: final loss vs bf16's spread",
              (Goal("FP8 recipes outside bf16 loss spread", "==", 0,
                    "FP8 loss within bf16's seed-to-seed spread, every recipe"),)),
    Part(
        name="h-bench", priority=80, estimate_s=150, timeout_s=480,
        title="mixprec bench all --full, with JSON and PNG",
        command=lambda ctx: [ctx.python, "-m", "mixprec", "bench",
                             "mlp" if ctx.smoke else "all", "--no-progress",
                             "--json", ctx.path("h.json"), "--plot", ctx.path("h.png")]
        # Smoke: three rows are enough to check the command and its extraction; every row,
        # TrainStep's compile included, runs in tests/test_cli.py's tiny bench. A 1 s budget
        # fits the 16-bit rows to a small size (the CPU size's take 0.5 s a step), as the
        # default budget does on a slow CPU.
        + (["--device", "cpu", "--steps", "1", "--warmup", "0", "--variants",
            "fp32,torch.amp,O1", "--budget", "1"] if ctx.smoke else ["--full"]),
        extract=ex.extract_bench, artefacts=(("h.png", "bench.png"),),
        goals=(Goal("max peak / torch.amp peak", "<=", 1.0,
                    "peak memory <= torch.amp on every row (mixprec bench --full)"),),
    ),
    _fp8_part(81, "step-compiled", "step", [*_FP8_STEP, "--step-variants", "compiled"], 420, 590,
              "GPT-2 medium step, compiled: FP8 TrainStep + compile vs bf16 TrainStep + compile "
              "vs torch.amp + compile", ()),
]  # fmt: skip


def select(parts: list[Part], only: str | None, prog: str = "gpu_suite") -> list[Part]:
    """The parts named by --only: full names, or the letter before the first '-' (``d``).

    None: every part. A name that is no part's, an empty item (``h,,d``), an empty list or a
    name given twice is a usage error (`UsageError`: exit status 2, the message on stderr).
    """
    if only is None:
        return sorted(parts, key=lambda p: p.priority)
    names = [p.name for p in parts]
    letters = list(dict.fromkeys(p.name.split("-", 1)[0] for p in parts if "-" in p.name))
    also = f" (or a letter: {', '.join(letters)})" if letters else ""
    for w in (w.strip() for w in only.split(",")):
        if w and w not in names and w not in letters:
            usage_error(prog, f"--only {w!r} names no part. Valid: {', '.join(names)}{also}.")
    wanted, error = list_error(only, [*names, *letters], "--only", shown=names, also=also)
    if error:
        usage_error(prog, error)
    chosen = []
    for w in wanted:
        chosen += [p for p in parts if (p.name == w or p.name.split("-", 1)[0] == w)
                   and p not in chosen]  # fmt: skip
    return sorted(chosen, key=lambda p: p.priority)
