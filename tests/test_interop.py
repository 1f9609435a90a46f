"""Array kinds and layouts: NumPy and device arrays in and out, any strides, CuPy and PyTorch."""
import numpy as np
import pytest

import numba_flash  # before numba: it decides whether the simulator is needed
from numba import cuda
from numba_flash import registry
from conftest import ON_GPU, bits, check_forward, host, np_dtype

B, H, N, NK, D = 2, 3, 11, 13, 8     # crosses the simulator's key tile (BN = 8); one query tile


def _rng(seed):
    return np.random.default_rng(seed)


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def device_view(view, base):
    """A device array with the layout of ``view`` (a NumPy view of the C-contiguous ``base``),
    over a device copy of ``base``; returns (device view, device base)."""
    assert base.flags.c_contiguous
    dbase = cuda.to_device(base)
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    assert offset >= 0 and all(s >= 0 for s in view.strides)
    if numba_flash.SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.ndarray(view.shape, view.dtype, buffer=dbase._ary, offset=offset,
                                        strides=view.strides)), dbase
    ptr = dbase.__cuda_array_interface__["data"][0] + offset
    desc = {"shape": tuple(view.shape), "strides": tuple(view.strides), "typestr": view.dtype.str,
            "data": (ptr, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=dbase), dbase


# Layouts of an array of logical shape (B, H, n, D): (base shape, view of the base).
LAYOUTS = {
    "contiguous": (lambda n: (B, H, n, D), lambda b: b),
    # (B, N, H, d) stored, (B, H, N, d) seen: the usual "heads after sequence" layout.
    "transposed": (lambda n: (B, n, H, D), lambda b: b.transpose(0, 2, 1, 3)),
    "fortran": (lambda n: (D, n, H, B), lambda b: b.T),
    "rows-step-2": (lambda n: (B, H, 2 * n, D), lambda b: b[:, :, ::2]),
    "cols-step-2": (lambda n: (B, H, n, 2 * D), lambda b: b[..., ::2]),
    # Rows start 4 bytes past a 16-byte boundary: the plain-load path, not cp.async.
    "misaligned": (lambda n: (B, H, n, D + 1), lambda b: b[..., 1:]),
    # One K/V head shared by every query head (multi-query attention): stride 0.
    "broadcast": (lambda n: (B, 1, n, D), lambda b: np.broadcast_to(b, (B, H) + b.shape[2:])),
}
ALIGNED = {"contiguous", "transposed", "rows-step-2", "broadcast"}   # cp.async possible on the device


def _make(layout, n, seed, on_device):
    base_shape, view = LAYOUTS[layout]
    base = _normal(_rng(seed), base_shape(n))
    host_view = view(base)
    assert host_view.shape == (B, H, n, D)
    if not on_device:
        return host_view, host_view, None
    dev, dbase = device_view(host_view, base)
    return dev, host_view, (dbase, base)


@pytest.fixture
def used_specs(monkeypatch):
    """Records the specialisations the API picks."""
    seen = []
    real = registry.forward_specialisation

    def spy(*args, **kwargs):
        spec = real(*args, **kwargs)
        seen.append(spec)
        return spec
    monkeypatch.setattr(registry, "forward_specialisation", spy)
    return seen


# --------------------------------------------------------------------------- kinds in, kinds out
def test_numpy_in_numpy_out():
    rng = _rng(0)
    q, k, v = _normal(rng, (2, 5, 4)), _normal(rng, (2, 6, 4)), _normal(rng, (2, 6, 4))
    out, lse = numba_flash.attention_fwd(q, k, v)
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    assert isinstance(numba_flash.attention(q, k, v), np.ndarray)
    check_forward(out, lse, q, k, v, False, None)


def test_device_in_device_out():
    rng = _rng(1)
    q, k, v = _normal(rng, (2, 5, 4)), _normal(rng, (2, 6, 4)), _normal(rng, (2, 6, 4))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out, lse = numba_flash.attention_fwd(dq, dk, dv, causal=True)
    for x in (out, lse, numba_flash.attention(dq, dk, dv, causal=True)):
        assert not isinstance(x, np.ndarray)
        assert hasattr(x, "copy_to_host") and getattr(x, "__cuda_ndarray__", False)
    assert out.shape == (2, 5, 4) and lse.shape == (2, 5)
    check_forward(host(out), host(lse), q, k, v, True, None)


# --------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout(layout, on_device, used_specs):
    """q, k and v all in one non-contiguous layout."""
    (q, qh, qb), (k, kh, kb), (v, vh, vb) = (
        _make(layout, n, seed, on_device) for n, seed in ((N, 10), (NK, 11), (NK, 12)))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    if on_device:
        out, lse = host(out), host(lse)
        for dbase, base in (qb, kb, vb):          # inputs are read in place, never written
            assert bits(dbase.copy_to_host()) == bits(base)
        assert used_specs[-1].use_async == (layout in ALIGNED and registry.async_possible("float32", D))
    else:
        assert used_specs[-1].use_async == registry.async_possible("float32", D)   # copied contiguously
    check_forward(out, lse, qh, kh, vh, True, None)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_mixed_layouts(on_device):
    """Each of q, k, v in a different layout: the leading dims fold differently for each."""
    (q, qh, _), (k, kh, _), (v, vh, _) = (
        _make(layout, n, seed, on_device)
        for layout, n, seed in (("transposed", N, 20), ("contiguous", NK, 21), ("fortran", NK, 22)))
    out, lse = numba_flash.attention_fwd(q, k, v)
    if on_device:
        out, lse = host(out), host(lse)
    check_forward(out, lse, qh, kh, vh, False, None)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_broadcast_keys_transposed_queries(on_device):
    """Grouped layouts together: transposed q, stride-0 k and v (shared across heads)."""
    (q, qh, _), (k, kh, _), (v, vh, _) = (
        _make(layout, n, seed, on_device)
        for layout, n, seed in (("transposed", N, 30), ("broadcast", NK, 31), ("broadcast", NK, 32)))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True, scale=0.7)
    if on_device:
        out, lse = host(out), host(lse)
    check_forward(out, lse, qh, kh, vh, True, 0.7)


