"""PyTorch: results of the input's kind, and numba_flash.torch (custom ops, autograd,
torch.compile, the SDPA drop-in). In the simulator on CPU tensors (tiny shapes); on a GPU
also on CUDA tensors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
import numba_flash.torch as nft  # noqa: E402
from numba_flash import reference  # noqa: E402
from conftest import ON_GPU, host  # noqa: E402

F = torch.nn.functional
DEVICES = ["cpu", "cuda"] if ON_GPU and torch.cuda.is_available() else ["cpu"]
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _randn(gen, shape, dtype, device, grad=False):
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)
    return x.requires_grad_(grad)


def _f64(x):
    return np.asarray(host(x), dtype=np.float64)


def _close(got, want, dtype):
    want = np.asarray(want, dtype=np.float64)
    err = float(np.abs(_f64(got) - want).max()) if want.size else 0.0
    assert err <= TOL[dtype] * max(1.0, float(np.abs(want).max()) if want.size else 1.0), err


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_results_are_tensors_on_the_inputs_device(device, dtype):
    """q's kind out: tensors of the same device and dtype (lse float32) from every entry point."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (_randn(gen, (2, n, 16), dtype, device) for n in (5, 7, 7, 5))
    out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
    only = numba_flash.attention(q, k, v, causal=True)
    grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
    for x, like in [(out, q), (only, q), (lse, None), *zip(grads, (q, k, v))]:
        assert isinstance(x, torch.Tensor) and x.device == q.device
        assert x.dtype == (torch.float32 if like is None else like.dtype)
        assert x.shape == (like.shape if like is not None else q.shape[:-1])
    ref_out, ref_lse = reference.attention_fwd(*(_f64(x) for x in (q, k, v)), causal=True)
    _close(out, ref_out, dtype)
    _close(only, ref_out, dtype)
    _close(lse, ref_lse, torch.float32)
    ref_grads = reference.attention_bwd(_f64(dout), *(_f64(x) for x in (q, k, v)), causal=True)
    for g, r in zip(grads, ref_grads):
        _close(g, r, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_serving_results_are_tensors_on_the_inputs_device(device, dtype):
    """The packed entry points too (varlen forward and backward, KV caches): tensors of
    q's device and dtype out, matching the oracle, and a KV cache's append visible in
    the caller's tensor."""
    gen = torch.Generator().manual_seed(2)
    cu = np.array([0, 3, 8], np.int32)
    q, k, v, dout = (_randn(gen, (8, 2, 16), dtype, device) for _ in range(4))
    out, lse = numba_flash.attention_varlen_fwd(q, k, v, cu, cu, causal=True)
    grads = numba_flash.attention_varlen_bwd(dout, q, k, v, out, lse, cu, cu, causal=True)
    for x, like in [(out, q), (lse, None), *zip(grads, (q, k, v))]:
        assert isinstance(x, torch.Tensor) and x.device == q.device
        assert x.dtype == (torch.float32 if like is None else like.dtype)
    for s in range(2):
        rows = slice(cu[s], cu[s + 1])
        heads = lambda x: np.swapaxes(_f64(x)[rows], 0, 1)  # noqa: E731
        _close(np.swapaxes(_f64(out)[rows], 0, 1), reference.attention(heads(q), heads(k), heads(v), causal=True),
               dtype)
    qc, kc, vc, kn = (_randn(gen, shape, dtype, device) for shape in
                      [(2, 1, 2, 16), (2, 6, 1, 16), (2, 6, 1, 16), (2, 1, 1, 16)])
    lens = np.array([2, 4], np.int32)
    out, lse = numba_flash.attention_with_kvcache(qc, kc, vc, lens, k_new=kn, v_new=kn, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.device == qc.device and out.dtype == dtype
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    for b in range(2):
        assert torch.equal(kc[b, lens[b]], kn[b, 0]), "the append is in the caller's tensor"
        n = lens[b] + 1
        keys, values = (np.repeat(np.swapaxes(_f64(c)[b, :n], 0, 1), 2, axis=0) for c in (kc, vc))
        _close(np.swapaxes(_f64(out)[b], 0, 1), reference.attention(np.swapaxes(_f64(qc)[b], 0, 1), keys, values),
               dtype)


def test_numpy_in_numpy_out():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(3))
    out, lse = numba_flash.attention_fwd(q, k, v)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_autograd_matches_the_oracle(device, dtype):
    """loss.backward() through numba_flash.torch.attention, with every score option."""
    gen = torch.Generator().manual_seed(3)
    q = _randn(gen, (4, 6, 8), dtype, device, grad=True)
    k, v = (_randn(gen, (2, 9, 8), dtype, device, grad=True) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float32, device=device)
    opts = dict(window=(4, 1), softcap=3.0, alibi_slopes=slopes if dtype != torch.float64 else slopes.double())
    out = nft.attention(q, k, v, **opts)
    w = _randn(gen, out.shape, dtype, device)
    (out * w).sum().backward()
    np_opts = dict(opts, alibi_slopes=_f64(opts["alibi_slopes"]))
    _close(out, reference.attention(*(_f64(x) for x in (q, k, v)), **np_opts), dtype)
    ref = reference.attention_bwd(_f64(w), *(_f64(x) for x in (q, k, v)), **np_opts)
    for x, r in zip((q, k, v), ref):
        _close(x.grad, r, dtype)


def test_gradcheck_float64():
    """torch.autograd.gradcheck: the analytic gradients (the float64 kernels) against
    finite differences of the forward."""
    gen = torch.Generator().manual_seed(4)
    q = _randn(gen, (2, 4), torch.float64, DEVICES[-1], grad=True)
    k, v = (_randn(gen, (3, 4), torch.float64, DEVICES[-1], grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b, c: nft.attention(a, b, c, causal=True, softcap=2.0), (q, k, v))


def test_opcheck():
    """torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch."""
    gen = torch.Generator().manual_seed(5)
    dev = DEVICES[-1]
    q, k, v, dout = (_randn(gen, (2, n, 8), torch.float32, dev) for n in (3, 4, 4, 3))
    opts = (True, None, -1, -1, None, None)
    torch.library.opcheck(torch.ops.numba_flash.attention_fwd.default, (q, k, v, *opts))
    out, lse = torch.ops.numba_flash.attention_fwd(q, k, v, *opts)
    torch.library.opcheck(torch.ops.numba_flash.attention_bwd.default, (dout, q, k, v, out, lse, *opts))


def test_kvcache_op():
    """The KV-cache op: opcheck (schema with its declared mutations, fake tensors, AOT
    dispatch), and torch.compile(fullgraph=True) of a decoding step: the same result and
    the same appended cache as eager mode, which matches the oracle."""
    gen = torch.Generator().manual_seed(7)
    dev = DEVICES[-1]
    q, kc, vc, kn = (_randn(gen, shape, torch.float32, dev) for shape in
                     [(2, 1, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8), (2, 1, 2, 8)])
    lens = torch.tensor([2, 4], dtype=torch.int32, device=dev)
    opts = (None, False, None, -1, -1, None, None, True)
    torch.library.opcheck(torch.ops.numba_flash.attention_with_kvcache.default,
                          (q, kc.clone(), vc.clone(), lens, kn, kn.clone(), *opts))

    def step(q, kc, vc, lens, kn):
        return nft.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=kn)

    k1, v1, k2, v2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    eager = step(q, k1, v1, lens, kn)
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(q, k2, v2, lens, kn)
    torch.testing.assert_close(compiled, eager)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    for b in range(2):
        n = int(lens[b]) + 1
        assert torch.equal(k1[b, n - 1], kn[b, 0])
        keys, values = (np.repeat(np.swapaxes(_f64(c)[b, :n], 0, 1), 2, axis=0) for c in (k1, v1))
        _close(np.swapaxes(_f64(eager)[b], 0, 1), reference.attention(np.swapaxes(_f64(q)[b], 0, 1), keys, values),
               torch.float32)


def test_compile_fullgraph():
    """torch.compile(fullgraph=True) traces a model using the op without graph breaks,
    and its gradients equal eager mode's."""
    gen = torch.Generator().manual_seed(6)
    dev = DEVICES[-1]
    lin = torch.nn.Linear(8, 24, dtype=torch.float64).to(dev)

    def model(x):
        q, k, v = lin(x).unflatten(-1, (3, 8)).unbind(-2)
        return nft.attention(q, k, v, causal=True).square().sum()

    x = _randn(gen, (2, 5, 8), torch.float64, dev)
    eager = torch.autograd.grad(model(x), lin.weight)[0]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(x), lin.weight)[0]
    torch.testing.assert_close(got, eager)


