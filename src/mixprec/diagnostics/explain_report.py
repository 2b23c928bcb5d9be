"""`ExplainReport`: what `mixprec.explain` recorded, summarised, rendered as a table or JSON.

The recording (which rule ran each call, its casts, its FLOPs) is `mixprec.diagnostics.explain`;
this module only reads it: the summary numbers, the low -> fp32 -> low "ping-pong" chains whose
two casts cost memory traffic, and the table whose columns widen until no two module or op
names read alike.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mixprec.dtypes import dtype_name
from mixprec.fp8.report import Fp8Report
from mixprec.policy.modules import ModuleDecision

if TYPE_CHECKING:
    from mixprec.diagnostics.explain import _Flops, _Recorder

__all__ = ["ExplainReport"]

_LOW_NAMES = (dtype_name(torch.float16), dtype_name(torch.bfloat16))
_FP32_NAME = dtype_name(torch.float32)


class ExplainReport:
    """What one forward (and optionally backward) ran in which precision, call by call.

    Attributes:
        rows: one dict per torch call that returned a tensor (see :meth:`ExplainReport.__str__`
            for the columns), in execution order.
        device_type, dtype, policy: the region explained.
        flops: matmul/convolution FLOPs per dtype name, ``{'forward': {...}, 'backward': {...}}``.
        ping_pong: chains low -> fp32 -> low: an fp32 op between two low-precision ops, each
            with the modules involved and the bytes its two casts cost.
    """

    def __init__(self, recorder: _Recorder, device_type: str, dtype: torch.dtype,
                 flops: _Flops, backward: bool) -> None:  # fmt: skip
        self.rows = [r.as_dict() for r in recorder.rows]
        self.device_type = device_type
        self.dtype = dtype
        self.policy = recorder.policy
        self.flops = {"forward": dict(_total(r.flops for r in recorder.rows))}
        if backward:
            self.flops["backward"] = dict(flops.backward)
        self.ping_pong = _ping_pong(recorder)
        self.fp8: Fp8Report | None = None  # FP8 layers: scales, amaxes, error on this batch
        self.fp8_plan: tuple[ModuleDecision, ...] = ()  # FP8 rules of a model not yet converted
        self.fp8_not_called: list[str] = []  # FP8 layers this forward did not call
        self.fp32_modules: dict[str, str] = {}  # modules kept in fp32 (policy, healing): why

    # ---- summaries
    @property
    def casts(self) -> int:
        """Casts executed in the forward (cache hits of cast weights not counted)."""
        return sum(r["casts"] for r in self.rows)

    @property
    def cast_bytes(self) -> int:
        """Bytes written by those casts."""
        return sum(r["cast_bytes"] for r in self.rows)

    def low_precision_share(self, phase: str = "forward") -> float | None:
        """Fraction of matmul/convolution FLOPs that ran in fp16/bf16 or FP8 (None: no such op
        ran). FP8 layers' forward GEMMs count as ``'fp8'`` in `flops` (their backward GEMMs run
        inside one op and are not counted)."""
        counts = self.flops.get(phase, {})
        total = sum(counts.values())
        if not total:
            return None
        return sum(v for k, v in counts.items() if k in (*_LOW_NAMES, "fp8")) / total

    def summary(self) -> dict[str, Any]:
        """The headline numbers, as Python values."""
        by_cat = Counter(r["category"] for r in self.rows)
        return {
            "device_type": self.device_type,
            "dtype": dtype_name(self.dtype),
            "policy": str(self.policy),
            "calls": len(self.rows),
            "calls_by_category": dict(by_cat),
            "casts": self.casts,
            "cast_bytes": self.cast_bytes,
            "weight_casts": sum(
                1 for r in self.rows for c in r["cast_detail"] if c["weight"] and not c["cached"]
            ),
            "ping_pong": len(self.ping_pong),
            "fp8_layers": len(self.fp8) if self.fp8 is not None else 0,
            "fp32_modules": dict(self.fp32_modules),
            "low_precision_flop_share": {p: self.low_precision_share(p) for p in self.flops},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Summary, ping-pong chains and rows as a JSON document."""
        doc = {"summary": self.summary(), "ping_pong": self.ping_pong, "flops": self.flops,
               "rows": self.rows}  # fmt: skip
        return json.dumps(doc, indent=indent)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        return self.format()

    def format(
        self,
        *,
        all_calls: bool = False,
        width: int = 48,
        all_hint: str = "report.format(all_calls=True) or report.rows lists them",
    ) -> str:
        """A readable table. Pass-through calls without casts are hidden unless `all_calls`.

        Module and op names are never cut so that two rows read alike: their columns widen to
        the longest name (up to 40 characters), and a longer name loses characters from its
        middle, keeping its first and last parts (where ``...attn.c_attn`` and ``...attn.c_proj``
        differ). `width` caps the reason column; `all_hint` tells how to see hidden calls (the
        command line passes ``--all``).
        """
        s = self.summary()
        lines = [
            f"mixprec.explain: {s['device_type']} {s['dtype']}, policy {s['policy']}",
            f"{s['calls']} calls: "
            + ", ".join(f"{n} {k}" for k, n in sorted(s["calls_by_category"].items())),
            f"casts: {s['casts']} ({_bytes(s['cast_bytes'])}), of weights {s['weight_casts']}; "
            f"ping-pong chains: {s['ping_pong']}",
        ]
        for phase, share in s["low_precision_flop_share"].items():
            if share is not None:
                lines.append(f"matmul/conv FLOPs in low precision ({phase}): {share:.1%}")
        lines.append("")
        shown = [r for r in self.rows
                 if all_calls or r["category"] != "passthrough" or r["cast_detail"]]  # fmt: skip
        hidden = len(self.rows) - len(shown)
        modules, mw = _column([r["module"] for r in shown], "module", 40)
        ops, ow = _column([r["op"] for r in shown], "op", 30)
        flow = "in -> ran in -> out"
        cat = "category"
        lines.append(f"{'#':>4}  {'module':<{mw}} {'op':<{ow}} {cat:<11} {flow:<30} casts  reason")
        for r in shown:
            flow = f"{_short(r['inputs'])} -> {_short(r['ran_in'])} -> {_short(r['outputs'])}"
            casts = str(r["casts"]) + ("+c" if r["cached_casts"] else "")
            lines.append(
                f"{r['index']:>4}  {modules[r['module']]:<{mw}} {ops[r['op']]:<{ow}} "
                f"{r['category']:<11} {_clip(flow, 30):<30} {casts:>5}  {_clip(r['reason'], width)}"
            )
        if hidden:
            lines.append(f"({hidden} pass-through calls without casts not shown; {all_hint})")
        if self.ping_pong:
            lines.append("")
            lines.append("ping-pong (low -> fp32 -> low; each costs two casts):")
            for p in self.ping_pong:
                lines.append(f"  {p['path']}  ({_bytes(p['bytes'])})")
        if self.fp8 is not None:
            lines += ["", str(self.fp8)]
            lines += [f"  {layer.module}: {layer.reason}" for layer in self.fp8]
            lines += [f"  {name}: converted, but this forward did not call it (its weight is "
                      f"used some other way, or the branch did not run): not FP8 here"
                      for name in self.fp8_not_called]  # fmt: skip
            lines.append(f"  gemm: {GEMM_NOTE}")
        if self.fp32_modules:
            lines += ["", "modules kept in fp32 (autocast off inside, fp32 outputs):"]
            lines += [f"  {name}: {why}" for name, why in self.fp32_modules.items()]
        if self.fp8_plan:
            lines += [
                "",
                "FP8 plan of the policy's rules (not applied: the model has no FP8 layers; "
                "mixprec.to_fp8 or initialize(..., fp8=...) converts it):",
            ]
            lines += [f"  {d}" for d in self.fp8_plan]
            lines.append(f"  gemm: {GEMM_NOTE}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        s = self.summary()
        return f"<ExplainReport {s['calls']} calls, {s['casts']} casts, {s['ping_pong']} ping-pong>"


#: How FP8 products choose their path (mixprec.fp8.gemm), for the FP8 parts of the report.
GEMM_NOTE = (
    "each FP8 product runs torch._scaled_mm or mixprec's emulation, whichever is faster on "
    "this machine (measured at first use per shape class; CUDA: _scaled_mm from compute "
    "capability 8.9); MIXPREC_FP8_GEMM=scaled_mm|emulate forces one"
)


def _total(counters: Iterator[dict[str, int]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for c in counters:
        out.update(c)
    return out


def _ping_pong(rec: _Recorder) -> list[dict[str, Any]]:
    """Chains p -> r -> ... -> q: r casts p's low output up to fp32, and q casts down the fp32
    value r made, directly or after ops that keep it what it is (relu, dropout, a view or
    reshape, a scale by a weight: ops whose only other floating inputs are weights, buffers or
    model inputs, with fp32 outputs). Such ops move no cast, so the value's round trip costs
    the same two casts with or without them. A value combined with another computed one (a
    residual add) is a new value: the search stops there, or every later down-cast of the
    residual stream would pair with each up-cast before it."""
    rows = rec.rows
    up: dict[int, tuple[int, int]] = {}  # fp32 row -> (producer row, bytes of its up-cast)
    for p, r, src, dst, nbytes in rec.edges:
        if src in _LOW_NAMES and dst == _FP32_NAME:
            up.setdefault(r, (p, nbytes))
    users: dict[int, list[int]] = {}  # row -> rows that took one of its outputs uncast
    for row in rows:
        for made, cast in row.sources:
            if made is not None and not cast:
                users.setdefault(made, []).append(row.index)
    down: dict[int, list[tuple[int, int]]] = {}  # row -> (rows casting it fp32 -> low, bytes)
    for x, q, src, dst, nbytes in rec.edges:
        if src == _FP32_NAME and dst in _LOW_NAMES:
            down.setdefault(x, []).append((q, nbytes))
    chains = []
    for r in sorted(up):
        p, up_bytes = up[r]
        via = {r: r}  # row of the chain -> the chain row it took the value from
        todo = [r]
        while todo:
            x = todo.pop(0)
            for q, nbytes in down.get(x, ()):
                path = [q, x]
                while path[-1] != r:
                    path.append(via[path[-1]])
                path = [p, *reversed(path)]
                text = " -> ".join(f"{rows[i].module or '-'}:{rows[i].op}" for i in path)
                chains.append({"rows": path, "path": text, "bytes": up_bytes + nbytes})
            for u in dict.fromkeys(users.get(x, ())):
                if u not in via and _keeps_value(rows[u], set(via)):
                    via[u] = x
                    todo.append(u)
    chains.sort(key=lambda c: (c["rows"][-1], c["rows"][1]))  # in the order the casts ran
    return chains


def _keeps_value(row: Any, chain: set[int]) -> bool:
    """Whether `row` carries the chain's fp32 value on: it takes it uncast, every other
    floating input is a weight, buffer or model input, and its floating outputs are fp32."""
    if not row.outputs or any(d != _FP32_NAME for d in row.outputs):
        return False
    return all(made is None or (made in chain and not cast) for made, cast in row.sources)


def _short(dtypes: list[str]) -> str:
    uniq = list(dict.fromkeys(dtypes))
    return "/".join(uniq) or "-"


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "~"


def _elide(text: str, n: int) -> str:
    """`text` in at most `n` characters: the middle gives way to ``~``, the start and the end
    stay (a module path differs from its siblings at its end: ``attn.c_attn``/``attn.c_proj``)."""
    if len(text) <= n:
        return text
    head = max((n - 1) // 3, 1)
    return text[:head] + "~" + text[len(text) - (n - 1 - head) :]


def _column(names: list[str], title: str, cap: int) -> tuple[dict[str, str], int]:
    """Display form of each name and the column width: as wide as the longest name up to `cap`,
    wider still where eliding would make two different names read alike."""
    distinct = list(dict.fromkeys(names))
    width = max([len(title), *map(len, distinct)])
    n = min(width, cap)
    while True:
        shown = {name: _elide(name, n) for name in distinct}
        if n >= width or len(set(shown.values())) == len(distinct):
            return shown, n
        n += 1


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
