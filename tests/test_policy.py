"""The op policy as data: tables against torch's dispatcher, entry points, the frozen Policy,
its string form, edits, decisions with reasons, and every error a user can cause."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import mixprec
from mixprec import OpCategory, Policy
from mixprec.policy import TABLES, entry_points, op_name
from mixprec.policy.decompositions import COMPOSITES

# ------------------------------------------------------------------- tables vs torch's dispatcher


@pytest.mark.parametrize(
    "table,key", [("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU"), ("xpu", "AutocastXPU"),
                  ("mps", "AutocastMPS")],
)  # fmt: skip
def test_every_op_torch_autocasts_is_in_our_table(table, key):
    """torch registers an autocast kernel per op and device; each must be in our table."""
    registered = {
        n.split("::")[1].split(".")[0]
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    }
    assert len(registered) > 40
    missing = registered - set(TABLES[table].ops)
    assert not missing, f"torch autocasts these on {table} but our table lacks them: {missing}"


@pytest.mark.parametrize(
    "table,key", [("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU"), ("xpu", "AutocastXPU"),
                  ("mps", "AutocastMPS")],
)  # fmt: skip
def test_our_table_lists_no_op_this_torch_leaves_alone(table, key):
    """The reverse: an op we list as torch's (not a composite) has torch's autocast kernel in
    the running release. rms_norm's entry comes and goes with the release (2.11 has none)."""
    overloads: dict[str, list[str]] = {}
    for n in torch._C._dispatch_get_all_op_names():
        if n.startswith("aten::"):
            overloads.setdefault(n.split("::")[1].split(".")[0], []).append(n)
    t = TABLES[table]
    extra = {
        op for op in t.ops
        if op in overloads and "composite" not in t.sources[op]
        and not any(torch._C._dispatch_has_kernel_for_dispatch_key(n, key) for n in overloads[op])
    }  # fmt: skip
    if table == "cuda" and torch.version.cuda is None:
        extra.discard("_cudnn_rnn")  # registered by a CUDA-only source file
    assert not extra, f"our {table} table lists ops this torch's autocast leaves alone: {extra}"
    from mixprec.policy.tables import RELEASE_DEPENDENT, _autocasts

    for op in RELEASE_DEPENDENT:
        assert (op in t.ops) == _autocasts(op, table), op


def test_tables_name_real_ops():
    """Every table entry is an op this torch knows (a typo would silently never match)."""
    known = set(mixprec.policy.known_op_names()) | {
        n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names()
    }
    from mixprec.policy.tables import VERSIONED

    for table in TABLES.values():
        unknown = set(table.ops) - known - set(VERSIONED)
        assert not unknown, f"{table.name}: {unknown}"
    assert set(COMPOSITES) - known == set()


def test_same_table_for_fp16_and_bf16_by_default():
    p = Policy()
    fp16 = p.resolve("cuda", torch.float16).ops
    bf16 = p.resolve("cuda", torch.bfloat16).ops
    assert fp16 == bf16


# -------------------------------------------------------------------------------- entry points


def test_one_name_covers_every_entry_point():
    assert torch.mm in entry_points("mm") and torch.Tensor.mm in entry_points("mm")
    assert torch.Tensor.__matmul__ in entry_points("matmul")
    assert F.linear in entry_points("linear") and torch._C._nn.linear is F.linear
    assert torch.linalg.vector_norm in entry_points("linalg_vector_norm")
    assert op_name(torch.ops.aten.mm) == "mm" and op_name(torch.ops.aten.mm.default) == "mm"
    assert op_name(F.softmax) is None  # a Python wrapper: its body is entered instead


def test_every_entry_point_gets_the_rule():
    a, b = torch.randn(3, 3), torch.randn(3, 3)
    with mixprec.autocast("cpu"):
        outs = [torch.mm(a, b), a.mm(b), a @ b, torch.matmul(a, b), b.__rmatmul__(a),
                F.linear(a, b), torch._C._nn.linear(a, b), torch.ops.aten.mm(a, b),
                torch.ops.aten.mm.default(a, b)]  # fmt: skip
    assert all(o.dtype == torch.bfloat16 for o in outs)


