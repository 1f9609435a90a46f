"""Every input error of ``attention_fwd`` / ``attention``: the exception type, a message that
names the offending argument, and no device copy or kernel launch before the error."""
import math

import numpy as np
import pytest

import numba_flash  # before numba: it decides whether the simulator is needed
import numba_flash.api
from numba import cuda
from conftest import check_forward, make_qkv

FUNCS = [numba_flash.attention_fwd, numba_flash.attention]


to_device = cuda.to_device   # the tests' own copies; numba_flash's are forbidden below


@pytest.fixture(autouse=True)
def no_device_work(monkeypatch):
    """Errors must come from input checking: allocating or copying device memory, or
    launching a kernel, fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("attention_fwd allocated device memory or launched a kernel before the error")
    monkeypatch.setattr(numba_flash.api, "launch", forbidden)
    for name in ("to_device", "device_array", "device_array_like"):
        monkeypatch.setattr(cuda, name, forbidden)


@pytest.fixture
def qkv():
    return make_qkv(0, (2,), 3, 5, 4, np.float32)


def _with(qkv, i, x):
    args = list(qkv)
    args[i] = x
    return args


NAMES = ("q", "k", "v")


# --------------------------------------------------------------------------- array kinds
@pytest.mark.parametrize("fn", FUNCS, ids=["attention_fwd", "attention"])
@pytest.mark.parametrize("i", range(3), ids=NAMES)
@pytest.mark.parametrize("bad", [[[1.0, 2.0]], None, 3.0, "q"], ids=["list", "None", "float", "str"])
def test_non_array_input(qkv, fn, i, bad):
    with pytest.raises(TypeError, match=rf"^{NAMES[i]} must be a NumPy array or a CUDA device array"):
        fn(*_with(qkv, i, bad))


@pytest.mark.parametrize("i", range(3), ids=NAMES)
def test_mixed_numpy_and_device(qkv, i):
    args = _with(qkv, i, to_device(qkv[i]))
    with pytest.raises(TypeError, match=rf"{NAMES[i]} is a device array") as err:
        numba_flash.attention_fwd(*args)
    other = NAMES[(i + 1) % 3]
    assert f"{other} is a NumPy array" in str(err.value)


def test_mixed_device_and_numpy(qkv):
    """The reverse: two device arrays and one NumPy array."""
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"v is a NumPy array"):
        numba_flash.attention_fwd(to_device(q), to_device(k), v)


# --------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("i", range(3), ids=NAMES)
def test_mixed_dtypes(qkv, i):
    args = _with(qkv, i, qkv[i].astype(np.float64))
    with pytest.raises(TypeError, match=rf"same dtype.*{NAMES[i]}\.dtype=float64"):
        numba_flash.attention_fwd(*args)


@pytest.mark.parametrize("i", range(3), ids=NAMES)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128, object])
def test_unsupported_dtype(qkv, i, dtype):
    args = [x.astype(dtype) for x in qkv]          # all the same dtype: the dtype itself is wrong
    with pytest.raises(TypeError, match=r"q has dtype .*expected float32, float64, float16 or bfloat16"):
        numba_flash.attention_fwd(*args)
    args = _with(qkv, i, qkv[i].astype(dtype))     # only one wrong: that one is named
    with pytest.raises(TypeError, match=rf"{NAMES[i]} has dtype .*expected float32, float64, float16 or bfloat16"):
        numba_flash.attention_fwd(*args)


@pytest.mark.parametrize("case", ["int", "mixed", "list", "nk", "d", "d0", "out", "dout"])
def test_message_names_the_fix(qkv, case):
    """Each message says how to fix the input, not only what is wrong with it."""
    q, k, v = qkv
    fwd = numba_flash.attention_fwd
    lse = np.zeros(q.shape[:-1], np.float32)
    call, fix = {
        "int": (lambda: fwd(q.astype(np.int64), k, v), "q.astype(np.float32)"),
        "mixed": (lambda: fwd(q, k.astype(np.float64), v), "k.astype(q.dtype)"),
        "list": (lambda: fwd(q.tolist(), k, v), "np.asarray(q, dtype=np.float32)"),
        "nk": (lambda: fwd(q, k, v[..., :1, :]), "pass the k and v of the same sequence"),
        "d": (lambda: fwd(q, k, v[..., :3]), "zero-padded along d"),
        "d0": (lambda: fwd(q[..., :0], k[..., :0], v[..., :0]), "the head dim last"),
        "out": (lambda: numba_flash.attention_bwd(q, q, k, v, q[:1], lse), "the out that attention_fwd returned"),
        "dout": (lambda: numba_flash.attention_bwd(q[:1], q, k, v, q, lse), "gradient of the loss"),
    }[case]
    with pytest.raises((TypeError, ValueError)) as err:
        call()
    assert fix in " ".join(str(err.value).split())


def test_unsupported_dtype_on_device(qkv):
    args = [to_device(x.astype(np.int32)) for x in qkv]
    with pytest.raises(TypeError, match=r"q has dtype int32"):
        numba_flash.attention_fwd(*args)


def _low_precision_dtypes():
    import ml_dtypes
    return [pytest.param(np.dtype(np.float16), id="float16"), pytest.param(np.dtype(ml_dtypes.bfloat16), id="bfloat16")]


@pytest.mark.parametrize("i", range(3), ids=NAMES)
@pytest.mark.parametrize("dtype", _low_precision_dtypes())
def test_low_precision_mixed_with_float32(qkv, i, dtype):
    """One 16-bit input among float32 ones: no silent cast, a TypeError naming the dtypes."""
    args = _with(qkv, i, qkv[i].astype(dtype))
    with pytest.raises(TypeError, match=rf"must have the same dtype.*{NAMES[i]}.dtype={dtype.name}"):
        numba_flash.attention(*args)


@pytest.mark.parametrize("dtype", _low_precision_dtypes())
def test_low_precision_backward_checks_dtypes(qkv, dtype):
    """16-bit backward: dout in q's dtype, lse float32 (as attention_fwd returns it)."""
    q, k, v = (x.astype(dtype) for x in qkv)
    lse = np.zeros(q.shape[:-1], np.float32)
    with pytest.raises(TypeError, match=rf"must have the same dtype.*dout.dtype=float32"):
        numba_flash.attention_bwd(q.astype(np.float32), q, k, v, q, lse)
    with pytest.raises(TypeError, match=rf"lse must have dtype float32 for {dtype.name} inputs.*got float64"):
        numba_flash.attention_bwd(q, q, k, v, q, lse.astype(np.float64))