@pytest.mark.parametrize("on_device", [False, True], ids=["numpy", "device"])
def test_three_unmergeable_leading_dims(on_device):
    """Leading dims (A, Bb, C) whose strides are not monotonic: no two of them merge, so
    they cannot be folded into the kernel's two batch dims."""
    A, Bb, C, n, d = 2, 2, 3, 6, 4
    rng = _rng(40)
    arrays = []
    for seed_n in (n, n + 1, n + 1):
        base = _normal(rng, (C, A, seed_n, Bb, d))           # stored (C, A, N, Bb, d)
        view = base.transpose(1, 3, 0, 2, 4)                 # seen (A, Bb, C, N, d)
        assert view.strides[0] < view.strides[2] and view.strides[1] < view.strides[0]
        arrays.append(device_view(view, base)[0] if on_device else view)
        arrays.append(view)
    q, qh, k, kh, v, vh = arrays
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    if on_device:
        out, lse = host(out), host(lse)
    assert out.shape == (A, Bb, C, n, d)
    check_forward(out, lse, qh, kh, vh, True, None)


def test_numpy_negative_strides():
    """Reversed views (negative strides) are fine on the NumPy path (copied contiguously)."""
    rng = _rng(50)
    q, k, v = (_normal(rng, (2, n, 5))[:, ::-1, ::-1] for n in (7, 9, 9))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    check_forward(out, lse, q, k, v, True, None)


# --------------------------------------------------------------------------- CuPy, PyTorch
GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="CuPy and PyTorch CUDA arrays need a GPU")
NT, DT = (300, 64) if ON_GPU else (N, D)


@GPU_ONLY
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_torch_inputs(layout):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    g = torch.Generator(device="cuda").manual_seed(60)

    def make(n):
        if layout == "contiguous":
            return torch.randn(2, 3, n, DT, device="cuda", generator=g)
        return torch.randn(2, n, 3, DT, device="cuda", generator=g).transpose(1, 2)
    q, k, v = make(NT), make(NT + 17), make(NT + 17)
    assert q.is_contiguous() == (layout == "contiguous")
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    assert all(isinstance(x, torch.Tensor) and x.device == q.device for x in (out, lse))   # q's kind out
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    torch.cuda.synchronize()
    check_forward(host(out), host(lse), q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), True, None)


