"""mixprec's Lightning plugin under FSDP2: ``Trainer.fit`` with ``ModelParallelStrategy`` on 2 CPU
ranks (gloo), the network sharded by ``mixprec.fully_shard`` in ``configure_model``.

Against the same training written by hand on the same ranks (``mixprec.fully_shard`` +
``mixprec.GradScaler`` + ``mixprec.SkipAwareLR``), bit for bit: the losses of every step on every
rank, the learning rates, the final (gathered) weights; an inf in the last rank's loss makes
both ranks skip that step (weights unchanged, schedule held, scale halved), agreeing with one
all-reduce per step. Lightning's own
save/resume (a DCP folder, or one assembled file) carries the scaler and the optimizer's
sharded state, and the resumed run equals the uninterrupted one. tests/lightning_scenarios.py
says how a real ``Trainer.fit`` runs inside the pool's processes.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("lightning")

from tests import fork_server
from tests import lightning_scenarios as S
from tests.dist_pool import RankPool

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
]


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2, preload=("lightning.pytorch", S.__name__))
    yield ranks
    ranks.close()


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


CASES = [
    ("O2", "fp16", S.CLIP, "mixprec"),  # the recipe: fp16 loss scaling, clipping by norm
    ("O2", "bf16", None, "mixprec"),
    ("O1", "fp16", None, "mixprec"),
    ("O1", "fp16", None, "torch"),  # O1 casts no weight: torch's own fully_shard works too
    ("O3", "bf16", None, "mixprec"),  # no scaler, no inf injected
]  # fmt: skip


@pytest.mark.parametrize(
    "level,dtype,clip,shard",
    CASES,
    ids=[f"{lv}-{d}{'-clip' if c else ''}-{s}" for lv, d, c, s in CASES],
)
def test_trainer_fit_on_fsdp2_equals_the_hand_written_loop(pool, level, dtype, clip, shard):
    _check_fit(pool.run(S.fsdp2_fit, level, dtype, clip, shard), level, dtype)


def test_lightnings_own_launcher_runs_the_same(tmp_path):
    """Once through Lightning's launcher (it re-runs the command line for rank 1 and creates the
    process group itself); the pool above cannot re-run pytest's command line.

    ``python -m tests.lightning_scenarios`` is forked from the server that started the pool's
    processes, with Lightning imported (11 s of CPU less than a fresh interpreter); rank 1 is
    the fresh interpreter Lightning's launcher starts with that command line."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}  # fmt: skip
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = fork_server.run([sys.executable, "-m", "tests.lightning_scenarios", str(tmp_path)],
                           cwd=root, env=env, timeout=300,
                           preload=("lightning.pytorch",))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _check_fit(ranks, "O2", "fp16")


def _check_fit(ranks: list[dict], level: str, dtype: str) -> None:
    for rank, r in enumerate(ranks):
        ref = r["ref"]
        assert r["losses"] == ref["losses"], rank  # bit for bit, every step
        assert r["lrs"] == ref["lrs"], rank
        assert _equal(r["params"], ref["params"]), rank
        assert _equal(r["params"], ranks[0]["params"])
        # Lightning steps the user's optimizer over FSDP's shards: no second copy of a weight.
        assert r["optimizer"] == "SGD" and r["stepped_are_model_params"]
        assert r["param_dtypes"] == (["torch.bfloat16"] if level == "O3" else ["torch.float32"])
    scaled = S.scales(level, dtype)
    for r in ranks:  # the scaler's agreement: one all-reduce per step (none without a scaler)
        assert r["all_reduces"] == [int(scaled)] * S.STEPS
    if not scaled:
        assert ranks[0]["scale"] is None
        return
    # The inf was in the last rank's loss only; rank 0's loss was finite, and it skipped too.
    assert math.isfinite(ranks[0]["losses"][S.INF_STEP])
    for r in ranks:
        assert r["scale"] == r["ref"]["scale"] == S.SCALER["init_scale"] / 2
        assert r["skipped"] == 1
        before, after = r["snapshots"][S.INF_STEP - 1], r["snapshots"][S.INF_STEP]
        assert _equal(before, after)  # the skipped step changed no weight ...
        assert not _equal(after, r["snapshots"][S.INF_STEP + 1])  # ... the next one did
        lrs = r["lrs"]  # ... and the schedule held still for it
        assert lrs[S.INF_STEP + 1] == lrs[S.INF_STEP] == lrs[S.INF_STEP - 1] / 2


@pytest.mark.parametrize("distributed_checkpoint", [True, False], ids=["dcp-folder", "one-file"])
def test_lightning_resume_on_fsdp2_equals_the_uninterrupted_run(
    pool, tmp_path, distributed_checkpoint
):
    path = str(tmp_path / ("ckpt" if distributed_checkpoint else "ckpt.pt"))
    ranks = pool.run(S.fsdp2_resume, path, "O2", "fp16", distributed_checkpoint)
    for rank, r in enumerate(ranks):
        ref = r["ref"]  # the uninterrupted run (the inf at step 1 was skipped before saving)
        assert r["first_losses"] + r["losses"] == ref["losses"], rank
        assert r["lrs"] == ref["lrs"][4:], rank  # the held schedule came back
        assert _equal(r["params"], ref["params"]), rank
        assert r["scale"] == S.SCALER["init_scale"] / 2 and r["skipped"] == 1
        assert r["is_folder"] == distributed_checkpoint
    saved = ranks[0]["saved_plugin"]  # the plugin's state: the scaler, every field
    assert saved["format"] == "mixprec.AmpEngine/1" and saved["opt_level"] == "O2"
    assert saved["scaler"]["scale"] == 512.0 and saved["scaler"]["skipped"] == 1


def test_fsdp2_misconfigurations_name_the_fix(pool):
    r0, r1 = pool.run(S.fsdp2_errors)
    assert r0 == r1
    assert r0["level"] == (
        "IntegrationError: submodule 'net' was sharded by mixprec.fully_shard at O2 (bf16), "
        "which fixed how its weights are stored, gathered and reduced; the precision plugin runs "
        "O1 (bf16). Give both the same level and dtype: mixprec.fully_shard(..., "
        "opt_level='O2', dtype='bf16') and the plugin's ('O2', dtype='bf16')."
    )
    assert r0["torch_sharded"] == (
        "IntegrationError: submodule 'net' of Module is sharded with torch's fully_shard, "
        "without mixprec's policies. Under FSDP2, O2's bf16 weights are FSDP's own mixed "
        "precision (its fp32 shards are the master weights), chosen when sharding: in "
        "configure_model call mixprec.fully_shard(module, opt_level='O2', dtype='bf16', "
        "mesh=...) instead of fully_shard. O0 and O1 run on a model sharded with torch's "
        "fully_shard as it is."
    )
    assert r0["option"] == (
        "IntegrationError: the plugin's keep_batchnorm_fp32=False differs from what "
        "mixprec.fully_shard applied to submodule 'net' (keep_batchnorm_fp32=True); model-side "
        "options are fixed when sharding. Pass keep_batchnorm_fp32 to mixprec.fully_shard only."
    )
    assert r0["outside"] == (
        "IntegrationError: 2 parameter(s) of Module (the first is 'head.weight') lie outside the "
        "modules sharded by mixprec.fully_shard, so O2 would leave them in fp32 with no policy. "
        "Shard the module that holds every parameter with mixprec.fully_shard (name blocks with "
        "units=)."
    )
    assert r0["option_unchanged"] and r0["outside_unchanged"]
