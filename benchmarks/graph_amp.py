"""Graph-level AMP against region + compile, side by side in one run: ms per step and casts.

Rows, each a training step's forward + loss + backward compiled with inductor:

- ``torch.autocast + compile``: torch's region around a ``torch.compile``d loss;
- ``mixprec.autocast + compile``: mixprec's region around a ``torch.compile``d loss (ops that no
  function mode sees in a compiled region, the losses, follow torch's lists there);
- ``mixprec.compile`` (``casts="exact"`` and ``casts="minimal"``): the policy applied to the
  whole captured graph;
- ``eager mixprec.autocast``: the uncompiled reference for the cast count.

Casts per step: dtype-changing casts of the forward graph as recorded (eager: counted by a
dispatch mode; compiled: the graph's cast report) and after the cast pass. Inductor fuses casts
into neighbouring kernels, so fewer graph casts mean fewer fused conversions, not fewer kernels.

Workloads: the GPT-2-like bench decoder (``GPTConfig.tiny``), a Llama block stack from
Transformers (tiny random config; skipped without transformers), and a Linear -> LayerNorm ->
Linear "ping-pong" stack under the CUDA rules (LayerNorm in fp32), all on the CPU in bf16. The
variants run in interleaved rounds; the table reports medians and each row's ratio to
``torch.autocast + compile`` within the same round.

Usage::

    python benchmarks/graph_amp.py --rounds 15 --json benchmarks/results/graph_amp_cpu.json
    python benchmarks/graph_amp.py --device cuda --json ...        # the GPU suite's part
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import mixprec
from mixprec.bench.models import GPT, GPTConfig
from mixprec.bench.report import cpu_name
from mixprec.diagnostics.casts import CastCounter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: suite.args
from suite.args import comma_list

#: What --workloads names: the start of each workload's name in `_workloads`.
WORKLOAD_NAMES = ("gpt2", "pingpong", "llama")


def _workloads(device: str, smoke: bool) -> dict[str, tuple[Callable[[], Any], mixprec.Policy]]:
    def gpt():
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2 if smoke else 4, n_head=4,
                        n_embd=64 if smoke else 128)  # fmt: skip
        model = GPT(cfg).to(device)
        ids = torch.randint(0, 256, (8, 32 if smoke else 64), device=device)

        def loss(ids):
            logits = model(ids)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())

        return model, loss, (ids,)

    def pingpong():
        torch.manual_seed(0)
        width = 64 if smoke else 256
        layers: list[torch.nn.Module] = []
        for _ in range(4):
            layers += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers).to(device)
        x = torch.randn(64 if smoke else 512, width, device=device)
        y = torch.randint(0, width, (x.shape[0],), device=device)
        return model, lambda x, y: F.cross_entropy(model(x), y), (x, y)

    def llama():
        import transformers

        transformers.logging.set_verbosity_error()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            hidden_size=64 if smoke else 128, intermediate_size=128 if smoke else 256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
            max_position_embeddings=128, attn_implementation="eager",
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg).to(device)
        ids = torch.randint(0, 256, (4, 32 if smoke else 64), device=device)
        return model, lambda ids: model(input_ids=ids, labels=ids).loss, (ids,)

    out = {"gpt2-like": (gpt, mixprec.Policy()), "pingpong (CUDA rules)": (
        pingpong, mixprec.Policy(table="cuda"))}  # fmt: skip
    with contextlib.suppress(ImportError):
        import transformers  # noqa: F401

        out["llama (transformers)"] = (llama, mixprec.Policy())
    return out


def _variants(device, dtype, policy, model, loss, backend):
    compiled = torch.compile(loss, backend=backend)

    def region_compile(ctx):
        def run(*b):
            with ctx():
                return compiled(*b)

        return run

    exact = mixprec.compile(loss, dtype=dtype, policy=policy, casts="exact", backend=backend)
    minimal = mixprec.compile(loss, dtype=dtype, policy=policy, casts="minimal", backend=backend)
    return {
        "torch.autocast + compile": region_compile(lambda: torch.autocast(device, dtype=dtype)),
        "mixprec.autocast + compile": region_compile(
            lambda: mixprec.autocast(device, dtype=dtype, policy=policy)
        ),
        "mixprec.compile (exact)": exact,
        "mixprec.compile (minimal)": minimal,
    }, {"mixprec.compile (exact)": exact, "mixprec.compile (minimal)": minimal}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(model, fn, batch) -> None:
    model.zero_grad(set_to_none=True)
    fn(*batch).backward()


def run(
    device: str,
    rounds: int,
    steps: int,
    smoke: bool,
    backend: str = "inductor",
    only: list[str] | None = None,
    partial: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every workload's rows; `partial` gets the result so far after each workload (the GPU
    suite's part writes it, so a run cut off by its time limit keeps the finished workloads)."""
    dtype = torch.bfloat16 if device == "cpu" else torch.float16
    rows = []
    for name, (make, policy) in _workloads(device, smoke).items():
        if only and not any(name.startswith(w) for w in only):
            continue
        torch._dynamo.reset()
        model, loss, batch = make()
        counter = CastCounter()
        with counter, mixprec.autocast(device, dtype=dtype, policy=policy):
            loss(*batch)
        eager_casts = counter.conversions
        variants, reported = _variants(device, dtype, policy, model, loss, backend)
        for fn in variants.values():  # compile and warm up
            for _ in range(2):
                _step(model, fn, batch)
        times: dict[str, list[float]] = {k: [] for k in variants}
        ratios: dict[str, list[float]] = {k: [] for k in variants}
        order = list(variants)
        for r in range(rounds):
            this = {}
            for key in order if r % 2 == 0 else reversed(order):
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    _step(model, variants[key], batch)
                _sync(device)
                this[key] = (time.perf_counter() - t0) / steps * 1e3
                times[key].append(this[key])
            for key in variants:
                ratios[key].append(this[key] / this["torch.autocast + compile"])
        for key in variants:
            reports = reported[key].mixprec_backend.reports if key in reported else None
            rows.append({
                "workload": name, "variant": key,
                "ms_per_step": statistics.median(times[key]),
                "ratio_to_torch_compile": statistics.median(ratios[key]),
                "casts_recorded": sum(r.before for r in reports) if reports else None,
                "casts_after_pass": sum(r.after for r in reports) if reports else None,
                "cast_bytes_after_pass": sum(r.bytes_after for r in reports) if reports else None,
                "eager_casts": eager_casts,
            })  # fmt: skip
        if partial is not None:
            partial(_result(device, backend, rounds, steps, rows))
    return _result(device, backend, rounds, steps, rows)


