"""The ``mixprec`` command line: ``bench``, ``train``, ``policy`` and ``explain``.

The commands are thin: they parse and validate arguments (every output path is checked before
any work starts), then call `mixprec.bench`'s runner, trainer and report functions.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

from mixprec._version import __version__

__all__ = ["main"]

_EPILOG = """\
examples:
  mixprec bench                          # every workload; fits 60 s on a CPU, seeds' sizes on a GPU
  mixprec bench mlp --full --json r.json --plot r.png
  mixprec train                          # fp32 vs O1 vs O2 on scikit-learn's digits
  mixprec train --data cifar10:~/data/cifar-10-batches-py --model resnet50 --epochs 30
  mixprec policy --device cuda --op softmax layer_norm
  mixprec explain resnet50 --dtype fp16  # which op ran in which precision, casts, ping-pong
  mixprec train --nproc-per-node 2       # data-parallel (DDP) in 2 processes, torchrun underneath
  torchrun --nproc-per-node 8 -m mixprec bench gpt2   # or launch with torchrun yourself
"""


class CliError(Exception):
    """A user error: printed without a traceback, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    from mixprec.bench.budget import DEFAULT_CPU_BUDGET_S
    from mixprec.bench.train import MODELS, MODES
    from mixprec.bench.variants import VARIANTS
    from mixprec.bench.workloads import WORKLOADS

    parser = argparse.ArgumentParser(
        prog="mixprec",
        description="mixprec: automatic mixed-precision training for PyTorch. Runs matmuls and "
        "convolutions in bf16/fp16 and precision-sensitive ops in fp32, with an op policy you "
        "can read and edit, a loss scaler that never waits for the GPU, and opt levels O0-O3.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true",
                        help="print the mixprec, torch and Python versions")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    bench = sub.add_parser(
        "bench",
        help="time fp32, torch.amp and mixprec's levels side by side on the classic workloads",
        description="Time one training step of each workload under each variant, side by side "
        "in one run: ms/step (median after warm-up), speed-up over fp32 and torch.amp, peak GPU "
        "memory, final loss and the share of the device's matmul peak. It first measures the "
        "device's fp32 and 16-bit matmul rates and says what this machine can show. On a CPU "
        "the run fits a time budget (--budget, default "
        f"{DEFAULT_CPU_BUDGET_S:g} s of measuring; start-up, compiling and reading memory events "
        "come on top: the first run compiles the TrainStep rows, which takes minutes on a "
        "small CPU, and later runs reuse the compile cache): "
        "where the default sizes do not fit (a CPU without fast bf16 runs it at 1/100 of fp32's "
        "rate) the workloads shrink and their rows are marked 'reduced', each next to an fp32 "
        "row at the same size. On a GPU, and with --full, the seeds' sizes run in full. "
        "Variants that cannot run here are listed with the reason.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="workloads:\n" + "\n".join(
            f"  {w.name:9s} {w.title}\n"
            f"            CPU:        {w.small.description}, "
            f"{w.small.warmup}+{w.small.steps} steps\n"
            f"            GPU/--full: {w.full.description}, "
            f"{w.full.warmup}+{w.full.steps} steps\n"
            f"            reduced:    down to {w.reduced[-1].description}"
            for w in WORKLOADS.values()
        ) + "\nvariants:\n" + "\n".join(f"  {v.name:10s} {v.title}" for v in VARIANTS.values()),
    )  # fmt: skip
    bench.add_argument("benchmark", nargs="?", default="all",
                       help=f"{' | '.join(WORKLOADS)} | all (default: all)")  # fmt: skip
    bench.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    bench.add_argument("--dtype", default="auto",
                       help="auto | bf16 | fp16 (default: fp16 on CUDA, bf16 on CPU)")  # fmt: skip
    bench.add_argument("--variants", default=",".join(VARIANTS),
                       help="comma-separated, from: " + ", ".join(VARIANTS))  # fmt: skip
    bench.add_argument(
        "--budget",
        default="auto",
        metavar="SECONDS",
        help=f"seconds the measuring may take; sizes and steps shrink to fit (default 'auto': "
        f"{DEFAULT_CPU_BUDGET_S:g} on a CPU without --full, none on a GPU; 'none': the default "
        f"sizes and steps, however long)",
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per variant (default: the workload's, 5-20, fewer to fit a budget)",
    )
    bench.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed warm-up steps first (default: the workload's)",
    )
    bench.add_argument("--full", action="store_true",
                       help="the seeds' exact sizes even on a CPU (slow there)")  # fmt: skip
    bench.add_argument("--malloc", choices=("system", "keep"), default="system",
                       help="CPU: 'keep' calls mixprec.keep_cpu_memory() first, so steps reuse "
                       "freed memory instead of faulting in fresh pages (every row alike; "
                       "default: system, the allocator as it is)")  # fmt: skip
    bench.add_argument("--json", metavar="PATH", help="write the rows as JSON records")
    bench.add_argument("--plot", metavar="PATH", help="write a PNG bar chart (needs matplotlib)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.add_argument("--nproc-per-node", type=int, metavar="N",
                       help="run data-parallel in N processes (DDP, torchrun underneath; one "
                       "GPU each on CUDA, gloo on the CPU); each rank runs the workload's "
                       "batch")  # fmt: skip

    train = sub.add_parser(
        "train",
        help="train an image classifier in fp32 and AMP modes; plot and compare accuracy",
        description="Train the same model from the same seed in each mode, evaluate the test "
        "set after every epoch, and write one PNG (loss and accuracy against steps and against "
        "wall time) and a JSON file to --out. The summary puts each mode's final accuracy next "
        "to fp32's seed-to-seed spread (use --seeds 3 or more for a spread).",
    )
    train.add_argument("--data", default="digits",
                       help="digits (default; bundled with scikit-learn) | synthetic | "
                       "cifar10:PATH (CIFAR-10's python batches in PATH)")  # fmt: skip
    train.add_argument("--model", default="cnn", help=f"{' | '.join(MODELS)} (default: cnn)")
    train.add_argument(
        "--modes",
        default="fp32,O1,O2",
        help=f"comma-separated, from: {', '.join(MODES)} (default: fp32,O1,O2)",
    )
    train.add_argument(
        "--epochs", type=int, default=10, help="passes over the training set (default: 10)"
    )
    train.add_argument("--batch-size", type=int, default=64, help="default: 64")
    train.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    train.add_argument(
        "--dtype", default="auto", help="auto | bf16 | fp16 (default: fp16 on CUDA, bf16 on CPU)"
    )
    train.add_argument("--seed", type=int, default=0, help="first seed (default: 0)")
    train.add_argument("--seeds", type=int, default=1, help="how many seeds per mode (default: 1)")
    train.add_argument(
        "--out", default="mixprec-train", help="output folder, created (default: mixprec-train)"
    )
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write TensorBoard scalars to DIR/<mode>-seed<k>: train/test loss and accuracy "
        "per epoch and, for mixprec modes with loss scaling, the loss scale and skipped steps of "
        "every step (read off the device every 50 steps; needs the tensorboard extra besides "
        "plots and data: pip install -e '.[plots,data,tensorboard]' in the checkout)",
    )
    train.add_argument("--nproc-per-node", type=int, metavar="N",
                       help="train data-parallel in N processes (DDP, torchrun underneath; one "
                       "GPU each on CUDA, gloo on the CPU); --batch-size is the global batch, "
                       "split evenly across the N ranks")  # fmt: skip

    pol = sub.add_parser(
        "policy",
        help="show which precision each op runs in, and why",
        description="Print the op policy for a device type: every listed op by category, or "
        "the decision and its reason for the ops named with --op.",
    )
    pol.add_argument("--device", default="cpu", help="cuda, cpu, xpu or mps (default: cpu)")
    pol.add_argument("--dtype", default=None, help="bf16 or fp16 (default: the device's)")
    pol.add_argument("--policy", default="",
                     help="policy string, e.g. 'compute=bf16,fp32=softmax+layer_norm'")  # fmt: skip
    pol.add_argument("--op", nargs="+", metavar="OP", help="ops to explain (default: all)")

    exp = sub.add_parser(
        "explain",
        help="run one forward of a bench model and show what ran in which precision, and why",
        description="Run one forward (and with --backward one backward) of a bench model under "
        "mixprec.autocast and print every call: module, op, the policy rule and its reason, "
        "dtypes in / computed in / out, the casts inserted; then where casts ping-pong between "
        "fp32 and low precision and the share of matmul/convolution FLOPs in low precision. "
        "Pass-through calls without casts are hidden unless --all.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="models: " + ", ".join(WORKLOADS) + " (the bench workloads, CPU sizes unless "
        "--full or on a GPU)\nexample:\n  mixprec explain gpt2 --policy "
        "'fp32=layer_norm' --json explain.json",
    )
    exp.add_argument("model", nargs="?", default="resnet50",
                     help=f"one of {', '.join(WORKLOADS)} (default: resnet50)")  # fmt: skip
    exp.add_argument("--device", default="auto", help="auto, cpu or cuda (default: auto)")
    exp.add_argument("--dtype", default="auto",
                     help="auto, bf16 or fp16 (default: fp16 on CUDA, bf16 on CPU)")  # fmt: skip
    exp.add_argument("--policy", default="",
                     help="policy string, e.g. 'fp32=layer_norm' (default: none)")  # fmt: skip
    exp.add_argument("--batch", type=int, default=2,
                     help="examples in the batch (default: 2; one forward is enough)")  # fmt: skip
    exp.add_argument("--full", action="store_true", help="the seeds' model sizes on a CPU too")
    exp.add_argument("--backward", action="store_true", help="also count the backward's FLOPs")
    exp.add_argument("--all", action="store_true", help="also list pass-through calls")
    exp.add_argument("--json", metavar="PATH", help="write the whole report as JSON")
    return parser


# ------------------------------------------------------------------------------- helpers


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cpu", "cuda"):
        raise CliError(f"unknown --device {name!r}. Valid: 'auto', 'cpu' or 'cuda'.")
    if name == "cuda" and not torch.cuda.is_available():
        raise CliError(
            "--device cuda was requested, but CUDA is not available (this torch build has no "
            "CUDA, or no GPU is visible). Use --device cpu, or auto."
        )
    return name


def _dtype(name: str, device: str) -> Any:
    import torch

    from mixprec.dtypes import parse_dtype

    if name == "auto":
        return torch.float16 if device == "cuda" else torch.bfloat16
    if name not in ("bf16", "fp16", "bfloat16", "float16"):
        raise CliError(f"unknown --dtype {name!r}. Valid: 'auto', 'bf16' or 'fp16'.")
    return parse_dtype(name, low_only=True)


def _budget(value: str, device: str, full: bool) -> float | None:
    """Seconds for `mixprec bench`: a CPU run without --full fits the default; else none."""
    from mixprec.bench.budget import DEFAULT_CPU_BUDGET_S

    if value == "auto":
        return DEFAULT_CPU_BUDGET_S if device == "cpu" and not full else None
    if value == "none":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise CliError(
            f"--budget {value!r} is not a number of seconds > 0. Valid: a number such as 60, "
            "'auto' (the default) or 'none' (the default sizes and steps, however long)."
        )
    return seconds


def _choices(value: str, valid: Sequence[str], flag: str) -> list[str]:
    """The names of a comma-separated option, each valid and given once.

    An empty item (``O1,,O2``, a trailing comma) or a name given twice is refused, not dropped
    or run twice: it is most often a name left out by mistake, and a run that quietly compares
    fewer (or repeated) rows than were asked for reads as an answer to the question asked.
    """
    names = [v.strip() for v in value.split(",")]
    bad = [n for n in names if n and n not in valid]
    # The fix, spelt with the user's own names where there are some (O1,,O2 -> O1,O2).
    given = ",".join(dict.fromkeys(n for n in names if n)) or ",".join(valid[:2])
    example = f"{flag} {given}"
    if bad:
        raise CliError(
            f"unknown {flag} {', '.join(map(repr, bad))}. "
            f"Valid: {', '.join(valid)} (comma-separated)."
        )
    if not any(names):
        raise CliError(
            f"{flag} {value!r} names nothing. Name at least one, comma-separated (e.g. "
            f"{example}). Valid: {', '.join(valid)}."
        )
    if "" in names:
        raise CliError(
            f"{flag} {value!r} has an empty item (two commas in a row, or a comma at an end). "
            f"Drop the extra comma ({example}) or name the one left out. "
            f"Valid: {', '.join(valid)}."
        )
    twice = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if twice:
        raise CliError(
            f"{flag} {value!r} names {', '.join(map(repr, twice))} more than once; give each "
            f"name once: {example}. Valid: {', '.join(valid)}."
        )
    return names


# What people type to pick the precisions that run, and the option that does it in each command.
_SELECTORS = {
    "bench": "--variants",
    "train": "--modes",
}
_SELECTOR_GUESSES = (
    "--mode", "--modes", "--variant", "--variants", "--level", "--levels", "--opt-level",
    "--opt-levels", "--opt_level", "--precision", "--amp",
)  # fmt: skip


def _unknown_arguments(command: str, unknown: Sequence[str], argv: Sequence[str]) -> str:
    """The error for arguments `command` does not take, pointing to the option meant.

    `argv` is the whole command line: the value after an unknown option may have been taken by
    argparse as a positional argument (``bench --mode O5`` reads O5 as the benchmark).
    """
    import difflib

    from mixprec.bench.train import MODES
    from mixprec.bench.variants import VARIANTS

    first = unknown[0]
    flag, _, value = first.partition("=")
    at = list(argv).index(first) if first in argv else -1
    if not value and 0 <= at < len(argv) - 1 and not argv[at + 1].startswith("-"):
        value = argv[at + 1]
    selector = _SELECTORS[command]
    valid = list(VARIANTS) if command == "bench" else list(MODES)
    if flag in _SELECTOR_GUESSES and flag != selector:
        names = [v.strip() for v in value.split(",") if v.strip()]
        bad = [n for n in names if n not in valid]
        what = "variant" if command == "bench" else "mode"
        if bad:
            verdict = f"{', '.join(map(repr, bad))} is not a valid {what}. "
        elif names:
            verdict = f"Use {selector} {','.join(names)}. "
        else:
            verdict = ""
        return (
            f"{flag} is not an option of mixprec {command}: the precisions to run are chosen "
            f"with {selector} (comma-separated). {verdict}Valid {what}s: {', '.join(valid)} "
            f"(e.g. {selector} fp32,O1,O2). `mixprec {command} --help` describes each."
        )
    if not flag.startswith("-"):
        return (
            f"unexpected argument {first!r}. `mixprec {command} --help` lists the arguments "
            f"and options."
        )
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = list(commands.choices[command]._option_string_actions)
    close = difflib.get_close_matches(flag, options, n=2)
    hint = f" Did you mean {' or '.join(close)}?" if close else ""
    return f"unknown option {flag}.{hint} `mixprec {command} --help` lists every option."


class _Progress:
    """A progress bar that says what runs now (tqdm if installed, one line per item otherwise).

    Call it with a label when something starts; `done` counts items finished, `total` re-sets
    the number expected. Labels longer than the terminal line are cut at the end.
    """

    def __init__(self, total: int, enabled: bool, name: str) -> None:
        from mixprec._optional import tqdm_or_none

        self.enabled, self.name, self.done, self.printed = enabled, name, 0, 0.0
        self.total = total
        self.bar = None
        if not enabled:
            return
        tqdm = tqdm_or_none()
        if tqdm is None:
            from mixprec._optional import install_hint

            hint = install_hint(["plots"], ["tqdm"])
            print(f"({name}: {hint} for a progress bar)", file=sys.stderr)
            return
        self.bar = tqdm(total=total, desc=name, file=sys.stderr, leave=False,
                        bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]{postfix}")  # fmt: skip

    def __call__(self, label: str, done: int = 0, total: int | None = None) -> None:
        if not self.enabled:
            return
        if total is not None:
            self.total = total
        self.done += done
        if self.bar is None:  # plain lines: one per finished item, else at most one a second
            now = time.monotonic()
            if done or now - self.printed >= 1.0:
                self.printed = now
                print(f"[{self.done}/{self.total}] {label}", file=sys.stderr)
            return
        if total is not None:
            self.bar.total = total
        self.bar.update(done)
        self.bar.set_postfix_str(textwrap.shorten(label, 90, placeholder="..."))

    def note(self, text: str) -> None:
        """A line to keep on screen above the bar (what the user should know now)."""
        if not self.enabled:
            return
        if self.bar is None:
            print(text, file=sys.stderr)
        else:
            self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_nproc(args: argparse.Namespace, device: str) -> None:
    """Refuse a --nproc-per-node that cannot work, before any other work starts."""
    from mixprec.distributed.launch import in_worker

    n = args.nproc_per_node
    if n is None:
        return
    if n < 1:
        raise CliError(f"--nproc-per-node must be >= 1, got {n}.")
    if in_worker():
        raise CliError(
            f"--nproc-per-node was given to a process torchrun started (WORLD_SIZE="
            f"{os.environ.get('WORLD_SIZE')}): the command already runs data-parallel. Drop "
            f"--nproc-per-node, or run mixprec without torchrun."
        )
    if device == "cuda" and n > _gpus():
        raise CliError(
            f"--nproc-per-node {n} needs {n} GPUs (one per process); this machine has "
            f"{_gpus()}. Use --nproc-per-node {_gpus()}, or --device cpu."
        )


def _launch(args: argparse.Namespace) -> int | None:
    """With --nproc-per-node N > 1: run this command in N processes under torchrun; their status.

    None: run here (no flag, or N = 1).
    """
    from mixprec.distributed.launch import launch

    n = args.nproc_per_node
    if n is None or n == 1:
        return None
    return launch(n, _without_nproc(args.argv))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _without_nproc(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            out.append(arg)
    return out


def _join(device: str) -> Any:
    """This process's place in a torchrun job (rank 0 of 1 outside one), as a context manager."""
    from mixprec.distributed.launch import joined

    return joined(device)


# ------------------------------------------------------------------------------- commands


def _bench(args: argparse.Namespace) -> int:
    from mixprec.bench import report, runner
    from mixprec.bench.variants import VARIANTS
    from mixprec.bench.workloads import WORKLOADS

    if args.benchmark != "all" and args.benchmark not in WORKLOADS:
        raise CliError(
            f"unknown benchmark {args.benchmark!r}. Valid: {', '.join(WORKLOADS)} or all."
        )
    workloads = list(WORKLOADS) if args.benchmark == "all" else [args.benchmark]
    variants = _choices(args.variants, list(VARIANTS), "--variants")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    _check_nproc(args, device)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            report.check_writable(path, flag)
    if args.plot:
        report.require_matplotlib()
    for flag, value in (("--steps", args.steps), ("--warmup", args.warmup)):
        if value is not None and value < (1 if flag == "--steps" else 0):
            raise CliError(f"{flag} must be {'>= 1' if flag == '--steps' else '>= 0'}.")
    budget = _budget(args.budget, device, args.full)
    launched = _launch(args)
    if launched is not None:
        return launched
    memory = None
    if args.malloc == "keep" and device == "cpu":
        from mixprec.cpu_memory import keep_cpu_memory

        memory = keep_cpu_memory()
    with _join(device) as ctx:
        progress = _Progress(1 + len(workloads) * len(variants),
                             not args.no_progress and ctx.is_main, "bench")  # fmt: skip
        try:
            rows, info = runner.run(workloads, variants, device=device, dtype=dtype,
                                    full=args.full, steps=args.steps, warmup=args.warmup,
                                    budget=budget, progress=progress, note=progress.note,
                                    dist=ctx)  # fmt: skip
        finally:
            progress.close()
    if not ctx.is_main:
        return 0
    meta = {**report.metadata(device), **info, "world_size": ctx.world_size}
    if memory is not None:
        meta["malloc"] = str(memory)
    print(report.render_table(rows, meta))
    if args.json:
        report.write_json(args.json, rows, meta)
        print(f"\nwrote {args.json}")
    if args.plot:
        report.write_plot(args.plot, rows, meta)
        print(f"wrote {args.plot}")
    return 0


def _require_train_extras(args: argparse.Namespace) -> None:
    """Every optional package this `mixprec train` command needs, checked at once, named all."""
    from mixprec._optional import require_extras

    needs = [("matplotlib", "matplotlib", "plots")]  # train.png is always written
    if args.data == "digits":
        needs.append(("sklearn", "scikit-learn", "data"))
    if args.tensorboard:
        needs.append(("tensorboard", "tensorboard", "tensorboard"))
    feature = "mixprec train" + (" --tensorboard" if args.tensorboard else "")
    require_extras(feature, needs)


def _train(args: argparse.Namespace) -> int:
    import json

    from mixprec.bench import data as datasets
    from mixprec.bench import report, train
    from mixprec.dtypes import dtype_name

    modes = _choices(args.modes, list(train.MODES), "--modes")
    if args.model not in train.MODELS:
        raise CliError(f"unknown --model {args.model!r}. Valid: {', '.join(train.MODELS)}.")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    _check_nproc(args, device)
    for flag, value in (("--epochs", args.epochs), ("--batch-size", args.batch_size),
                        ("--seeds", args.seeds)):  # fmt: skip
        if value < 1:
            raise CliError(f"{flag} must be >= 1, got {value}.")
    from mixprec.distributed.topology import launched_world_size

    world = args.nproc_per_node if args.nproc_per_node is not None else launched_world_size()
    if args.batch_size % world:
        near = world * max(1, round(args.batch_size / world))
        raise CliError(
            f"--batch-size {args.batch_size} cannot be split evenly across {world} ranks: it "
            f"is the global batch. Use a multiple of {world}, e.g. --batch-size {near}."
        )
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as err:
        raise CliError(f"--out {args.out!r} cannot be created: {err.strerror}.") from err
    png, out_json = os.path.join(args.out, "train.png"), os.path.join(args.out, "train.json")
    for path in (png, out_json):
        report.check_writable(path, "--out")
    _require_train_extras(args)
    if args.tensorboard:
        try:
            os.makedirs(args.tensorboard, exist_ok=True)
        except OSError as err:
            raise CliError(
                f"--tensorboard {args.tensorboard!r} cannot be created: {err.strerror}."
            ) from err
        from mixprec.integrations.tensorboard import TensorBoardSink  # fails naming the extra

        del TensorBoardSink
    data = datasets.load(args.data)
    launched = _launch(args)
    if launched is not None:
        return launched
    seeds = list(range(args.seed, args.seed + args.seeds))
    with _join(device) as ctx:
        if ctx.is_main:
            ranks = f"; {ctx.world_size} ranks ({ctx.backend})" if ctx.distributed else ""
            print(f"{data.describe()}; model {args.model}; {device} {dtype_name(dtype)}; modes "
                  f"{', '.join(modes)}; {args.epochs} epochs; seeds {seeds}{ranks}")  # fmt: skip
        progress = _Progress(len(modes) * len(seeds) * args.epochs,
                             not args.no_progress and ctx.is_main, "train")  # fmt: skip
        try:
            records = train.train(data, model=args.model, modes=modes, epochs=args.epochs,
                                  batch_size=args.batch_size, device=device, dtype=dtype,
                                  seeds=seeds, tick=progress, dist=ctx,
                                  tensorboard=args.tensorboard)  # fmt: skip
        finally:
            progress.close()
    if not ctx.is_main:
        return 0
    summary = train.summarize(records)
    meta = {**report.metadata(device), "world_size": ctx.world_size}
    print(f"\n  {'mode':10s} {'test accuracy':>22s} {'train time':>11s} {'x fp32':>7s} "
          f"{'B/param':>8s}  vs fp32")  # fmt: skip
    for r in summary:
        acc = f"{100 * r['accuracy_mean']:.2f}% +- {100 * r['accuracy_std']:.2f}"
        speed = "-" if r["speedup_vs_fp32"] is None else f"{r['speedup_vs_fp32']:.2f}x"
        verdict = ("-" if r["within_noise_of_fp32"] is None else
                   "within noise" if r["within_noise_of_fp32"] else "OUTSIDE noise")  # fmt: skip
        held = r.get("state_bytes_per_param")
        held = "-" if held is None else f"{held:.2f}"
        print(f"  {r['mode']:10s} {acc:>22s} {r['train_time_s']:10.1f}s {speed:>7s} {held:>8s}  "
              f"{verdict}")  # fmt: skip
    if len(seeds) == 1:
        print("  (one seed: the noise band is a floor of 0.5 points; use --seeds 3 for a spread)")
    print(
        "  (B/param: training state held after backward, per parameter: weights, gradients, "
        "masters, optimizer state; mixprec.memory_report)"
    )
    title = (f"mixprec train: {data.name}, {args.model}, {device} {dtype_name(dtype)}, "
             f"{len(seeds)} seed(s), torch {meta['torch']}")  # fmt: skip
    train.plot(png, records, title)
    with open(out_json, "w") as fh:
        json.dump({"meta": {**meta, "data": data.describe(), "model": args.model,
                            "dtype": dtype_name(dtype), "seeds": seeds},
                   "summary": summary, "records": records}, fh, indent=1)  # fmt: skip
    print(f"\nwrote {png} and {out_json}")
    if args.tensorboard:
        print(f"wrote TensorBoard logs to {args.tensorboard} (tensorboard --logdir "
              f"{args.tensorboard})")  # fmt: skip
    return 0


def _policy(args: argparse.Namespace) -> int:
    from mixprec.dtypes import dtype_name, resolve_dtype
    from mixprec.policy import OpCategory, Policy

    policy = Policy.from_string(args.policy)
    choice = resolve_dtype(args.device, args.dtype, policy.compute)
    # Every --op decided before anything is printed: a bad name is an error, not a tail.
    decisions = [policy.decide(op, device_type=args.device, dtype=choice.dtype)
                 for op in args.op or ()]  # fmt: skip
    print(f"policy: {policy}")
    print(f"device: {args.device}, low dtype: {dtype_name(choice.dtype)} ({choice.reason})")
    if args.op:
        for decision in decisions:
            print(decision)
        return 0
    resolved = policy.resolve(args.device, choice.dtype)
    for cat in OpCategory:
        if cat in (OpCategory.PASSTHROUGH, OpCategory.FP8):
            continue
        names = sorted(n for n, c in resolved.ops.items() if c is cat)
        print(f"\n{cat.value} ({len(names)} ops): {cat.summary}")
        print("  " + ", ".join(names) if names else "  (none)")
    print("\nEvery other op runs in its input dtype (passthrough).")
    if policy.modules:
        rules = "+".join(map(str, policy.modules))
        print(f"\nfp8 (linear layers, where FP8 is on): {OpCategory.FP8.summary}\n  rules: {rules}")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from mixprec.bench import report
    from mixprec.bench.workloads import WORKLOADS
    from mixprec.diagnostics import explain

    if args.model not in WORKLOADS:
        raise CliError(f"unknown model {args.model!r}. Valid: {', '.join(WORKLOADS)}.")
    if args.batch < 1:
        raise CliError(f"--batch must be >= 1, got {args.batch}.")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    if args.json:
        report.check_writable(args.json, "--json")
    workload = WORKLOADS[args.model]
    model, batch = workload.build(workload.size(args.full, device).params, device)
    result = explain(model, batch[0][: args.batch], device_type=device, dtype=dtype,
                     policy=args.policy or None, backward=args.backward)  # fmt: skip
    print(f"{workload.title}, batch {args.batch}")
    command = " ".join(["mixprec", *sys.argv[1:]]) if sys.argv[1:2] == ["explain"] else (
        f"mixprec explain {args.model}")  # fmt: skip
    print(result.format(all_calls=args.all, all_hint=f"`{command} --all` lists them"))
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"wrote {args.json}")
    return 0


def _versions() -> str:
    import platform

    import torch

    return (
        f"mixprec {__version__}\ntorch {torch.__version__} "
        f"(CUDA {'available' if torch.cuda.is_available() else 'not available'})\n"
        f"Python {platform.python_version()}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mixprec`` console script."""
    from mixprec.bench.data import DataError
    from mixprec.bench.report import OutputError
    from mixprec.errors import MixprecError

    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for --nproc-per-node launches
    if unknown:
        if args.command not in ("bench", "train"):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        message = _unknown_arguments(args.command, unknown, args.argv)
        print(f"mixprec {args.command}: error: {message}", file=sys.stderr)
        return 2
    if args.version:
        print(_versions())
        return 0
    commands = {"bench": _bench, "train": _train, "policy": _policy, "explain": _explain}
    if args.command not in commands:
        parser.print_help()
        return 0
    try:
        return commands[args.command](args)
    except (CliError, OutputError, DataError, MixprecError) as err:
        print(f"mixprec {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `mixprec explain | head`: the reader left early; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