# --------------------------------------------------------------------------------- value object


def test_policy_is_frozen_and_edits_return_new_objects():
    p = Policy()
    q = p.move("softmax", to="fp32")
    assert p.overrides == () and len(q.overrides) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.compute = torch.float16  # type: ignore[misc]
    assert Policy(compute="bf16") == Policy(compute=torch.bfloat16)
    assert hash(Policy(compute="bf16")) == hash(Policy(compute=torch.bfloat16))


def test_later_edit_wins_and_scopes_apply_only_where_named():
    p = (
        Policy()
        .move("softmax", to="fp32")
        .move("softmax", to="lower")
        .move("gelu", to="fp32", device_type="cuda", dtype="fp16")
    )
    assert p.decide("softmax", device_type="cpu").category is OpCategory.LOWER
    assert p.decide("gelu", device_type="cuda", dtype="fp16").category is OpCategory.FP32
    assert p.decide("gelu", device_type="cuda", dtype="bf16").category is OpCategory.PASSTHROUGH
    assert p.decide("gelu", device_type="cpu").category is OpCategory.PASSTHROUGH


def test_passthrough_removes_an_op_from_a_list():
    p = Policy().move("mm", to="passthrough")
    with mixprec.autocast("cpu", policy=p):
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
        assert torch.bmm(torch.randn(1, 2, 2), torch.randn(1, 2, 2)).dtype == torch.bfloat16


def test_moving_an_inner_op_moves_its_composites():
    # tensordot on CPU is lowered because its C++ body calls mm; moving mm moves it too.
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with mixprec.autocast("cpu"):
        assert torch.tensordot(a, b, 1).dtype == torch.bfloat16
    with mixprec.autocast("cpu", policy=Policy().move("mm", to="fp32")):
        assert torch.tensordot(a, b, 1).dtype == torch.float32


def test_edits_take_bindings_and_torch_ops():
    p = Policy().move(torch.exp, F.gelu, torch.ops.aten.tanh, to="fp32")
    assert [o.target for o in p.overrides] == ["exp", "gelu", "tanh"]
    x = torch.randn(4, dtype=torch.bfloat16)
    with mixprec.autocast("cpu", policy=p):
        assert F.gelu(x).dtype == torch.float32 and torch.tanh(x).dtype == torch.float32


def test_decisions_carry_reasons():
    p = Policy().move("gelu", to="fp32")
    assert "torch.autocast's CUDA lower list" in p.decide("mm", device_type="cuda").reason
    assert "composite" in p.decide("tensordot", device_type="cpu").reason
    assert "moved to fp32 by Policy.move" in p.decide("gelu", device_type="cpu").reason
    assert "no list" in p.decide("relu", device_type="cpu").reason
    assert "Python-level torch function" in p.decide(F.softmax, device_type="cpu").reason
    d = p.decide("mm", device_type="cuda", dtype="bf16")
    assert d.dtype is torch.bfloat16 and str(d).startswith("mm: lower -> bfloat16")


# --------------------------------------------------------------------------------- string form

_OPS = ["softmax", "layer_norm", "mm", "gelu", "exp", "cat", "mylib::attn"]
_edit = st.tuples(
    # FP32_OUTPUT takes op names only; FP8 is for layers (Policy.fp8), not ops.
    st.sampled_from(
        [c.value for c in OpCategory if c not in (OpCategory.FP32_OUTPUT, OpCategory.FP8)]
    ),
    st.lists(st.sampled_from(_OPS), min_size=1, max_size=3),
    st.sampled_from([None, "cuda", "cpu"]),
    st.sampled_from([None, "bf16", "fp16"]),
)


