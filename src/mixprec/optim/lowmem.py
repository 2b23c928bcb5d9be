"""Low-memory optimizers: bf16 weights that keep small updates, and 8-bit or bf16 states.

`LowMemAdamW`, `LowMemAdam` and `LowMemSGD` follow torch's AdamW, Adam and SGD (momentum,
dampening, nesterov, weight decay, maximize) and step the model's own parameters, whatever
their dtype, with the arithmetic in fp32. Two choices per param group:

``weights`` (how an update is written into a bf16/fp16 weight; fp32 weights are exact anyway):
    ``'stochastic'`` (default): stochastic rounding from a seeded counter hash (bf16 only);
    no extra memory. ``'kahan'``: a compensation buffer in the weight's dtype (2 bytes per
    parameter) carries what rounding dropped into the next step. ``'split'``: an exact fp32
    master held as the bf16 weight plus its low 16 bits (two to an int32 word, 2 bytes per
    parameter): O2's arithmetic, bit for bit, in half of O2's extra memory (bf16 only).
    ``'nearest'``: round to nearest, as O3 (updates below half an ulp are lost).
``states`` (how the moments are stored between steps):
    ``'fp32'`` (8 bytes per parameter for Adam), ``'bf16'`` (4; written with stochastic
    rounding, since bf16 round-to-nearest freezes a second moment that decays by 0.999 per
    step), ``'8bit'`` (about 2.03: blockwise 8-bit codes, `mixprec.optim.codes`;
    tensors under ``min_quantized`` elements, 4096 by default, stay fp32: norms and biases
    are a negligible share of memory and the most sensitive to quantization),
    ``'8bit-bound'`` (the same storage, each block's scale a bound known before the step:
    a compiled update in one pass, a little coarser codes; `_moment`; O4's choice).

Everything the step keeps is a tensor in ``self.state[p]``: the step counter (fp32, as torch's),
the rounding seed (int64), the compensation buffer, the moments or their 8-bit codes (four per
int32 word) and block maxima (fp32). So a checkpoint holds all of it (``state_dict`` round trips
exactly and loads with ``weights_only=True``), mixprec's exact overflow skip restores all of
it, and the step is plain tensor code that ``torch.compile`` traces into one graph
(`mixprec.TrainStep`'s compiled step): no ``.item()``, no Python-number state, no
data-dependent branches. The random bits of stochastic rounding depend on (seed, parameter
index, step counter, element index) only, so eager and compiled steps round identically and a
resumed run continues the same sequence.

Costs per step: eager, a few small kernels per parameter (for 8-bit states, about ten more per
moment to decode and encode); the transient fp32 copies of one parameter's moments and update.
Compiled (`mixprec.TrainStep`), inductor fuses a parameter's update into a few vectorized loops.
No host-device synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mixprec._compat import local_tensor
from mixprec.errors import ArgumentTypeError, PolicyError, format_options
from mixprec.optim import codes
from mixprec.optim.rounding import (
    _M32,
    computed_once,
    counter_stream,
    join_master,
    kahan_add,
    mix_seed,
    pack_halves,
    split_master,
    stochastic_round,
    uniform,
    unpack_halves,
)

__all__ = ["STATES", "WEIGHTS", "LowMemAdam", "LowMemAdamW", "LowMemOptimizer", "LowMemSGD"]

#: Values of ``weights``: how an update is written into a low-precision weight.
WEIGHTS = {
    "stochastic": "stochastic rounding from a seeded counter hash (bf16 weights; no memory)",
    "kahan": "a compensation buffer in the weight's dtype carries the rounding error (2 B/param)",
    "split": "an exact fp32 master: the bf16 weight plus the 16 bits it drops (2 B/param)",
    "nearest": "round to nearest (O3: updates below half an ulp are lost)",
}
#: Values of ``states``: how the optimizer's moments are stored.
STATES = {
    "fp32": "fp32 moments (4 bytes per moment and parameter)",
    "bf16": "bf16 moments written with stochastic rounding (2 bytes)",
    "8bit": "blockwise 8-bit (quartic-code) moments with an fp32 maximum per block (~1.016 bytes)",
    "8bit-bound": "as '8bit', each block's scale a bound known before the step: one compiled "
    "pass (faster), a little coarser codes",
}
_SALT = 0x5BD1E995  # separates the random bits of the weight and of each moment


def _check_choice(kind: str, value: Any, valid: dict[str, str]) -> str:
    if value not in valid:
        raise PolicyError(f"unknown {kind} {value!r}. Valid: {format_options(valid)}.")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_group(group: dict[str, Any]) -> None:
    """A param group's settings (the constructor's defaults merged in), checked before any
    change, with torch's rules for the hyperparameters torch's optimizers check."""
    _check_choice("weights mode", group["weights"], WEIGHTS)
    _check_choice("states mode", group["states"], STATES)
    block, least, seed = group["block_size"], group["min_quantized"], group["seed"]
    if not (_is_int(block) and block >= 2):
        raise PolicyError(f"block_size={block!r} must be an int >= 2 (256 is the default).")
    if not (_is_int(least) and least >= 0):
        raise PolicyError(f"min_quantized={least!r} must be an int >= 0 (4096 is the default).")
    if not _is_int(seed):
        raise ArgumentTypeError(f"seed={seed!r} must be an int.")
    if not isinstance(group.get("maximize", False), bool):
        raise ArgumentTypeError(f"maximize={group['maximize']!r} must be True or False.")
    for name in ("lr", "eps", "weight_decay", "momentum", "dampening"):
        value = group.get(name)
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise PolicyError(f"{name} as a tensor must have one element (0-dim).")
        elif name in group and not (isinstance(value, (int, float)) and value >= 0):
            raise PolicyError(f"{name}={value!r} is invalid: it must be a number >= 0.")
    if "betas" in group:
        betas = group["betas"]
        numbers = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not (numbers and all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)):
            raise PolicyError(f"betas={betas!r}: two numbers, each in [0, 1), e.g. (0.9, 0.999).")


def _flat(t: torch.Tensor) -> torch.Tensor:
    """Contiguous `t` as a 1-D tensor over the same storage."""
    return t.as_strided((t.numel(),), (1,))


def _shaped(value: Any, numel: int) -> bool:
    """Whether a state entry is a tensor shaped like its parameter (of `numel` elements)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == numel