def test_backward_lse_dtype_matches(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"lse must have dtype float32 for float32 inputs.*got float64"):
        numba_flash.attention_bwd(q, q, k, v, q, np.zeros(q.shape[:-1], np.float64))


# --------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("i", range(3), ids=NAMES)
@pytest.mark.parametrize("shape", [(4,), ()], ids=["1d", "0d"])
def test_ndim_below_two(qkv, i, shape):
    with pytest.raises(ValueError, match=rf"{NAMES[i]} must have at least 2 dims"):
        numba_flash.attention_fwd(*_with(qkv, i, np.ones(shape, np.float32)))


@pytest.mark.parametrize("i", range(3), ids=NAMES)
@pytest.mark.parametrize("lead", [(3,), (1, 2), ()], ids=["size", "extra-dim", "missing-dim"])
def test_mismatched_leading_dims(qkv, i, lead):
    x = qkv[i]
    bad = np.ones(lead + x.shape[-2:], np.float32)
    with pytest.raises(ValueError, match=r"k and v must have identical leading dims") as err:
        numba_flash.attention_fwd(*_with(qkv, i, bad))
    assert f"{NAMES[i]} {bad.shape}" in str(err.value)


@pytest.mark.parametrize("i", range(3), ids=NAMES)
def test_mismatched_head_dims(qkv, i):
    x = qkv[i]
    bad = np.ones(x.shape[:-1] + (x.shape[-1] + 1,), np.float32)
    with pytest.raises(ValueError, match=r"share the head dim d") as err:
        numba_flash.attention_fwd(*_with(qkv, i, bad))
    assert f"{NAMES[i]} {bad.shape}" in str(err.value)