@GPU_ONLY
def test_torch_inputs_on_side_stream():
    """Inputs produced on a non-default PyTorch stream: the kernel must run after them.

    The side stream first spins for a while (``torch.cuda._sleep``), so q, k and v are
    written well after ``attention_fwd`` returns; a kernel not ordered after that stream
    reads memory that does not hold them yet."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    g = torch.Generator(device="cuda").manual_seed(61)
    shape = (2, 3, NT, DT)
    warm = [torch.randn(shape, device="cuda", generator=g) for _ in range(3)]
    numba_flash.attention_fwd(*warm)                 # compile first: the race below must be tight
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)             # about half a second of GPU time on s
        q, k, v = (torch.randn(shape, device="cuda", generator=g) for _ in range(3))
        out, lse = numba_flash.attention_fwd(q, k, v)
    torch.cuda.synchronize()
    check_forward(host(out), host(lse), q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), False, None)


@GPU_ONLY
def test_jax_in_jax_out():
    """JAX arrays in, JAX arrays out (DLPack), values as the oracle's."""
    jnp = pytest.importorskip("jax.numpy")
    rng = _rng(63)
    q, k, v = (_normal(rng, (2, 3, n, DT)) for n in (NT, NT + 17, NT + 17))
    out, lse = numba_flash.attention_fwd(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
    assert "jax" in type(out).__module__ and "jax" in type(lse).__module__, type(out)
    check_forward(np.asarray(out), np.asarray(lse), q, k, v, True, None)


@GPU_ONLY
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_cupy_inputs(layout):
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(62)

    def make(n):
        if layout == "contiguous":
            return rng.standard_normal((2, 3, n, DT), dtype=cp.float32)
        return rng.standard_normal((2, n, 3, DT), dtype=cp.float32).transpose(0, 2, 1, 3)
    q, k, v = make(NT), make(NT + 17), make(NT + 17)
    assert q.flags.c_contiguous == (layout == "contiguous")
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    assert isinstance(out, cp.ndarray) and isinstance(lse, cp.ndarray)                      # q's kind out
    cp.cuda.runtime.deviceSynchronize()
    check_forward(host(out), host(lse), cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), True, None)


@pytest.mark.parametrize("hopper", ["0", "1"])
@pytest.mark.parametrize("dtype,group,nq", [("bfloat16", 1, 20), ("bfloat16", 2, 20), ("bfloat16", 2, 3),
                                            ("float32", 2, 20), ("float32", 1, 3)])
def test_one_leading_index_launches_the_same_types(hopper, dtype, group, nq, monkeypatch):
    """A call whose leading dims are all 1 (batch 1, one head or one K/V head's group)
    launches each kernel with the argument types of a larger call: the views that fold or
    pad the leading dims give an axis of one index a non-zero stride, which Numba would
    type as layout A (a second compile of every kernel, and ``numba_flash.warmup``'s small
    arrays compiled kernels that larger calls did not use). Forward and backward, every
    family (the Hopper one forced on, or off), grouped heads, decoding rows; planned only."""
    from numba import typeof
    from numba_flash import _kernel_cache, _plans, api
    monkeypatch.setenv(registry.HOPPER_ENV, hopper)
    monkeypatch.setattr(_plans, "_PLANS", {})
    rng = np.random.default_rng(45)
    dt = np_dtype(dtype)

    def layouts(b, hkv):
        draw = lambda *shape: rng.standard_normal(shape).astype(dt)  # noqa: E731
        q, dout, out = (draw(b, hkv * group, nq, 64) for _ in range(3))
        k, v = draw(b, hkv, 30, 64), draw(b, hkv, 30, 64)
        lse = rng.standard_normal((b, hkv * group, nq)).astype(np.float32)
        launches = api.plan_forward(q, k, v, causal=True)[1] + api.plan_backward(dout, q, k, v, out, lse, True)[1]
        return {_kernel_cache.kernel_name(kern): "".join(getattr(typeof(a), "layout", "") for a in args)
                for kern, _, _, _, args, _ in launches}

    one, more = layouts(1, 1), layouts(2, 3)
    assert one and all(one[name] == more[name] for name in set(one) & set(more)), (one, more)
    assert set(one) - set(more) <= {f"forward_merge/{dtype}/d0/full/plain"}    # (a small grid's key splits)


@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("nq", [1, 3, 20])
def test_kvcache_views_keep_their_layout_across_sizes(group, nq, monkeypatch):
    """KV-cache calls (packed sequences) of one sequence and one K/V head launch each
    kernel with the argument layouts of calls with more of both (their views are never
    contiguous with more than one head, so they are typed A throughout, not C or F by their
    sizes; grouped heads with a few query rows fold a group's rows into one view).
    Launches recorded, not run."""
    from numba import typeof
    from numba_flash import _kernel_cache, _plans, api
    monkeypatch.setattr(_plans, "_PLANS", {})
    seen = {}
    monkeypatch.setattr(api, "launch", lambda kern, grid, block, smem, args, *rest: seen.__setitem__(
        _kernel_cache.kernel_name(kern), "".join(getattr(typeof(a), "layout", "") for a in args)))
    rng = np.random.default_rng(46)
    dt = np_dtype("bfloat16")

    def layouts(b, h):
        seen.clear()
        draw = lambda *shape: rng.standard_normal(shape).astype(dt)  # noqa: E731
        numba_flash.attention_with_kvcache(draw(b, nq, h * group, 16), draw(b, 64, h, 16), draw(b, 64, h, 16),
                                           np.full(b, 40, np.int32), k_new=draw(b, nq, h, 16),
                                           v_new=draw(b, nq, h, 16))
        return dict(seen)

    one, more = layouts(1, 1), layouts(3, 2)
    assert one and one == more, (one, more)
