"""mixprec under DDP and FSDP2, on 2 (and 4) CPU processes over gloo.

What is checked, against single-process references computed on the same ranks
(tests/dist_scenarios.py says why those references are exact):

- the scaler on FSDP2's DTensor gradients, every unscale_impl and skip mode: an inf on one
  rank's shard makes every rank skip, with one asynchronous all-reduce per step;
- O0-O3 under FSDP2 (torch's fully_shard for O0/O1, mixprec.fully_shard for O2/O3) and under
  DDP (both orders of wrapping where they work, and TrainStep): bit for bit the single-process
  run over the same micro-batches, within a stated tolerance of one process on the
  concatenated batch, every rank's parameters equal, an inf in one rank's input skipped by all;
- under DDP the scaler drops its all-reduce when mixprec sees the DDP wrapper;
- memory: mixprec O2 on FSDP2 holds no byte more than FSDP2's own mixed precision;
- sharded checkpoints: resume bit for bit, saved on 2 ranks and loaded on 1 and the reverse,
  saved on 4 and loaded on 2;
- FP8 under FSDP2 (tests/dist_fp8_scenarios.py): bit for bit one process's FP8 run on 2 ranks
  (within an fp32 ulp on 4, where FSDP2 sums four gradients in another order), the FP8
  histories agreed across ranks, the FP8 layers' all-gathers at most 0.55x the bytes of bf16's
  (counted from the collectives), checkpoints that resume bit for bit;
- every misuse (order of wrapping, arguments) fails with the message that names the fix.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import mixprec
from tests import dist_fp8_scenarios as S8
from tests import dist_scenarios as S
from tests.dist_pool import RankPool

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
]


@pytest.fixture(scope="module")
def pools():
    started: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in started:
            started[world] = RankPool(world, preload=(S.__name__, S8.__name__))
        return started[world]

    yield get
    for pool in started.values():
        pool.close()


_equal = S.same


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


# ----------------------------------------------------------------------------- scaler, FSDP2


@pytest.mark.parametrize("mode", ["restore", "fused", "sync"])
@pytest.mark.parametrize("impl", ["torch", "foreach"])
def test_scaler_skips_together_on_dtensor_gradients(pools, impl, mode):
    r0, r1 = pools(2).run(S.fsdp_scaler, impl, mode)
    assert r0["mode"] == mode
    # The inf was on rank 1's shard only: rank 0 skipped because the scaler agreed, once per
    # step (before this change, 'foreach' raised a bare AssertionError on DTensor gradients).
    assert r0["scales"] == r1["scales"] == [1024.0, 512.0, 512.0, 512.0]
    assert r0["calls"] == r1["calls"] == [1, 1, 1, 1]
    assert r0["unchanged"] and r1["unchanged"]  # the skipped step changed no parameter
    assert _equal(r0["params"], r0["ref"]) and _equal(r1["params"], r0["ref"])


# ----------------------------------------------------------------------------- levels, FSDP2

LOW, FP32 = torch.bfloat16, torch.float32


FSDP_CASES = [
    ("O0", True, "torch"), ("O1", True, "torch"), ("O1", True, "mixprec"),
    ("O2", False, "mixprec"), ("O2", True, "mixprec"), ("O3", False, "mixprec"),
]  # fmt: skip


@pytest.mark.parametrize(
    "level,dynamic,entry",
    FSDP_CASES,
    ids=[f"{lv}-{e}{'-scaled' if d else ''}" for lv, d, e in FSDP_CASES],
)
def test_levels_under_fsdp2_match_one_process(pools, level, dynamic, entry):
    r0, r1 = pools(2).run(S.fsdp_level, level, dynamic, entry)
    assert _equal(r0["params"], r0["ref"]) and _equal(r1["params"], r0["ref"])
    skipped = [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    assert r0["scales"] == r1["scales"] == (skipped if dynamic else [1.0] * 4)
    assert r0["masters"] == 0 and r0["stepped_are_model_params"]
    seen = r0["seen"]
    # O1 and O2 return fp32 outputs (a loss after the model runs in fp32), sharded either way.
    assert seen["output"] == (LOW if level == "O3" else FP32)
    if level == "O2":  # gathered in bf16; norm layers as fp32 units; fp32 shards and gradients
        assert seen["linear"] == (LOW, LOW)
        assert seen["norm"] == (FP32, FP32, LOW)
        assert seen["grad"] == {"DTensor torch.float32"} and r0["param_dtypes"] == ["torch.float32"]
    elif level == "O3":
        assert seen["linear"] == (LOW, LOW) and seen["norm"] == (LOW, LOW, LOW)
        assert seen["grad"] == {"DTensor torch.bfloat16"}
    else:  # fp32 weights; O1 casts per op under autocast
        assert seen["linear"] == (FP32, FP32) and seen["grad"] == {"DTensor torch.float32"}
        assert seen["norm"][0] == (LOW if level == "O1" else FP32)


def test_trainstep_on_a_sharded_model_runs_eagerly_with_the_same_numbers(pools):
    r0, r1 = pools(2).run(S.fsdp_trainstep)
    assert _equal(r0["params"], r0["ref"]) and _equal(r1["params"], r0["ref"])
    assert r0["calls"] == 4  # FSDP2 does not all-reduce gradients: the scaler agrees itself
    assert r0["reason"] == (
        "running eagerly: the compiled step does not place collectives yet (the same "
        "operations run one at a time; on the gloo process group of 2 ranks: the scaler's "
        "overflow all-reduce)"
    )


# ----------------------------------------------------------------------------- levels, DDP

DDP_CASES = [
    ("O0", True, "initialize-then-ddp"), ("O0", True, "ddp-then-initialize"),
    ("O0", True, "trainstep"), ("O1", True, "initialize-then-ddp"),
    ("O1", True, "ddp-then-initialize"), ("O1", True, "trainstep"),
    ("O2", True, "initialize-then-ddp"), ("O2", True, "trainstep"),
    ("O2", True, "trainstep-given-ddp"),
    ("O2", False, "initialize-then-ddp"), ("O3", False, "initialize-then-ddp"),
    ("O3", False, "trainstep"),
    # O4: bf16 weights stepped with stochastic rounding (the same seed on every rank); its
    # bf16 gradients unscale exactly, so a scaler may run to test the skip under DDP.
    ("O4", True, "initialize-then-ddp"), ("O4", False, "trainstep"),
]  # fmt: skip

# One process on the concatenated batch rounds differently (one matmul over all rows instead of
# one per rank). fp32 (O0): about an ulp. bf16 gradients with fp32 optimizer state (O1, O2):
# bf16's unit roundoff (2**-8) in the gradient, which AdamW's normalized update (lr 1e-2, 4
# steps) turns into at most 4 * 1e-2 * 2**-7. O3 keeps AdamW's moments in bf16 too: where a
# gradient is near zero its rounded sign can differ, and the normalized step with it, so the
# bound is the step itself, 2 * lr per step.
CONCAT_ATOL = {"O0": 1e-6, "O1": 4 * 1e-2 * 2**-7, "O2": 4 * 1e-2 * 2**-7, "O3": 4 * 2 * 1e-2,
               "O4": 4 * 2 * 1e-2}  # fmt: skip
DDP_IDS = [f"{lv}-{o}{'-scaled' if d else ''}" for lv, d, o in DDP_CASES]


@pytest.mark.parametrize("level,dynamic,order", DDP_CASES, ids=DDP_IDS)
def test_levels_under_ddp_match_one_process(pools, level, dynamic, order):
    r0, r1 = pools(2).run(S.ddp_level, level, dynamic, order)
    assert _equal(r0["params"], r1["params"]) and _equal(r0["masters"], r1["masters"])
    assert _equal(r0["masters"], r0["ref"])  # bit for bit: the same sums in the same dtypes
    for got, want in zip(r0["masters"], r0["concat"], strict=True):
        torch.testing.assert_close(got, want, atol=CONCAT_ATOL[level], rtol=0.0)
    skipped = [2.0**16, 2.0**16, 2.0**15, 2.0**15]
    assert r0["scales"] == r1["scales"] == (skipped if dynamic else [1.0] * 4)
    # mixprec sees the DDP wrapper (initialize given it, TrainStep): the scaler does not agree
    # again. Wrapped after initialize, it keeps its one asynchronous all-reduce per step.
    sees_ddp = order != "initialize-then-ddp"
    assert r0["calls"] == ([0] * 4 if sees_ddp or not dynamic else [1] * 4)
    if order.startswith("trainstep"):
        assert r0["reason"].startswith(
            "running eagerly: the compiled step does not place collectives yet (the same "
            "operations run one at a time; on the gloo process group of 2 ranks: DDP's gradient "
            "all-reduce"
        )
        assert ("no overflow all-reduce (DDP reduced every gradient)" in r0["reason"]) == dynamic
        assert "  distributed: on the gloo process group of 2 ranks" in r0["explain"]


def test_trainstep_follows_pytorchs_ddp_capture_rules(pools):
    r0, _ = pools(2).run(S.capture_rules)
    assert r0["ok"] is None and r0["old_variable"] is None  # the pre-2.2 variable name counts
    assert r0["gloo"] == (
        "the process group's gloo backend cannot be captured in a CUDA graph (only NCCL can, "
        "from 2.9.6 on); the step's collectives run eagerly"
    )
    assert r0["fsdp"] == (
        "the model is sharded with FSDP2, whose hooks decide per call in Python which "
        "parameters to all-gather and free; a replayed graph would skip them"
    )
    assert r0["old_nccl"] == (
        "NCCL 2.9.5 cannot capture collectives (PyTorch requires NCCL >= 2.9.6)"
    )
    assert r0["error_handling"] == (
        "NCCL's asynchronous error handling is on; PyTorch's rules for capturing DDP ask for "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=0 in the environment before init_process_group (its "
        "watchdog queries events a capturing stream forbids)"
    )
    assert r0["ddp_elsewhere"] == (
        "the model was wrapped in DistributedDataParallel outside TrainStep, and PyTorch's "
        "rules need DDP constructed on the stream the graph is captured on: pass the unwrapped "
        "model with ddp=True (or ddp={...DDP keyword arguments}), and TrainStep wraps it on its "
        "capture stream"
    )
    assert r0["unused"] == (
        "DDP runs with find_unused_parameters=True, which searches the autograd graph on the "
        "host and reads a bitmap back every step; a replay would do neither"
    )


def test_wrong_orders_of_wrapping_name_the_fix(pools):
    r0, r1 = pools(2).run(S.ddp_errors)
    assert r0 == r1
    for level in ("O2", "O3"):
        assert r0[level] == (
            f"mixprec.initialize(opt_level='{level}') got a model already wrapped in "
            f"DistributedDataParallel. {level} casts the model's weights to bf16 in place, and "
            f"DDP has already built its gradient buckets for the dtypes it saw, so initialize "
            f"must come first: `model, optimizer = mixprec.initialize(model, optimizer, "
            f"opt_level='{level}')`, then `model = DistributedDataParallel(model, ...)`. O0 and "
            f"O1 cast no weights and accept a DDP model in either order; "
            f"mixprec.TrainStep(model, optimizer, ..., ddp=True) wraps in the right order for "
            f"you."
        )
    assert r0["twice"] == (
        "ddp= asks TrainStep to wrap the model in DistributedDataParallel, but the model is "
        "wrapped already. Pass the unwrapped model (model.module) with ddp=..., or drop ddp=."
    )
    assert r0["initialized"] == (
        "Sequential was already initialized by mixprec.initialize; initialize a model once "
        "(build a fresh model to change the opt level). It is wrapped in "
        "DistributedDataParallel now: keep using the optimizer that first initialize call "
        "returned with this DDP model (initialize, then DDP, is the right order)."
    )


def test_fsdp2_misuse_names_the_fix(pools):
    r0, r1 = pools(2).run(S.fsdp_errors)
    assert r0 == r1
    assert r0["torch_sharded_O2"] == (
        "mixprec.initialize(opt_level='O2') got a model sharded with FSDP2 "
        "(torch.distributed.fsdp.fully_shard) without mixprec's policies. Under FSDP2, O2's "
        "bf16 weights are FSDP's own mixed precision (its fp32 shards are the master weights), "
        "which is chosen when sharding: shard the fp32 model with mixprec.fully_shard(model, "
        "opt_level='O2') instead of fully_shard, build the optimizer over model.parameters(), "
        "then call mixprec.initialize(model, optimizer, opt_level='O2'). O0 and O1 run on a "
        "model sharded with torch's fully_shard as it is."
    )
    # initialize(O2) then torch's fully_shard: torch accepts the call and fails in the first
    # forward with its own message; a second initialize then says what to do instead.
    assert "torch_after_O2" not in r0
    assert r0["O2_twice"] == (
        "FSDPSequential was already initialized by mixprec.initialize; initialize a model once "
        "(build a fresh model to change the opt level). It has been sharded with FSDP2 since, "
        "and FSDP2 needs the opt level while sharding (O2 after initialize fails in FSDP's "
        "first forward: 'FSDP expects uniform original parameter dtype'). Build the fp32 model "
        "afresh, call mixprec.fully_shard(model, opt_level=...) instead of "
        "initialize-then-fully_shard, build the optimizer over model.parameters(), then "
        "mixprec.initialize(model, optimizer, opt_level=...)."
    )
    assert r0["presharded"] == (
        "submodule '0' is already sharded with fully_shard. mixprec.fully_shard shards the "
        "whole model in one call, so that every unit gets the opt level's policy: pass the "
        "unsharded model, and name the submodules to shard as units of their own with "
        "units=(TheirClass, ...)."
    )
    assert r0["level"] == (
        "the model was sharded by mixprec.fully_shard at O2 (bf16), which fixed how its "
        "weights are stored, gathered and reduced; initialize got O1 (bf16). Call "
        "mixprec.initialize(model, optimizer, opt_level='O2', dtype='bf16'), or shard a fresh "
        "model at the level you want."
    )
    assert r0["option"] == (
        "keep_batchnorm_fp32=False differs from what mixprec.fully_shard applied to this model "
        "(keep_batchnorm_fp32=True); model-side options are fixed when sharding. Drop "
        "keep_batchnorm_fp32 here, or pass it to mixprec.fully_shard."
    )
    assert r0["initialize_twice"] == (
        "FSDPSequential (sharded by mixprec.fully_shard) was already given to "
        "mixprec.initialize with an optimizer; call initialize once per model."
    )


def test_fully_shard_arguments_are_checked_before_sharding():
    # No process group here: every one of these fails before torch's fully_shard runs.
    model = S.net()
    cases = [
        ({"mp_policy": object()}, (
            "mixprec.fully_shard builds each unit's MixedPrecisionPolicy from the opt level, "
            "so it takes no mp_policy. Pass opt_level=... (and dtype=...) instead, or call "
            "torch.distributed.fsdp.fully_shard yourself to use your own policy.")),
        ({"units": ("Block",)}, (
            "units must be nn.Module classes or a predicate (name, module) -> bool; got "
            "'Block'. Example: mixprec.fully_shard(model, opt_level='O2', "
            "units=(TransformerBlock,)).")),
    ]  # fmt: skip
    for kwargs, message in cases:
        with pytest.raises(mixprec.DistributedError) as err:
            mixprec.fully_shard(model, **kwargs)
        assert str(err.value) == message
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.fully_shard(model, resharding=True)
    assert str(err.value).startswith(
        "mixprec.fully_shard got an unknown keyword 'resharding'. Valid: fully_shard's "
    )
    assert "'reshard_after_forward'" in str(err.value) and "'keep_batchnorm_fp32'" in str(err.value)
    initialized = S.net()
    initialized, _ = mixprec.initialize(
        initialized, torch.optim.SGD(initialized.parameters(), lr=0.1), "O1"
    )
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.fully_shard(initialized)
    assert str(err.value) == (
        "Sequential was already prepared by mixprec (mixprec.initialize). Under FSDP2 the opt "
        "level is applied while sharding: build the fp32 model afresh, call "
        "mixprec.fully_shard(model, opt_level=...) on it, then build the optimizer over "
        "model.parameters() and call mixprec.initialize(model, optimizer, opt_level=...)."
    )
    assert not any(True for _ in S.net().modules() if type(_).__name__.startswith("FSDP"))


def test_trainstep_ddp_argument_errors():
    model = S.net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.TrainStep(model, opt, compute_loss=S.loss_of, ddp=True)
    assert str(err.value) == (
        "ddp= needs torch.distributed: call torch.distributed.init_process_group() first "
        "(torchrun, or `mixprec train --nproc-per-node N`, sets up its environment)."
    )
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.TrainStep(model, opt, compute_loss=S.loss_of, ddp="yes")
    assert str(err.value) == (
        "ddp='yes' must be True, False or a dict of DistributedDataParallel keyword arguments "
        "(for example {'device_ids': [local_rank]})."
    )


# ----------------------------------------------------------------------------- memory


def test_o2_on_fsdp2_adds_no_fp32_copy(pools):
    rows = pools(2).run(S.fsdp_memory, 32)
    for row in rows:
        mp, o2, fp32 = row["fsdp2 mp"], row["mixprec O2"], row["fsdp2 fp32"]
        assert o2["masters"] == 0 and o2["skip_snapshot"] == 0
        # The same sharded fp32 parameters, fp32 gradients and AdamW state as FSDP2 alone.
        assert (
            {k: o2[k] for k in ("params", "grads", "optimizer", "total")}
            == {k: mp[k] for k in ("params", "grads", "optimizer", "total")}
            == {k: fp32[k] for k in ("params", "grads", "optimizer", "total")}
        )
        # A fused optimizer skips in its kernel; any other keeps the restore snapshot (a copy
        # of its parameters and state), as the scaler's docs say.
        assert row["mixprec O2 fp16"]["total"] == o2["total"]
        restore = row["mixprec O2 fp16 restore"]
        assert restore["skip_snapshot"] == o2["params"] + o2["optimizer"]
    # Unsharded O2 (DDP's layout) keeps fp32 masters beside the bf16 weights, on every rank.
    from benchmarks.fsdp_memory import build

    model = build(32, 2)
    norms = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
                for p in m.parameters())  # fmt: skip
    low = sum(p.numel() for p in model.parameters()) - norms
    unsharded = rows[0]["unsharded O2"]
    assert unsharded["params"] == 2 * low + 4 * norms and unsharded["masters"] == 4 * low


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_resume_is_bitwise_on_the_same_world(pools, tmp_path):
    path = str(tmp_path / "fsdp2")
    saved = pools(2).run(S.ckpt_fsdp, path, "save")
    resumed = pools(2).run(S.ckpt_fsdp, path, "resume")
    for a, b in zip(saved, resumed, strict=True):
        assert _equal(a["params"], b["params"]) and a["stats"] == b["stats"]
        assert a["scale"] == b["scale"] == 2.0**15  # the inf at step 2 was skipped before saving


def test_checkpoint_saved_on_two_ranks_loads_on_one_and_back(pools, tmp_path):
    # A world of 2 sums its two micro-batches in fp32 (FSDP2's reduce_dtype); one process
    # accumulating the same two micro-batches in fp32 does the same arithmetic: bit for bit.
    two = str(tmp_path / "two")
    saved = pools(2).run(S.ckpt_fsdp, two, "save")
    (one_rank,) = pools(1).run(S.ckpt_accumulate, two, "resume", 2)  # FSDP2 on 1 rank
    assert _equal(one_rank["params"], saved[0]["params"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks run one thread each: the same kernels, the same bits
    try:
        unsharded = S.ckpt_accumulate(0, 1, two, "resume", 2)  # no process group at all
        one = str(tmp_path / "one")
        alone = S.ckpt_accumulate(0, 1, one, "save", 2)
    finally:
        torch.set_num_threads(threads)
    assert _equal(unsharded["params"], saved[0]["params"])
    back = pools(2).run(S.ckpt_fsdp, one, "resume")
    assert _equal(back[0]["params"], alone["params"]) and back[0]["scale"] == alone["scale"]


def test_ddp_checkpoint_with_masters_loads_on_one_process(pools, tmp_path):
    path = str(tmp_path / "ddp")
    r0, _ = pools(2).run(S.ckpt_ddp_save, path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # DDP summed the bf16 gradients in bf16: the single process sums them the same way
        one = S.ckpt_accumulate(0, 1, path, "resume", 2, "param")
    finally:
        torch.set_num_threads(threads)
    assert _equal(one["params"], r0["masters"]) and one["scale"] == r0["scale"]


def test_four_ranks_skip_together_and_reshard_to_two(pools, tmp_path):
    path = str(tmp_path / "four")
    four = pools(4).run(S.ddp_four_ranks, path)
    for r in four:  # the inf was in rank 2's input only
        assert r["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        assert _equal(r["params"], four[0]["params"])
    two = pools(2).run(S.ckpt_load_only, path)
    for r in two:
        assert _equal(r["params"], four[0]["sharded"]) and r["scale"] == four[0]["scale"]


def test_a_checkpoint_that_does_not_fit_changes_nothing(tmp_path):
    torch.manual_seed(0)
    model = S.net()
    model, opt = mixprec.initialize(model, S._opt(model), "O1", loss_scale="dynamic")
    S.train_steps(model, opt, range(2), 1, [0])
    mixprec.save_checkpoint(str(tmp_path / "o1"), model, opt)

    fresh = S.net(seed=1)
    fresh, fresh_opt = mixprec.initialize(fresh, S._opt(fresh), "O2", loss_scale="dynamic")
    before = copy.deepcopy([t.detach() for t in fresh.state_dict().values()])
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.load_checkpoint(str(tmp_path / "o1"), fresh, fresh_opt)
    assert str(err.value) == (
        "the checkpoint was saved at opt level 'O1', this job runs 'O2': initialize (or "
        "mixprec.fully_shard) with the same level. Nothing was changed."
    )
    assert _equal(before, [t.detach() for t in fresh.state_dict().values()])
    assert not fresh_opt.optimizer.state  # the state created for DCP to fill was dropped

    other = torch.nn.Sequential(torch.nn.Linear(8, 3))
    other, other_opt = mixprec.initialize(other, S._opt(other), "O1", loss_scale="dynamic")
    with pytest.raises(mixprec.DistributedError) as err:
        mixprec.load_checkpoint(str(tmp_path / "o1"), other, other_opt)
    assert str(err.value) == (
        f"the checkpoint at {str(tmp_path / 'o1')!r} does not fit this model and optimizer "
        f"(nothing was changed): ValueError on rank 0: Size mismatch between saved "
        f"torch.Size([16, 8]) and current: torch.Size([3, 8]) for mixprec.model.0.weight"
    )
    assert not other_opt.optimizer.state


def lowmem_on_shards(rank: int, world: int, path: str, entry: str) -> dict[str, str]:
    """A user-built low-memory optimizer over FSDP2's DTensor parameters, given to `entry`:
    the refusal's message per sharding and states mode (and, for checkpoints, whether DCP
    wrote anything). Runs on the ranks (this module is importable by the pool's processes)."""
    import os

    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard

    out = {}
    for shard, level in (("torch", "O1"), ("mixprec", "O2")):
        for states in ("fp32", "8bit"):
            model = S.net()
            if shard == "torch":
                fully_shard(model)
            else:
                mixprec.fully_shard(model, opt_level=level)
            opt = mixprec.LowMemAdamW(model.parameters(), states=states, min_quantized=0)
            key = f"{shard}-{states}"
            try:
                if entry == "initialize":
                    mixprec.initialize(model, opt, level)
                elif entry == "TrainStep":
                    mixprec.TrainStep(model, opt, F.cross_entropy, opt_level=level)
                else:
                    mixprec.save_checkpoint(os.path.join(path, key), model, opt)
                    out[f"{key} written"] = str(os.path.exists(os.path.join(path, key)))
            except mixprec.DistributedError as err:
                out[key] = str(err)
                if entry == "checkpoint":
                    out[f"{key} written"] = str(os.path.exists(os.path.join(path, key)))
    return out


def _lowmem_refusal(entry: str) -> str:
    return (
        f"{entry}: LowMemAdamW (a mixprec low-memory optimizer) over parameters sharded by "
        f"FSDP2 (torch's fully_shard or mixprec.fully_shard) is not supported yet: it keeps each "
        f"rank's shard of its states as plain tensors, so a checkpoint "
        f"(torch.distributed.checkpoint) would keep one rank's state for every rank, and DCP "
        f"cannot reshard blockwise 8-bit states. Use low-memory optimizers with one process or "
        f"DDP, or on a sharded model step a torch optimizer (e.g. torch.optim.AdamW) with "
        f"mixprec.fully_shard at O2 (its fp32 shards are the masters)."
    )


_SHARDINGS = ("torch-fp32", "torch-8bit", "mixprec-fp32", "mixprec-8bit")


@pytest.mark.parametrize(
    ("entry", "prefix"),
    [
        ("TrainStep", "mixprec.TrainStep"),
        ("checkpoint", "mixprec checkpoints (save_checkpoint, load_checkpoint)"),
        ("initialize", "mixprec.initialize"),
    ],
)
def test_a_lowmem_optimizer_on_fsdp2_shards_is_refused(pools, tmp_path, entry, prefix):
    r0, r1 = pools(2).run(lowmem_on_shards, str(tmp_path), entry)
    assert r0 == r1
    for key in _SHARDINGS:
        assert r0[key] == _lowmem_refusal(prefix)
        if entry == "checkpoint":
            assert r0[f"{key} written"] == "False"  # nothing was saved


def test_shard_and_initialize_resolve_for_the_device_the_shards_live_on(monkeypatch):
    """FSDP2 without a mesh shards onto the process's accelerator, moving a model built on the
    CPU: the level is resolved for that device, not the one the model was built on; and
    initialize reads it from the shard record (offloaded shards sit on the CPU)."""
    import importlib
    from types import SimpleNamespace

    from mixprec.levels.presets import resolve

    # the modules (their package attributes are the functions of the same names)
    fsdp = importlib.import_module("mixprec.distributed.fsdp")
    init_module = importlib.import_module("mixprec.levels.initialize")

    monkeypatch.setattr(torch._C, "_get_accelerator", lambda: torch.device("cuda"))
    assert fsdp._device_type(None) == "cuda"
    assert fsdp._device_type(SimpleNamespace(device_type="cpu")) == "cpu"
    model = torch.nn.Linear(4, 4)  # its parameters on the CPU, as offloaded shards are
    assert init_module._device_type([model]) == "cpu"
    record = resolve("O2", device_type="cuda")
    monkeypatch.setattr(fsdp, "sharded_options", lambda m: record if m is model else None)
    assert init_module._device_type([model]) == "cuda"


# ----------------------------------------------------------------------------- FP8 on FSDP2

TRUE_DELAYED = mixprec.Fp8Recipe.named("delayed").replace(overflow="saturate")


def _fp8_against_one_process(ranks: list[dict], world: int) -> None:
    ref = ranks[0]["ref"]
    for r in ranks:
        assert r["fp8"]["types"] == ["Fp8ShardWeight", "Tensor"]  # FP8 weights, plain others
        assert all("all-gathered in FP8" in why for why in r["fp8"]["reasons"])
        if world == 2:  # two micro-batch gradients add the same in any order: bit for bit
            assert _equal(r["fp8"]["losses"], ref["losses"])
            assert _equal(r["fp8"]["params"], ref["params"])
        else:  # FSDP2 sums four in another order than the one process: an fp32 ulp apart
            for a, b in zip(r["fp8"]["losses"], ref["losses"], strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
            assert _max_diff(r["fp8"]["params"], ref["params"]) <= 1e-6
        for mine, theirs in zip(r["fp8"]["state"], ref["state"], strict=True):
            # Histories (3, H) and scales (3,) of input, weight, gradient: the gradient's amax
            # is world x the one process's (its micro-batch losses are divided by world).
            factor = torch.tensor([1.0, 1.0, float(world)]).reshape(3, *[1] * (mine.dim() - 1))
            expected = theirs * factor if mine.dim() == 2 else theirs / factor
            torch.testing.assert_close(mine, expected, rtol=0 if world == 2 else 1e-5, atol=0)


def _fp8_gather_ratios(r: dict, world: int) -> list[float]:
    """Each FP8 unit's all-gather bytes over the same unit's in bf16; other units as bf16.

    FSDP2 gathers unit by unit, in the forward's order and then the backward's (reversed), so
    the k-th collective gathers unit k (forward) or 2n-1-k (backward). The bf16 bytes are the
    run without FP8's own collectives where it ran, else this rank's share of the unit.
    """
    units = len(S8.SIZES) - 1  # one per linear layer; the root holds no parameter
    fp8 = r["fp8"]["gathers"]
    if "bf16" in r:
        bf16 = r["bf16"]["gathers"]
    else:
        rows = [-(-S8.SIZES[i + 1] // world) for i in range(units)]  # padded rows per rank
        share = [rows[i] * (S8.SIZES[i] + 1) * 2 for i in range(units)]
        bf16 = share + share[::-1]
    assert len(fp8) == len(bf16) == 2 * units
    fp8_units = {i // 2 for i in S8.FP8_LAYERS}  # Sequential index -> linear layer index
    ratios = []
    for k, (got, base) in enumerate(zip(fp8, bf16, strict=True)):
        if (k if k < units else 2 * units - 1 - k) in fp8_units:
            ratios.append(got / base)
        else:
            assert got == base
    assert len(ratios) == 2 * len(fp8_units) and max(ratios) <= 0.55, ratios
    return ratios


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", TRUE_DELAYED],
                         ids=["tensorwise", "delayed", "true-delayed"])  # fmt: skip
def test_fsdp2_fp8_equals_one_process_and_gathers_half_the_bytes(pools, recipe):
    ranks = pools(2).run(S8.fsdp_fp8, "O2", recipe)
    _fp8_against_one_process(ranks, 2)
    for r in ranks:
        _fp8_gather_ratios(r, 2)
        # The same parameters, gradients and optimizer state as without FP8: the FP8 weight
        # exists only as the all-gather's output, and the FP8 state is a few floats per layer.
        assert r["fp8 memory"] == r["bf16 memory"]


def test_fsdp2_fp8_on_four_ranks_matches_one_process(pools):
    ranks = pools(4).run(S8.fsdp_fp8, "O2", "delayed", 2, False)
    _fp8_against_one_process(ranks, 4)
    for r in ranks:
        _fp8_gather_ratios(r, 4)


def test_fsdp2_fp8_checkpoint_resumes_bit_for_bit(pools, tmp_path):
    for r in pools(2).run(S8.fsdp_fp8_checkpoint, str(tmp_path / "fp8"), TRUE_DELAYED):
        through, resumed = r["through"], r["resumed"]
        assert _equal(through["losses"], resumed["losses"])
        assert _equal(through["params"], resumed["params"])
        assert _equal(through["state"], resumed["state"])


def test_fsdp2_fp8_misuse_names_the_fix(pools):
    (r,) = pools(1).run(S8.fsdp_fp8_errors)
    assert (
        "fp8='tensorwise' differs from what mixprec.fully_shard applied" in r["fp8 after sharding"]
    )
    assert "pass it to mixprec.fully_shard" in r["fp8 after sharding"]
    assert r["no layer"].startswith("FP8 (recipe 'delayed') converts no layer of Sequential")
    assert "in_features=8 not a multiple of 16" in r["no layer"]
    assert r["unsharded after refusal"] == "Parameter"  # refused before anything changed


@pytest.mark.parametrize(
    ("level", "dtype", "order"),
    [
        ("O1", "fp16", "initialize-then-ddp"),
        ("O1", "fp16", "ddp-then-initialize"),
        ("O1", "fp16", "drop-in"),
        ("O2", "fp16", "initialize-then-ddp"),
        ("O2", "bf16", "initialize-then-ddp"),
    ],
)
def test_accumulating_under_no_sync_keeps_the_replicas_equal(pools, level, dtype, order):
    """DDP's no_sync(): the first synchronised backward all-reduces everything .grad holds.
    The scaler set earlier micro-batches' gradients aside during each block, and O2 moved them
    into the masters, so DDP reduced only the last one and every rank kept its own earlier
    ones: the replicas drifted apart (0.09 max difference after 2 steps), and an inf in a
    no_sync micro-batch made one rank skip alone."""
    r0, r1 = pools(2).run(S.ddp_no_sync, level, dtype, order)
    assert _equal(r0["params"], r1["params"])
    assert _equal(r0.get("masters", []), r1.get("masters", []))
    skips = [False, dtype == "fp16", False]
    assert r0["skipped"] == r1["skipped"] == skips
    if level == "O2" and dtype == "fp16":  # stepping after a no_sync backward: refused
        assert "outside no_sync()" in r0["refused"] and r0["unchanged"]
    elif level == "O2":  # bf16: nothing to unscale; steps what the rank has, as DDP would
        assert r0["refused"] is None