@pytest.mark.parametrize("i", [1, 2], ids=["k", "v"])
def test_key_value_length_mismatch(qkv, i):
    x = qkv[i]
    bad = np.ones(x.shape[:-2] + (x.shape[-2] + 1, x.shape[-1]), np.float32)
    with pytest.raises(ValueError, match=r"k and v must have the same length Nk") as err:
        numba_flash.attention_fwd(*_with(qkv, i, bad))
    assert f"{NAMES[i]} {bad.shape}" in str(err.value)


def test_zero_head_dim():
    q, k, v = (np.ones((2, n, 0), np.float32) for n in (3, 5, 5))
    with pytest.raises(ValueError, match=r"head dim d must be at least 1, got q \(2, 3, 0\)"):
        numba_flash.attention_fwd(q, k, v)


def test_sequence_too_long(qkv):
    """Nq >= 2**31 (a zero-stride view, so nothing is allocated)."""
    huge = np.broadcast_to(np.ones((1, 4), np.float32), (2**31, 4))
    _, k, v = (x[0] for x in qkv)
    with pytest.raises(ValueError, match=r"sequence lengths must be below 2\*\*31, got Nq=2147483648"):
        numba_flash.attention_fwd(huge, k, v)


# --------------------------------------------------------------------------- scale, causal
@pytest.mark.parametrize("fn", FUNCS, ids=["attention_fwd", "attention"])
@pytest.mark.parametrize("scale", [0, 0.0, -0.5, -1, math.nan, math.inf, -math.inf, np.float32(np.nan)],
                         ids=["0", "0.0", "-0.5", "-1", "nan", "inf", "-inf", "f32-nan"])
def test_scale_not_finite_positive(qkv, fn, scale):
    with pytest.raises(ValueError, match=r"^scale must be finite and positive"):
        fn(*qkv, scale=scale)


@pytest.mark.parametrize("fn", FUNCS, ids=["attention_fwd", "attention"])
@pytest.mark.parametrize("scale", ["0.5", True, False, np.bool_(True), 1j, [0.5], np.ones(1)],
                         ids=["str", "True", "False", "np-bool", "complex", "list", "array"])
def test_scale_wrong_type(qkv, fn, scale):
    with pytest.raises(TypeError, match=r"^scale must be a real number or None"):
        fn(*qkv, scale=scale)


@pytest.mark.parametrize("fn", FUNCS, ids=["attention_fwd", "attention"])
@pytest.mark.parametrize("causal", [1, 0, "yes", None, np.int64(1), 1.0],
                         ids=["1", "0", "str", "None", "np-int", "float"])
def test_causal_not_bool(qkv, fn, causal):
    with pytest.raises(TypeError, match=r"^causal must be True or False"):
        fn(*qkv, causal=causal)


def test_causal_checked_before_arrays():
    """A bad ``causal`` is reported even when the arrays are bad too (checked first)."""
    with pytest.raises(TypeError, match=r"^causal must be True or False"):
        numba_flash.attention_fwd(None, None, None, causal="no")


# --------------------------------------------------------------------------- accepted values
@pytest.mark.parametrize("scale,causal", [(1, False), (np.float32(0.5), np.bool_(True)),
                                          (np.float64(0.25), True), (2**-3, np.bool_(False))],
                         ids=["int", "np-float32/np-bool", "np-float64", "float/np-bool-false"])
def test_accepted_scale_and_causal_types(qkv, scale, causal, monkeypatch):
    monkeypatch.undo()   # this one really runs the kernel
    out, lse = numba_flash.attention_fwd(*qkv, scale=scale, causal=causal)
    check_forward(out, lse, *qkv, bool(causal), float(scale))
