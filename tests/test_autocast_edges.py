"""Edge cases where mixprec.autocast must decide as torch.autocast does (QA findings), each
checked against torch.autocast as the reference on the CPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import mixprec

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def _torch_region():
    return torch.autocast("cpu", dtype=BF16)


def _mixprec_region():
    return mixprec.autocast("cpu", dtype=BF16)


# --------------------------------------------------------------------------------- LSTM on CPU


def _lstm_runs():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6)
    proj = nn.LSTM(4, 6, proj_size=3)
    x = torch.randn(3, 2, 4)

    def packed():
        return lstm(pack_padded_sequence(x, [3, 2]))[0].data

    def onednn_disabled():
        with torch.backends.mkldnn.flags(enabled=False):
            return lstm(x)[0]

    def projections():
        return proj(x)[0]

    return {"packed": packed, "mkldnn disabled": onednn_disabled, "projections": projections}


@pytest.mark.parametrize("case", ["packed", "mkldnn disabled"])
def test_lstm_off_the_onednn_path_stays_fp32_as_in_torch(case):
    """torch.autocast lowers a CPU LSTM only on oneDNN's path (mkldnn_rnn_layer); packed
    sequences and a disabled oneDNN run the native cells, whose result is fp32.
    mixprec computes those in fp32 throughout (a documented deviation: torch's gate matmuls are
    bf16), so the dtype is torch's and the values are the fp32 ones."""
    run = _lstm_runs()[case]
    with _torch_region():
        ref = run()
    with _mixprec_region():
        got = run()
    full = run()
    assert got.dtype == ref.dtype == FP32
    assert torch.equal(got, full)
    torch.testing.assert_close(got, ref, atol=1e-2, rtol=0)  # torch: bf16 gate matmuls


def test_lstm_with_projections_is_low_as_in_torch():
    # oneDNN has no projections: torch's native cells end each step on a lowered matmul.
    run = _lstm_runs()["projections"]
    with _torch_region():
        ref = run()
    with _mixprec_region():
        got = run()
    assert got.dtype == ref.dtype == BF16
    torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=0)


def test_lstm_on_the_onednn_path_is_still_lowered():
    # torch's own bf16 oneDNN LSTM fails on CPUs without oneDNN bf16 support, so mixprec is
    # checked against the decision alone: this call takes torch's oneDNN path.
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 6)
    with _mixprec_region():
        assert lstm(torch.randn(3, 2, 4))[0].dtype == BF16


# ------------------------------------------------------------------- promote: the other 16-bit


def _promote_calls(t):
    index = torch.tensor([1, 0])
    return {
        "cat": lambda: torch.cat([t, t]),
        "stack": lambda: torch.stack([t, t]),
        "index_copy": lambda: t.index_copy(0, index, t),
    }


@pytest.mark.parametrize("op", ["cat", "stack", "index_copy"])
@pytest.mark.parametrize(("region_dtype", "input_dtype"), [(BF16, FP16), (FP16, BF16)])
def test_promote_leaves_inputs_all_in_the_other_16bit_dtype(op, region_dtype, input_dtype):
    """torch raises on these ("Unexpected floating ScalarType"); mixprec must not cast them to
    the region's dtype, which loses bits (fp16 1.0009765625 is 1.0 in bf16, bf16 1e30 is inf in
    fp16). The result equals the call outside any region."""
    value = 1.0009765625 if input_dtype is FP16 else 1e30
    t = torch.tensor([value, 2.0], dtype=input_dtype)
    call = _promote_calls(t)[op]
    with (
        pytest.raises(RuntimeError, match="Unexpected floating ScalarType"),
        torch.autocast("cpu", dtype=region_dtype),
    ):
        call()
    with mixprec.autocast("cpu", dtype=region_dtype):
        got = call()
    assert got.dtype == input_dtype
    assert torch.equal(got, call())