@pytest.mark.skipif("cuda" not in DEVICES, reason="inductor's GPU code needs a CUDA GPU")
def test_compile_inductor_on_gpu():
    """The default backend (inductor) on bfloat16 CUDA tensors: no graph breaks, the same
    loss and gradients as eager mode up to bf16 rounding of the fused neighbours."""
    gen = torch.Generator().manual_seed(9)
    lin = torch.nn.Linear(64, 3 * 64, device="cuda", dtype=torch.bfloat16)

    def model(x):
        q, k, v = lin(x).unflatten(-1, (3, 2, 32)).permute(2, 0, 3, 1, 4).unbind(0)
        return nft.attention(q, k, v, causal=True).float().square().mean()

    x = torch.randn((2, 100, 64), generator=gen).to("cuda", torch.bfloat16)
    eager_loss = model(x)
    eager = torch.autograd.grad(eager_loss, lin.weight)[0]
    compiled = torch.compile(model, fullgraph=True)
    loss = compiled(x)
    got = torch.autograd.grad(loss, lin.weight)[0]
    torch.testing.assert_close(loss, eager_loss, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got.float(), eager.float(), atol=2e-2, rtol=5e-2)


@pytest.mark.skipif("cuda" not in DEVICES, reason="CUDA graphs need a CUDA GPU")
def test_decoding_step_under_compile_with_cuda_graphs():
    """A decoding step (the KV-cache op with ``check_metadata=False``, the lengths advanced
    on the device) under ``torch.compile(mode="reduce-overhead")``, which replays CUDA
    graphs: every step matches eager mode's on copies of the same caches."""
    gen = torch.Generator().manual_seed(10)
    b, nmax, hq, hkv, d = 2, 64, 8, 2, 64
    kc, vc = (torch.randn((b, nmax, hkv, d), generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    k2, v2 = kc.clone(), vc.clone()
    lens, lens2 = (torch.tensor([5, 30], dtype=torch.int32, device="cuda") for _ in range(2))

    def step(q, kn, kc, vc, lens):
        out = nft.attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=kn, check_metadata=False)
        lens.add_(1)
        return out

    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(5):
        q = torch.randn((b, 1, hq, d), generator=gen).to("cuda", torch.bfloat16)
        kn = torch.randn((b, 1, hkv, d), generator=gen).to("cuda", torch.bfloat16)
        want = step(q, kn, kc, vc, lens).clone()
        got = compiled(q, kn, k2, v2, lens2).clone()
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert torch.equal(k2, kc) and torch.equal(lens2, lens)


@pytest.mark.skipif("cuda" not in DEVICES, reason="CUDA graphs need a CUDA GPU")
def test_attention_in_a_cuda_graph_outlives_later_tensor_maps():
    """bf16 attention (on an H200 the Hopper family, whose kernels read TMA tensor maps)
    captured in a CUDA graph after a warm-up call on the capturing stream, then more new
    maps made by eager calls on other tensors than there are map slots: each replay still
    equals eager mode's result on the graph's inputs, bit for bit."""
    from numba_flash import families
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn((2, 8, 256, 128), generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nft.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = nft.attention(q, k, v, causal=True)
    calls = families._MapSlots.SLOTS // 2 + 100          # two new maps a call (q's rows, k's and v's)
    big = torch.randn((calls * 16 + 64, 128), generator=gen).to("cuda", torch.bfloat16)
    for i in range(calls):
        x = big[16 * i:16 * i + 64].view(1, 1, 64, 128)
        nft.attention(x, x, x)
    for _ in range(2):
        q.copy_(torch.randn(q.shape, generator=gen).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, nft.attention(q, k, v, causal=True), atol=0, rtol=0)


@pytest.mark.parametrize("nq,nk", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_drop_in_matches_torch(nq, nk, is_causal):
    """SDPA's semantics, top-left is_causal included, outputs and gradients."""
    gen = torch.Generator().manual_seed(7)
    dev = DEVICES[-1]
    q = _randn(gen, (1, 2, nq, 8), torch.float64, dev, grad=True)
    k, v = (_randn(gen, (1, 2, nk, 8), torch.float64, dev, grad=True) for _ in range(2))
    ours = nft.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.4)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.4)
    torch.testing.assert_close(ours, want)
    g_ours = torch.autograd.grad(ours.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g_ours, g_want):
        torch.testing.assert_close(a, b)


def test_sdpa_drop_in_grouped_heads():
    gen = torch.Generator().manual_seed(8)
    dev = DEVICES[-1]
    q = _randn(gen, (1, 4, 6, 8), torch.float64, dev)
    k, v = (_randn(gen, (1, 2, 6, 8), torch.float64, dev) for _ in range(2))
    torch.testing.assert_close(nft.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


@pytest.mark.parametrize("kwargs,message", [
    (dict(attn_mask=True), "attn_mask is not supported"),
    (dict(dropout_p=0.1), "dropout_p must be 0"),
    (dict(value_dim=4), "value must have the query's head dim"),
    (dict(kv_heads=1), "pass enable_gqa=True"),
])
def test_sdpa_drop_in_refuses_what_it_cannot_honour(kwargs, message):
    q = torch.zeros(1, 2, 3, 8)
    k = torch.zeros(1, kwargs.pop("kv_heads", 2), 3, 8)
    v = torch.zeros(*k.shape[:-1], kwargs.pop("value_dim", 8))
    if kwargs.pop("attn_mask", False):
        kwargs["attn_mask"] = torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=message):
        nft.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.skipif("cuda" not in DEVICES, reason="pool memory behind CUDA tensors needs a GPU")
def test_returned_tensor_keeps_its_memory():
    """A returned CUDA tensor views numba_flash's pool memory: it stays valid while the
    tensor lives, even after every other reference is gone and later calls reuse the pool."""
    import gc
    gen = torch.Generator().manual_seed(9)
    q, k, v = (_randn(gen, (2, 4, 300, 64), torch.bfloat16, "cuda") for _ in range(3))
    out = numba_flash.attention(q, k, v, causal=True)
    expected = out.clone()
    gc.collect()
    for scale in (0.1, 0.2, 0.3):          # new outputs of the same size, from the same pool
        numba_flash.attention(q, k, v, scale=scale)
        gc.collect()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