@settings(max_examples=200, deadline=None)
@given(
    compute=st.sampled_from([None, "bf16", "fp16"]),
    table=st.sampled_from([None, "cuda", "cpu", "mps"]),
    edits=st.lists(_edit, max_size=5),
)
def test_string_form_round_trips(compute, table, edits):
    p = Policy(compute=compute, table=table)
    for cat, ops, dev, dt in edits:
        p = p.move(*ops, to=cat, device_type=dev, dtype=dt)
    text = str(p)
    assert Policy.from_string(text) == p
    assert repr(p) == f"Policy({text!r})"


def test_string_examples():
    p = Policy.from_string(
        "compute=bf16, table=cuda, fp32=softmax+layer_norm, lower@cuda/fp16=gelu"
    )
    assert p.compute is torch.bfloat16 and p.table == "cuda"
    assert str(p) == "compute=bf16,table=cuda,fp32=softmax+layer_norm,lower@cuda/fp16=gelu"
    assert str(Policy()) == "compute=auto" and Policy.from_string("") == Policy()
    assert Policy.from_string("compute=auto,table=auto") == Policy()


def test_dotted_path_targets_round_trip():
    p = Policy.from_string("fp32=tests.helpers.scaled_dot")
    from tests.helpers import scaled_dot

    assert p.overrides[0].target is scaled_dot
    assert Policy.from_string(str(p)) == p


def test_pickle_keeps_value_not_serial():
    p = Policy(compute="fp16").move("softmax", to="fp32")
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.serial != p.serial
    assert Policy.by_serial(q.serial) is q


# -------------------------------------------------------------------------------------- errors


def test_error_unknown_op_suggests():
    with pytest.raises(mixprec.PolicyError, match="unknown op name 'sofmax'.*Did you mean"):
        Policy().move("sofmax", to="fp32")
    # Spelled with aten's namespace it was taken, and did nothing.
    with pytest.raises(mixprec.PolicyError, match="unknown op name 'sofmax'.*Did you mean"):
        Policy.from_string("lower=aten::sofmax")
    assert str(Policy.from_string("lower=aten::softmax")) == "lower=softmax"


def test_error_unknown_category_lists_options():
    with pytest.raises(mixprec.PolicyError, match="Valid op categories: 'banned', 'fp32'"):
        Policy().move("softmax", to="fp64")


def test_category_aliases():
    assert OpCategory.parse("half") is OpCategory.LOWER
    assert OpCategory.parse("float") is OpCategory.FP32


@pytest.mark.parametrize(
    "make",
    [
        lambda: Policy.from_string("compute=fp8"),
        lambda: Policy(compute="float8_e4m3fn"),
        lambda: mixprec.autocast("cpu", dtype=torch.float8_e5m2),
    ],
    ids=["string", "name", "torch.dtype"],
)
def test_fp8_as_compute_dtype_points_to_the_fp8_rule(make):
    from mixprec.fp8.recipe import RECIPES

    with pytest.raises(mixprec.PolicyError, match="is not a compute dtype: FP8 is chosen per") as e:
        make()
    message = str(e.value)
    assert "unknown dtype" not in message
    assert "'compute=bf16,fp8=auto'" in message and "fp8='tensorwise'" in message
    for recipe in RECIPES:  # the recipes named are the ones that exist
        assert repr(recipe) in message
    # and the rule it gives is one the policy takes
    assert str(Policy.from_string("compute=bf16,fp8=auto")) == "compute=bf16,fp8=auto"


def test_error_unknown_table():
    with pytest.raises(mixprec.PolicyError, match="unknown op table 'tpu'.*'cuda'"):
        Policy(table="tpu")