def test_promote_still_lowers_and_widens_as_torch_does():
    h, f = torch.randn(2, dtype=BF16), torch.randn(2)
    mixed = torch.randn(2, dtype=FP16)
    for args in ([h, h], [h, f]):
        with _torch_region():
            ref = torch.cat(args)
        with _mixprec_region():
            got = torch.cat(args)
        assert got.dtype == ref.dtype and torch.equal(got, ref)
    with _mixprec_region():  # torch raises; mixprec's documented fp32
        assert torch.cat([h, mixed]).dtype == FP32


# ------------------------------------------------------------- regions under unittest.mock


def test_first_region_under_a_mocked_torch_function_works():
    """A mock of a torch function made torch.overrides.get_overridable_functions() raise
    (AttributeError: __name__) while mixprec built its first table. It runs in a fresh
    interpreter: torch caches its scan once it has succeeded."""
    import subprocess
    import sys

    code = """
from unittest import mock
import torch, torch.nn.functional as F, mixprec
a = torch.randn(2, 2)
with mock.patch("torch.nn.functional.scaled_dot_product_attention") as sdpa:
    with mixprec.autocast("cpu", dtype=torch.bfloat16):
        assert torch.mm(a, a).dtype == torch.bfloat16
        F.scaled_dot_product_attention(1, 2, 3)
    assert sdpa.call_count == 1
q = torch.randn(1, 2, 4, 8)
dtypes = []
for region in (torch.autocast, mixprec.autocast):
    with region("cpu", dtype=torch.bfloat16):
        dtypes.append(F.scaled_dot_product_attention(q, q, q).dtype)
assert dtypes == [torch.bfloat16, torch.bfloat16], dtypes
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


# ------------------------------------------------- re-entrant copies see the module as it is


class _SdpaSpy:
    """Counts the calls ``nn.MultiheadAttention`` makes to F.scaled_dot_product_attention (a
    module global of F.multi_head_attention_forward) while patched in, per region."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.mha = nn.MultiheadAttention(8, 2)
        self.x = torch.randn(3, 1, 8)
        self.real = torch.nn.functional.scaled_dot_product_attention
        self.calls: list[str] = []
        self.who = ""

    def __call__(self, *args, **kwargs):
        self.calls.append(self.who)
        return self.real(*args, **kwargs)

    def patch(self):
        return mock.patch("torch.nn.functional.scaled_dot_product_attention", self)

    def run(self, *names: str) -> dict[str, int]:
        regions = {"torch": _torch_region, "mixprec": _mixprec_region}
        for name in names:
            self.who = name
            with regions[name]():
                self.mha(self.x, self.x, self.x, need_weights=False)
        return {name: self.calls.count(name) for name in names}


def test_reentrant_copies_see_a_patch_made_after_the_first_region():
    spy = _SdpaSpy()
    spy.run("mixprec")  # the re-entrant copies exist now, taken before the patch
    with spy.patch():
        assert spy.run("torch", "mixprec") == {"torch": 1, "mixprec": 1}


def test_reentrant_copies_drop_a_patch_once_it_is_undone():
    spy = _SdpaSpy()
    with spy.patch():
        assert spy.run("mixprec") == {"mixprec": 1}
    spy.calls.clear()
    assert spy.run("torch", "mixprec") == {"torch": 0, "mixprec": 0}


# ------------------------------------------------------------------------------------ errors


def test_unknown_dtype_suggests_the_close_low_dtype():
    with pytest.raises(mixprec.PolicyError, match=r"Did you mean 'bf16'.*computes in 'bf16'"):
        mixprec.autocast("cpu", dtype="bf32")


def test_numpy_bool_is_refused_as_torch_refuses_it_with_a_message_that_names_it():
    np = pytest.importorskip("numpy")
    with pytest.raises(TypeError, match="must be bool"), torch.autocast("cpu", enabled=np.True_):
        pass
    with pytest.raises(TypeError, match=r"got numpy\.bool np\.True_\. Pass bool\(enabled\)"):
        mixprec.autocast("cpu", enabled=np.True_)
    with pytest.raises(TypeError, match=r"got numpy\.bool np\.False_"):
        mixprec.autocast("cpu", cache_enabled=np.False_)