def _result(device: str, backend: str, rounds: int, steps: int,
            rows: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    return {
        "command": " ".join(sys.argv),
        "device": cpu_name() if device == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "backend": backend,
        "rounds": rounds,
        "steps_per_round": steps,
        "rows": rows,
    }


def _table(result: dict[str, Any]) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['threads']} threads, "
             f"median of {result['rounds']} interleaved rounds"]  # fmt: skip
    head = f"{'workload':<22} {'variant':<28} {'ms/step':>8} {'vs torch':>9} {'casts':>13}"
    lines += [head, "-" * len(head)]
    for r in result["rows"]:
        casts = (f"{r['casts_recorded']}->{r['casts_after_pass']}"
                 if r["casts_recorded"] is not None else "")  # fmt: skip
        lines.append(f"{r['workload']:<22} {r['variant']:<28} {r['ms_per_step']:>8.2f} "
                     f"{r['ratio_to_torch_compile']:>8.2f}x {casts:>13}")  # fmt: skip
    lines.append(
        "casts: forward graph casts as recorded -> after the cast pass; eager "
        "mixprec.autocast makes "
        + ", ".join(sorted({f"{r['workload']}: {r['eager_casts']}" for r in result["rows"]}))
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cpu (bf16) or cuda (fp16; the GPU suite's part) (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    parser.add_argument("--steps", type=int, default=5, help="steps per block (default 5)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, for a quick check")
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="the backend every variant compiles with (default inductor)",
    )
    parser.add_argument("--workloads", help="comma-separated, from: "
                        f"{', '.join(WORKLOAD_NAMES)} (llama where transformers imports; "
                        "default: all)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON")
    args = parser.parse_args(argv)
    # Each name is the start of a workload's ("gpt2" for "gpt2-like"); llama needs transformers.
    only = None
    if args.workloads is not None:
        only = comma_list(parser, "--workloads", args.workloads, WORKLOAD_NAMES)

    def write(result: dict[str, Any]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)

    result = run(args.device, args.rounds, args.steps, args.smoke, args.compile_backend, only,
                 partial=write)  # fmt: skip
    print(_table(result))
    write(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