def _low_bits(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    """A split master's low 16 bits for `p`'s elements (int32, `p`'s shape): a plane's own,
    or unpacked from the state's words."""
    if isinstance(state, _Plane):
        return state["lo"].view(p.shape)
    return unpack_halves(state["lo"], p.numel()).view(p.shape)


def _plane_halves(words: torch.Tensor, plane: int) -> torch.Tensor:
    """Plane `plane`'s low bits from a split master's words (`pack_halves`: word j holds
    element j and j + numel/2; planes 0, 1 are the low halves of the two halves of the
    words, planes 2, 3 their high halves)."""
    half = words.view(2, -1)[plane % 2]
    return (half >> (16 * (plane // 2))) & 0xFFFF


class _Plane(dict):
    """Plane `plane` of a parameter's state, for one plane's update (`_step_planes`).

    Holds the state's 0-dim tensors (step, key) themselves, and a copy of this plane of each
    tensor shaped like the parameter (compensation, low bits): the update writes into those
    copies, and `_step_planes` writes the four planes back at once (writing each plane into
    a slice of the state compiled to slow copies). The 8-bit moments' new codes and maxima
    wait in `pending`. `shared` is one dict for the four planes of a parameter: the values
    that depend on the step only (bias corrections, the rounding stream) are computed once
    into it (`LowMemOptimizer._once`).
    """

    def __init__(
        self, state: dict[str, Any], plane: int, numel: int, shared: dict[str, Any]
    ) -> None:
        size = numel // codes.PLANES
        super().__init__()
        for name, value in state.items():
            if _shaped(value, numel):
                value = value.reshape(codes.PLANES, size)[plane].clone()
            elif name == "lo":  # a split master's packed low bits: this plane's, unpacked
                value = _plane_halves(value, plane)
            self[name] = value
        self.plane, self.offset, self.shared = plane, plane * size, shared
        self.pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


class LowMemOptimizer(torch.optim.Optimizer):
    """The shared machinery: state storage by precision, and writing updates into weights.

    Subclasses define `_moments` (state names, and whether each is signed) and `_update`.
    """

    _moments: tuple[tuple[str, bool], ...] = ()
    #: mixprec's compiled TrainStep may hold ``lr`` as a 0-dim tensor (an LR schedule then
    #: never recompiles the step): this step reads it as a tensor or a float alike.
    accepts_tensor_lr = True
    #: torch's fused-optimizer contract: a GradScaler (mixprec's or torch's) sets
    #: ``grad_scale`` and ``found_inf`` for the duration of ``step()`` instead of unscaling
    #: the gradients in place. The update divides by the scale in fp32 (fp16 gradients lose
    #: nothing: unscaled in fp16 they would fall below fp16's range) and, where ``found_inf``
    #: is set, writes every tensor back as it was (an exact skip, no snapshot, no sync).
    _step_supports_amp_scaling = True

    def _put(self, dst: torch.Tensor, value: torch.Tensor) -> None:
        """``dst.copy_(value)``, or keep `dst` where the scaler's ``found_inf`` is set."""
        skip = self._skipping[0]
        if skip is not None:
            value = torch.where(skip, dst, value.view(dst.shape))
        dst.copy_(value.view(dst.shape))

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        _check_group(defaults)
        super().__init__(params, defaults)  # each group checked by add_param_group
        # While a step runs under the scaler's contract: the 0-dim bool "skip this step". A
        # list mutated in place rather than an attribute assigned during the step: dynamo
        # read an attribute assigned earlier in the same trace as absent (`step_scaled`).
        self._skipping: list[torch.Tensor | None] = [None]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with the group's settings checked first (the constructor's groups too): a
        group that does not fit is refused and the optimizer left as it was."""
        group = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        _check_group(group)
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if group["weights"] in ("stochastic", "split") and any(
            p.dtype == torch.float16 for p in params
        ):
            raise PolicyError(
                f"weights={group['weights']!r} works on bf16 (the top half of fp32); "
                f"this group has float16 parameters. Use weights='kahan' for fp16 "
                f"weights, or bf16."
            )
        super().add_param_group({**param_group, "params": params})

    @staticmethod
    def _once(state: dict[str, Any], name: str, make: Any) -> Any:
        """``make()``, once per parameter and step: the planes of an update share the value.

        Each plane computing its own copy compiled to separate 0-dim computations: three per
        plane, each a few small buffers handled by the compiled step's Python wrapper (184 of
        its 419 lines and 96 of its 132 buffer allocations for a 4 x Linear(512) model).
        """
        shared = state.shared if isinstance(state, _Plane) else None
        if shared is None:
            return make()
        if name not in shared:
            shared[name] = make()
        return shared[name]

    # ------------------------------------------------------------------ storage

    def _moments_of(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        """The state names this group's parameters keep, and whether each is signed."""
        return self._moments

    @staticmethod
    def _quantized(group: dict[str, Any], p: torch.Tensor) -> bool:
        return group["states"] in ("8bit", "8bit-bound") and p.numel() >= group["min_quantized"]

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, index: int) -> dict[str, Any]:
        """The state of `p` before its first step: counters, key, buffers, zero moments."""
        state: dict[str, Any] = {"step": torch.zeros((), dtype=torch.float32, device=p.device)}
        low = p.dtype != torch.float32
        if (low and group["weights"] == "stochastic") or group["states"] in ("bf16", "8bit-bound"):
            seed = mix_seed(group["seed"], index)
            state["key"] = torch.tensor(seed, dtype=torch.int64, device=p.device)
        if low and group["weights"] == "kahan":
            state["comp"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if low and group["weights"] == "split":
            # Two 16-bit halves to an int32 word (`pack_halves`): int16 lanes would make
            # a compiled CPU update run element by element.
            state["lo"] = torch.zeros((p.numel() + 1) // 2, dtype=torch.int32, device=p.device)
        for name, _signed in self._moments_of(group):
            if self._quantized(group, p):
                n = codes.padded_size(p.numel(), group["block_size"])
                state[name] = torch.zeros(n // codes.PLANES, dtype=torch.int32, device=p.device)
                state[name + "_absmax"] = torch.zeros(
                    n // group["block_size"], dtype=torch.float32, device=p.device
                )
            else:
                dtype = torch.bfloat16 if group["states"] == "bf16" else torch.float32
                state[name] = torch.zeros(p.shape, dtype=dtype, device=p.device)
        return state

    def _read(self, group: dict[str, Any], state: dict[str, Any], name: str, signed: bool,
              shape: torch.Size) -> torch.Tensor:  # fmt: skip
        """A moment as an fp32 tensor of `shape`."""
        value = state[name]
        if value.dtype == torch.int32:  # 8-bit codes
            absmax = state[name + "_absmax"]
            if isinstance(state, _Plane):
                absmax = absmax.view(codes.PLANES, -1)[state.plane]
                return codes.dequantize_plane(value, absmax, state.plane, signed)
            return codes.dequantize(value, absmax, signed, shape)
        return value.float().reshape(shape)

    def _write(self, group: dict[str, Any], state: dict[str, Any], name: str, signed: bool,
               value: torch.Tensor, salt: int,
               scale: torch.Tensor | None = None) -> None:  # fmt: skip
        """Store the fp32 moment `value` in its precision (8-bit: relative to the block
        scales `scale` where given, else to the blocks' maxima)."""
        held = state[name]
        if held.dtype == torch.int32:  # 8-bit codes
            block = group["block_size"]
            noise = None
            if scale is not None and not signed:
                # Against a bound, second moments' codes round stochastically: to nearest,
                # a block's top value near the bound is stored as the bound, and the next
                # step, starting from it, drifts upward (`codes.quantize`; docs/memory.md).
                # The bits: the low half of the weights' stochastic-rounding hash (one hash
                # for both when compiled). First moments keep round to nearest (measured:
                # no loss from their bound).
                def make() -> torch.Tensor:
                    return counter_stream(state["key"], state["step"])

                stream = self._once(state, "stream", make)
                offset = state.offset if isinstance(state, _Plane) else 0
                size = value.numel() if isinstance(state, _Plane) else held.numel() * 4
                noise = uniform(stream, size, offset)
            if isinstance(state, _Plane):
                if noise is not None:
                    noise = noise.view(value.shape)
                state.pending[name] = codes.quantize_plane(value, block, signed, scale, noise)
                return
            q, absmax = codes.quantize(value, block, signed, scale, noise)
            self._put(held, q)
            self._put(state[name + "_absmax"], absmax)
        elif held.dtype == torch.bfloat16:
            key = (state["key"] ^ (_SALT * salt)) & _M32
            stream = counter_stream(key, state["step"])
            self._put(held, stochastic_round(value, stream))
        else:
            self._put(held, value)

    def _moment(self, group: dict[str, Any], state: dict[str, Any], name: str, signed: bool,
                g: torch.Tensor, rule: Any, salt: int) -> torch.Tensor:  # fmt: skip
        """The moment `name` after this step, ``rule(old, g)`` in fp32, stored; returned.

        8-bit states are encoded relative to a scale per block: with ``states='8bit'`` the
        block's largest new value, with ``'8bit-bound'`` (O4's) an upper bound of it known
        before the new values are: ``rule(the largest magnitude the old codes decode to, the
        gradient's block maximum)``. `rule` combines its two arguments with non-negative
        weights (Adam's moments, SGD's momentum), so that bounds ``|rule(old, g)|``.

        Why the bound: a block's maximum needs the whole update computed before any of it
        can be encoded, and compiled (inductor, CPU) that is a second pass that computes it
        again; with the bound the update is one pass, after a pass over the old code words
        alone (4 x Linear(512), AdamW, bf16, one thread, AMD EPYC with avx512_bf16: O4's step
        1.14x O2's with the bound, 1.45x with maxima). The bound is looser than the maximum by
        what one step adds (in a simulation with noisy gradients, 1.35x for Adam's first
        moment, 1.05x for the second; a bound carried over from the old scale instead drifted
        to 4x and 6.5x), and unsigned codes against it round stochastically (`_write`).
        Measured on the char-level GPT (3 seeds): validation loss 0.1% below fp32's mean with
        the bound, 0.7% below with maxima (docs/memory.md).
        """
        new = rule(self._read(group, state, name, signed, g.shape), g)
        scale = None
        if state[name].dtype == torch.int32 and group["states"] == "8bit-bound":
            scale = _per_block(rule(self._old_peak(state, name, signed),
                                    self._gradient_maxima(group, state, g)))  # fmt: skip
        self._write(group, state, name, signed, new, salt, scale)
        return new

    @staticmethod
    def _old_peak(state: dict[str, Any], name: str, signed: bool) -> torch.Tensor:
        """The largest magnitude each block of the moment `name` holds now, from its codes."""
        words, absmax = state[name], state[name + "_absmax"]
        if isinstance(state, _Plane):
            absmax = absmax.view(codes.PLANES, -1)[state.plane]
            return codes.plane_peak(words, absmax, state.plane, signed)
        return codes.peaks(words, absmax, signed)

    @staticmethod
    def _gradient_maxima(group: dict[str, Any], state: dict[str, Any],
                         g: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """|g|'s block maxima (`_moment`): computed once per tensor and step, before the
        planes of a compiled update, which each take their quarter (a reduction inside a
        plane's loop split it in two)."""
        if isinstance(state, _Plane):
            return state.shared["gmax"].view(codes.PLANES, -1)[state.plane]
        block = group["block_size"]
        return codes.block_max(g, block, codes.padded_size(g.numel(), block) // block)

    @staticmethod
    def _weight(group: dict[str, Any], p: torch.Tensor, state: dict[str, Any]) -> torch.Tensor:
        """The weight in fp32: the exact master where the group keeps one (split)."""
        if p.dtype != torch.float32 and group["weights"] == "split":
            return join_master(p, _low_bits(state, p))
        return p.float()

    def _apply(self, group: dict[str, Any], p: torch.Tensor, state: dict[str, Any],
               delta: torch.Tensor) -> None:  # fmt: skip
        """``p += delta`` (fp32 `delta`) in `p`'s dtype, by the group's weights mode."""
        if p.dtype == torch.float32:
            self._put(p, p + delta)
        elif group["weights"] == "kahan":
            new, comp = kahan_add(p, delta, state["comp"].view(p.shape))
            self._put(p, new)
            self._put(state["comp"], comp)
        elif group["weights"] == "stochastic":
            offset = state.offset if isinstance(state, _Plane) else 0
            stream = self._once(state, "stream",
                                lambda: counter_stream(state["key"], state["step"]))  # fmt: skip
            self._put(p, stochastic_round(p.float() + delta, stream, offset))
        elif group["weights"] == "split" and isinstance(state, _Plane):
            weight, rest = split_master(join_master(p, _low_bits(state, p)) + delta)
            self._put(p, weight)
            self._put(state["lo"], rest)
        elif group["weights"] == "split":
            self._apply_split(p, state, delta)
        else:
            self._put(p, (p.float() + delta).to(p.dtype))

    def _apply_split(self, p: torch.Tensor, state: dict[str, Any], delta: torch.Tensor) -> None:
        """``p += delta`` on a split master, the tensor's two halves side by side: word j of
        the low bits holds elements j and j + h, so each half is updated into a copy of its
        own and the words are packed from the two. (Packing from the whole tensor's result
        computed each element's update twice when compiled: inductor read it at two places.)
        """
        words, numel = state["lo"], p.numel()
        h = words.numel()
        flat, step = p.reshape(-1), delta.reshape(-1)
        halves = []
        for k, (start, end) in enumerate(((0, h), (h, numel))):
            low = (words >> (16 * k)) & 0xFFFF
            part = flat[start:end].clone()  # written below; both go back in one copy
            new, rest = split_master(join_master(part, low[: end - start]) + step[start:end])
            self._put(part, new)
            # An odd count leaves the last word's high half unused: 0.
            halves.append((part, torch.nn.functional.pad(rest, (0, h - (end - start)))))
        (a, low_a), (b, low_b) = halves
        p.copy_(torch.cat([a, b]).view(p.shape))
        self._put(words, low_a | (low_b << 16))

    # ------------------------------------------------------------------ the step

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """One update of every parameter with a gradient. No host sync.

        A `closure` is evaluated first (with gradients on), as torch's optimizers do. Under a
        GradScaler (``grad_scale`` and ``found_inf`` set by it, torch's fused-optimizer
        contract) the gradients are divided by the scale in fp32, and a step with
        ``found_inf`` set leaves every parameter and state tensor bitwise as it was (each
        write becomes a ``torch.where``: one more elementwise pass per written tensor when
        eager, fused into the update when compiled).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_scaled(getattr(self, "grad_scale", None), getattr(self, "found_inf", None))
        return loss

    def step_scaled(self, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> None:
        """`step` with the scaler's contract as arguments: gradients divided by `grad_scale`
        (0-dim, or None: already unscaled) in fp32; every write kept as it was where
        `found_inf` (0-dim, or None) is set. What `step` calls with the attributes a scaler
        set; mixprec's compiled TrainStep calls it directly (dynamo reads an attribute set
        earlier in the same traced function as absent). No host sync.
        """
        # The reciprocal in fp64, as the scalers take it; exact for their powers of two.
        # Computed once, not inside each element's loop (`computed_once`).
        inv = None
        if grad_scale is not None:
            inv = computed_once(grad_scale.double().reciprocal().float())
        if found_inf is None:
            with torch.no_grad():
                self._step_all(inv)
            return
        self._skipping[0] = found_inf > 0
        try:
            with torch.no_grad():
                self._step_all(inv)
        finally:
            self._skipping[0] = None

    def _step_all(self, inv: torch.Tensor | None) -> None:
        """`step`'s body: every parameter with a gradient, its gradient times `inv` if given."""
        index = 0
        for group in self.param_groups:
            for param in group["params"]:
                index += 1
                if param.grad is None:
                    continue
                p, grad = local_tensor(param), local_tensor(param.grad)
                if grad.is_sparse:
                    raise PolicyError(
                        f"{type(self).__name__} does not support sparse gradients; use "
                        f"torch.optim.SparseAdam for sparse embeddings."
                    )
                state = self.state[param]
                if not state:
                    state.update(self._init_state(group, p, index))
                state["step"].add_(1)
                if p.is_contiguous() and grad.is_contiguous():
                    # Elementwise from here: one flat index lets inductor vectorize the
                    # blockwise reductions (a 2-D weight's rows and blocks did not line up
                    # in its index arithmetic, and the loops stayed scalar).
                    p, grad = p.view(-1), _flat(grad)
                g = grad.float() if inv is None else grad.float() * inv
                if group["maximize"]:
                    g = -g
                g = self._gradient(group, p, g, state)
                if self._planewise(group, p):
                    self._step_planes(group, p, g, state)
                else:
                    self._update(group, p, g, state)
                skip = self._skipping[0]
                if skip is not None:
                    # A skipped step does not count (as torch's fused kernels do).
                    state["step"].sub_(skip.to(state["step"].dtype))

    #: Update 8-bit parameters plane by plane: None (default) when compiling, or force it.
    planewise: bool | None = None

    def _planewise(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        """Whether `p` (flat) is updated plane by plane: its states are 8-bit, it has no
        padding, and the step is being compiled (or `planewise` says so).

        The same arithmetic element for element, so the same bits as the whole-tensor update
        (a test checks it). Compiled, it keeps each plane's values in one fused loop from
        decoding to encoding (the whole tensor's decoded moments were written to memory and
        read back: 3.0 against 2.0 ms per 512x512 AdamW update on an AVX2 CPU); eagerly it
        would launch four times the kernels.
        """
        if not (self._quantized(group, p) and p.dim() == 1):
            return False
        if p.numel() % (codes.PLANES * group["block_size"]):
            return False
        if self.planewise is not None:
            return self.planewise
        return torch.compiler.is_compiling()

    def _step_planes(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                     state: dict[str, Any]) -> None:  # fmt: skip
        numel = p.numel()
        shared: dict[str, Any] = {}
        if group["states"] == "8bit-bound":
            shared["gmax"] = self._gradient_maxima(group, state, g)
        planes = [_Plane(state, k, numel, shared) for k in range(codes.PLANES)]
        weights = []
        for plane, pk, gk in zip(planes, p.view(codes.PLANES, -1), g.view(codes.PLANES, -1),
                                 strict=True):  # fmt: skip
            pk = pk.clone()  # written by `_apply`; the four planes go back in one copy
            self._update(group, pk, gk, plane)
            weights.append(pk)
        p.copy_(torch.cat(weights))
        for name, value in state.items():
            if _shaped(value, numel):
                value.copy_(torch.cat([plane[name] for plane in planes]).view(value.shape))
            elif name == "lo":  # packed again: planes k and k + 2 share words
                lo = [plane["lo"] for plane in planes]
                value.copy_(torch.cat([lo[0] | (lo[2] << 16), lo[1] | (lo[3] << 16)]))
        for name in planes[0].pending:
            parts = [plane.pending[name] for plane in planes]
            self._put(state[name], codes.pack([q for q, _ in parts]))
            self._put(state[name + "_absmax"], torch.cat([absmax for _, absmax in parts]))

    def _gradient(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                  state: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        """The gradient the moments see: `g` plus L2 weight decay where the kind adds it.
        Taken on the whole tensor, before a compiled update's planes, so the block maxima
        of `_moment` are those of this gradient."""
        return g

    def _update(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                state: dict[str, Any]) -> None:  # fmt: skip
        raise NotImplementedError

    def _carried(self, group: dict[str, Any], p: torch.Tensor, index: int,
                 old: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The state of `p` carried over from torch's optimizer state `old` (AdamW's, Adam's,
        SGD's), its moments stored in this group's precision."""
        state = self._init_state(group, p, index)
        # torch's SGD keeps no counter: state means at least one step was taken (step 0 would
        # make the next step take the gradient as the momentum buffer, as a first step does).
        step = old.get("step", 1)
        state["step"].fill_(float(step))
        for s, (name, signed) in enumerate(self._moments_of(group), start=1):
            if isinstance(old.get(name), torch.Tensor):
                value = old[name].to(device=p.device, dtype=torch.float32)
                self._write(group, state, name, signed, value, s)
        return state

    def _from_torch(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` as this optimizer's, where torch's optimizer of the same kind saved it
        (its param groups lack ``weights``/``states``...): the settings from this optimizer's
        groups, the state carried over as `converted` does. Otherwise `state_dict` itself."""
        groups = state_dict.get("param_groups")
        own = ("weights", "states", "block_size", "min_quantized", "seed")
        if (
            not isinstance(groups, list)
            or len(groups) != len(self.param_groups)
            or all(isinstance(g, dict) and all(k in g for k in own) for g in groups)
        ):
            return state_dict
        merged = []
        for saved, current in zip(groups, self.param_groups, strict=True):
            group = {**saved, **{k: current[k] for k in own if k not in saved}}
            if isinstance(group.get("betas"), (tuple, list)):
                group["betas"] = tuple(float(b) for b in group["betas"])
            merged.append(group)
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in merged for i in g.get("params", [])]
        state = {}
        for index, (pid, param) in enumerate(zip(ids, params, strict=False), start=1):
            old = state_dict.get("state", {}).get(pid)
            if isinstance(old, dict) and old:
                group = next(g for g in merged if pid in g["params"])
                state[pid] = self._carried(group, local_tensor(param).detach(), index, old)
        return {**state_dict, "param_groups": merged, "state": state}

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's loading, with each state tensor kept in its saved dtype.

        torch casts every floating state tensor to its parameter's dtype (a bf16 weight's fp32
        moments and block maxima would come back bf16); here they keep the dtype they were
        saved with. Shapes and dtypes are checked against this optimizer first: a state dict
        of another configuration (other states mode, block size) is refused, nothing changed.
        A state dict of torch's own AdamW, Adam or SGD (the same parameters) is converted: the
        moments stored in this optimizer's precision, as `converted` does.
        """
        if isinstance(state_dict, dict):
            state_dict = _packed_low_bits(self._from_torch(state_dict))
        saved = state_dict.get("state", {}) if isinstance(state_dict, dict) else {}
        params = [p for g in self.param_groups for p in g["params"]]
        groups = state_dict.get("param_groups", []) if isinstance(state_dict, dict) else []
        ids = [i for g in groups for i in g.get("params", [])]
        by_id = dict(zip(ids, params, strict=False))
        keys = {}  # seeds a state dict lacks (saved before its mode drew random bits)
        for pid, entry in saved.items():
            param = by_id.get(pid)
            if param is None or not isinstance(entry, dict):
                continue
            group = next(g for g in self.param_groups if any(q is param for q in g["params"]))
            # The group the checkpoint was saved with decides the layout it should have.
            saved_group = next(g for g in groups if pid in g.get("params", []))
            expected = self._init_state({**group, **{k: v for k, v in saved_group.items()
                                                     if k != "params"}},
                                        local_tensor(param).detach(), 0)  # fmt: skip
            for key, want in expected.items():
                have = entry.get(key)
                if key == "key" and have is None:
                    index = next(i for i, q in enumerate(params, 1) if q is param)
                    keys[pid] = mix_seed(saved_group.get("seed", 0), index)
                    continue
                if (
                    not isinstance(have, torch.Tensor)
                    or have.shape != want.shape
                    or (have.dtype != want.dtype and key != "step")
                ):
                    raise ValueError(
                        f"{type(self).__name__}: state {key!r} of parameter {pid} does not fit "
                        f"(saved {None if have is None else (tuple(have.shape), have.dtype)}, "
                        f"expected {(tuple(want.shape), want.dtype)}): load a state dict saved "
                        f"with the same weights/states/block_size settings."
                    )
        super().load_state_dict(state_dict)
        for pid, entry in saved.items():
            param = by_id.get(pid)
            if param is None or not isinstance(entry, dict):
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor):
                    device = local_tensor(param).device
                    dtype = torch.float32 if key == "step" else value.dtype
                    self.state[param][key] = value.to(device=device, dtype=dtype, copy=True)
            if pid in keys:
                device = local_tensor(param).device
                self.state[param]["key"] = torch.tensor(keys[pid], dtype=torch.int64,
                                                        device=device)  # fmt: skip


class LowMemAdamW(LowMemOptimizer):
    """AdamW (decoupled weight decay) with low-memory weights and states.

    Args: as ``torch.optim.AdamW`` (``lr``, ``betas``, ``eps``, ``weight_decay``, ``maximize``;
    no ``amsgrad``), plus ``weights``, ``states``, ``block_size``, ``min_quantized`` and
    ``seed`` (module docstring).
    """

    _moments = (("exp_avg", True), ("exp_avg_sq", False))
    _decoupled = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        weights: str = "stochastic",
        states: str = "8bit",
        block_size: int = codes.BLOCK,
        min_quantized: int = 4096,
        seed: int = 0,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        maximize=maximize, weights=weights, states=states,
                        block_size=block_size, min_quantized=min_quantized, seed=seed)  # fmt: skip
        super().__init__(params, defaults)

    def _gradient(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                  state: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        if self._decoupled:
            return g
        return _l2(group, g, lambda: self._weight(group, p, state))

    def _update(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                state: dict[str, Any]) -> None:  # fmt: skip
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        delta = None
        if wd != 0 and self._decoupled:
            delta = self._weight(group, p, state) * (-lr * wd)
        (m_name, m_signed), (v_name, v_signed) = self._moments
        # torch's lerp as separate kernels: eager lerp fuses a multiply-add on tensors of
        # 64+ elements, which compiled code does not, so the bits would differ.
        m = self._moment(group, state, m_name, m_signed, g,
                         lambda old, x: old + (x - old) * (1 - beta1), 1)  # fmt: skip
        v = self._moment(group, state, v_name, v_signed, g,
                         lambda old, x: old * beta2 + (1 - beta2) * x * x, 2)  # fmt: skip
        correction1, correction2_sqrt = self._once(
            state, "corrections", lambda: _corrections(state["step"], beta1, beta2)
        )
        denom = v.sqrt() / correction2_sqrt + eps
        update = m / denom * (-lr / correction1)
        self._apply(group, p, state, update if delta is None else update + delta)


def _packed_low_bits(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with split masters' low bits saved as int16 (one per element, before
    0.8) packed two to an int32 word as they are held now (`pack_halves`)."""
    state = state_dict.get("state")
    if not isinstance(state, dict) or not any(
        isinstance(e, dict) and torch.is_tensor(e.get("lo")) and e["lo"].dtype == torch.int16
        for e in state.values()
    ):
        return state_dict
    new = {}
    for pid, entry in state.items():
        lo = entry.get("lo") if isinstance(entry, dict) else None
        if torch.is_tensor(lo) and lo.dtype == torch.int16:
            entry = {**entry, "lo": pack_halves(lo.reshape(-1).to(torch.int32) & 0xFFFF)}
        new[pid] = entry
    return {**state_dict, "state": new}


def _per_block(t: torch.Tensor) -> torch.Tensor:
    """1-D `t` (one value per block), computed once when compiled, not in every vector of
    the elements' loop: a reduction over 16 copies of each value, which inductor cannot
    inline (over two copies, as `computed_once`, it unrolls into an elementwise max and
    inlines that). Eagerly `t` itself."""
    if not torch.compiler.is_compiling():
        return t
    return t.unsqueeze(-1).expand(*t.shape, 16).amax(-1)


def _l2(group: dict[str, Any], g: torch.Tensor, w: Any) -> torch.Tensor:
    """`g` with L2 weight decay ``weight_decay * w`` added (`w()` gives the fp32 weight)."""
    return g + group["weight_decay"] * w() if group["weight_decay"] != 0 else g


def _corrections(step: torch.Tensor, beta1: float, beta2: float) -> torch.Tensor:
    """Adam's bias corrections at `step`: ``(1 - beta1^step, sqrt(1 - beta2^step))``, fp32,
    computed in fp64 as one small computation (`computed_once`) for both."""
    step = step.double()
    both = torch.stack([1 - beta1**step, (1 - beta2**step).sqrt()]).float()
    return computed_once(both)


class LowMemAdam(LowMemAdamW):
    """Adam (L2 weight decay added to the gradient), with low-memory weights and states.

    Args: as `LowMemAdamW`; ``weight_decay`` defaults to 0, as torch's Adam.
    """

    _decoupled = False

    def __init__(self, params: Iterable[Any], lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(params, lr, betas, eps, weight_decay, **kwargs)


class LowMemSGD(LowMemOptimizer):
    """SGD with momentum (torch's: dampening, nesterov, weight decay), low-memory states.

    Without momentum there is no state to shrink, but the weights mode still applies. Args:
    as ``torch.optim.SGD`` plus ``weights``, ``states``, ``block_size``, ``min_quantized``,
    ``seed``.
    """

    _moments = (("momentum_buffer", True),)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        weights: str = "stochastic",
        states: str = "8bit",
        block_size: int = codes.BLOCK,
        min_quantized: int = 4096,
        seed: int = 0,
    ) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise PolicyError("nesterov=True needs momentum > 0 and dampening=0 (as torch's SGD).")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        weights=weights, states=states, block_size=block_size,
                        min_quantized=min_quantized, seed=seed)  # fmt: skip
        super().__init__(params, defaults)

    def _moments_of(self, group: dict[str, Any]) -> tuple[tuple[str, bool], ...]:
        return self._moments if group["momentum"] else ()

    def _gradient(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                  state: dict[str, Any]) -> torch.Tensor:  # fmt: skip
        return _l2(group, g, lambda: self._weight(group, p, state))

    def _update(self, group: dict[str, Any], p: torch.Tensor, g: torch.Tensor,
                state: dict[str, Any]) -> None:  # fmt: skip
        mu = group["momentum"]
        if mu != 0:
            # torch's first step takes the gradient itself as the buffer; the counter says
            # which step this is without a Python branch on the data.
            first, keep = state["step"] == 1, 1 - group["dampening"]

            def rule(old: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
                return torch.where(first, x, old * mu + keep * x)

            buf = self._moment(group, state, "momentum_buffer", True, g, rule, 1)
            g = g + mu * buf if group["nesterov"] else buf
        self._apply(group, p, state, g * -group["lr"])


_KINDS: dict[type, type] = {}


def _kinds() -> dict[type, type]:
    if not _KINDS:
        _KINDS.update({torch.optim.AdamW: LowMemAdamW, torch.optim.Adam: LowMemAdam,
                       torch.optim.SGD: LowMemSGD})  # fmt: skip
    return _KINDS


def check_convertible(optimizer: Any) -> None:
    """Refuse, before anything changes, an optimizer `converted` cannot replace (a factory is
    checked when it has been called)."""
    if isinstance(optimizer, LowMemOptimizer) or (
        callable(optimizer) and not hasattr(optimizer, "param_groups")
    ):
        return
    if type(optimizer) not in _kinds():
        raise PolicyError(
            f"low-memory weights and optimizer states are implemented for "
            f"{format_options([k.__name__ for k in _kinds()])}, not {type(optimizer).__name__}. "
            f"Pass one of those (or a mixprec.LowMemAdamW/LowMemAdam/LowMemSGD), or use "
            f"master_weights=True with optimizer_states='fp32'."
        )
    for group in optimizer.param_groups:
        for flag in ("amsgrad", "differentiable", "fused"):
            if group.get(flag):
                raise PolicyError(
                    f"{type(optimizer).__name__}({flag}=True) has no low-memory counterpart: "
                    f"drop {flag}=True, or keep fp32 master weights and states."
                )


def converted(optimizer: torch.optim.Optimizer, **settings: Any) -> LowMemOptimizer:
    """A low-memory optimizer with `optimizer`'s class, param groups and hyperparameters.

    Accepts torch's AdamW, Adam and SGD (their exact classes); `settings` are ``weights``,
    ``states``, ``seed`` (and ``block_size``, ``min_quantized``). State the optimizer already
    has (a checkpoint loaded before ``initialize``) is carried over, stored in the new
    precision.

    Raises:
        PolicyError: another optimizer class, or a setting these classes do not support
            (``amsgrad``, ``fused``, ``differentiable``).
    """
    check_convertible(optimizer)
    cls = _kinds()[type(optimizer)]
    keep = ("lr", "betas", "eps", "weight_decay", "maximize", "momentum", "dampening",
            "nesterov")  # fmt: skip
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k in keep}
        if isinstance(new.get("betas"), tuple):
            new["betas"] = tuple(float(b) for b in new["betas"])
        new["params"] = list(group["params"])
        groups.append(new)
    first = {k: v for k, v in groups[0].items() if k != "params"}
    low = cls(groups, **first, **settings)
    index = 0
    for group in low.param_groups:
        for p in group["params"]:
            index += 1
            old = optimizer.state.get(p)
            if old:
                low.state[p] = low._carried(group, local_tensor(p), index, old)
    return low
