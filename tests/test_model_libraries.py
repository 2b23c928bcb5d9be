"""Real model code from Transformers and timm, under mixprec.autocast and under torch.autocast.

Each model below reaches torch's autocast API from its own code (the patterns are listed in
docs/policy.md, "Model code that talks to torch.autocast"): an fp32 attention opened only when
``torch.is_autocast_enabled()`` is true, an fp32 MoE router under
``torch.autocast(enabled=False)``, gradient checkpointing that recomputes under the autocast
state it recorded, and timm's fast norms. Outputs and every gradient must equal
torch.autocast's bit for bit: the same casts reach the same kernels. Tiny random configs.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import mixprec

transformers = pytest.importorskip("transformers")


def _timm():
    # timm imports torchvision, whose wheel cannot load its ops beside a CPU-only torch build.
    try:
        import timm
    except Exception as exc:  # ImportError, or torchvision's RuntimeError about its operators
        pytest.skip(f"timm cannot be imported here: {type(exc).__name__}: {exc}")
    return timm


def _quiet():
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", module="transformers")


def _gpt2(**extra):
    _quiet()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=64,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager", **extra,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _ernie_moe():
    _quiet()
    torch.manual_seed(0)
    cfg = transformers.Ernie4_5_MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
        moe_num_experts=4, moe_k=2, moe_layer_start_index=0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.Ernie4_5_MoeForCausalLM(cfg)


def _run(model, region, ids):
    model.zero_grad(set_to_none=True)
    with region:
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def _assert_same(model, ids, policy=None):
    ref = _run(model, torch.autocast("cpu"), ids)
    got = _run(model, mixprec.autocast("cpu", policy=policy), ids)
    assert got[0].dtype == ref[0].dtype == torch.bfloat16
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[2].keys() == ref[2].keys() and got[2]
    differ = [n for n in ref[2] if not torch.equal(got[2][n], ref[2][n])]
    assert not differ, f"gradients differ from torch.autocast's: {differ}"


IDS = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))


def test_gpt2_upcast_attention_opened_by_is_autocast_enabled():
    # GPT-2's reorder_and_upcast_attn computes q @ k in fp32 inside maybe_autocast(enabled=False),
    # which only opens a region when torch.is_autocast_enabled(device) says one is active.
    _assert_same(_gpt2(reorder_and_upcast_attn=True), IDS)


def test_moe_router_in_fp32_under_nested_disable():
    # Ernie 4.5 MoE's router: F.linear on .float() inputs inside a disabled region.
    _assert_same(_ernie_moe(), IDS)


def test_flash_attention_target_dtype_helper_sees_the_region():
    from transformers.integrations import flash_attention

    q = torch.randn(1, 2, 4, 8)
    found = {}
    for name, region in (("torch", torch.autocast("cpu")), ("mixprec", mixprec.autocast("cpu"))):
        with region:
            found[name] = flash_attention.get_target_dtype(q, torch.nn.Linear(2, 2))
    assert found["mixprec"] == found["torch"] == torch.bfloat16


def test_gradient_checkpointing_recompute():
    model = _gpt2(reorder_and_upcast_attn=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _assert_same(model, IDS)


def test_gradient_checkpointing_with_an_edited_policy_and_context_fn():
    policy = mixprec.Policy().move("layer_norm", to="fp32")
    plain, ckpt = _gpt2(), _gpt2()
    ckpt.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={
            "use_reentrant": False,
            "context_fn": mixprec.checkpoint_context,
        }
    )
    ckpt.train()
    want = _run(plain, mixprec.autocast("cpu", policy=policy), IDS)
    got = _run(ckpt, mixprec.autocast("cpu", policy=policy), IDS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(got[2][n], want[2][n]) for n in want[2])


def test_timm_fast_norm_vit():
    timm = _timm()
    from timm.layers import set_fast_norm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10,
        depth=2, drop_rate=0.0,
    )  # fmt: skip
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    results = {}
    set_fast_norm(True)
    try:
        for name, region in (
            ("torch", torch.autocast("cpu")),
            ("mixprec", mixprec.autocast("cpu")),
        ):
            model.zero_grad(set_to_none=True)
            with region:
                out = model(x)
            out.float().sum().backward()
            results[name] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    finally:
        set_fast_norm(False)
    (ot, gt), (om, gm) = results["torch"], results["mixprec"]
    assert om.dtype == ot.dtype and torch.equal(om, ot)
    assert all(torch.equal(a, b) for a, b in zip(gm, gt, strict=True))