def test_error_bad_string_items():
    with pytest.raises(mixprec.PolicyError, match="not of the form key=value"):
        Policy.from_string("fp32")
    with pytest.raises(mixprec.PolicyError, match="unknown policy key 'fast'"):
        Policy.from_string("fast=mm")
    with pytest.raises(mixprec.PolicyError, match="cannot import 'nope.nothing'"):
        Policy.from_string("fp32=nope.nothing")
    with pytest.raises(mixprec.PolicyError, match="expects a string"):
        Policy.from_string(3)  # type: ignore[arg-type]


def test_error_plain_python_function_names_the_fix():
    def helper(x):
        return x

    with pytest.raises(mixprec.PolicyError, match=r"plain Python.*@mixprec\.half_function"):
        Policy().move(helper, to="fp32")


def test_error_fp32_output_on_a_function():
    fn = mixprec.float_function(lambda x: x)
    with pytest.raises(mixprec.PolicyError, match="Use to='fp32'"):
        Policy().move(fn, to="fp32_output")


def test_error_move_nothing_and_bad_target():
    with pytest.raises(mixprec.PolicyError, match="at least one op"):
        Policy().move(to="fp32")
    with pytest.raises(mixprec.PolicyError, match="cannot use 3"):
        Policy().move(3, to="fp32")  # type: ignore[arg-type]


def test_error_non_16_bit_compute():
    with pytest.raises(mixprec.PolicyError, match="16-bit"):
        Policy(compute="fp32")


def test_compat_constant_marker_matches_torch():
    from mixprec._compat import _DYNAMO_CONSTANT_ATTR, mark_constant_result

    def f():
        return 1

    def g():
        return 1

    torch.compiler.assume_constant_result(f)
    mark_constant_result(g)
    assert getattr(f, _DYNAMO_CONSTANT_ATTR) is True and getattr(g, _DYNAMO_CONSTANT_ATTR) is True


# ------------------------------------------------------------ slips in the string form


def test_string_form_misspelled_key_suggests_the_key():
    with pytest.raises(mixprec.PolicyError) as err:
        Policy.from_string("compte=bf16")
    assert str(err.value).startswith(
        "unknown policy key 'compte'. Did you mean 'compute' or 'promote'? Valid policy keys: "
        "'banned', 'compute', 'fp32', 'fp32_modules', 'fp32_output', 'fp8', 'lower', "
        "'passthrough', 'promote' or 'table'. In 'compte=bf16', the part before '=' is "
        "'compute', 'table', 'fp32_modules' or an op category"
    )
    with pytest.raises(mixprec.PolicyError, match="Did you mean 'table'\\?"):
        Policy.from_string("tabel=cuda")
    with pytest.raises(mixprec.PolicyError, match="Did you mean 'fp32'\\?"):
        Policy.from_string("fp23=softmax")


def test_string_form_wrong_separators_name_the_right_one():
    with pytest.raises(mixprec.PolicyError, match="separate items with ','"):
        Policy.from_string("compute=bf16;fp32=softmax")
    with pytest.raises(mixprec.PolicyError, match="join several ops with '\\+'"):
        Policy.from_string("fp32=softmax layer_norm")


def test_overrides_must_be_edits():
    with pytest.raises(mixprec.PolicyError, match=r"takes Override objects, got str 'softmax'"):
        Policy(overrides=["softmax"])  # type: ignore[list-item]


def test_device_type_aliases_are_answered_with_the_device():
    with pytest.raises(mixprec.PolicyError) as err:
        mixprec.autocast("gpu")
    assert str(err.value).startswith("unknown device type 'gpu'. Did you mean 'cuda'? Valid")


def test_non_16_bit_compute_message_names_both_fixes():
    with pytest.raises(mixprec.PolicyError) as err:
        Policy(compute="fp32")
    assert str(err.value) == (
        "the compute dtype must be 16-bit, got 'fp32'. Valid compute dtypes: 'bf16' or 'fp16'. "
        "To keep work in fp32, disable the region (autocast(..., enabled=False)) or move ops in "
        "the policy (Policy().move('softmax', to='fp32'))."
    )
