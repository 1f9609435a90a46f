"""Repeat calls through cached launch plans (numba_flash._plans): same answers as the
full path, the same argument checks, and plans only where a call's signature matches."""
import numpy as np
import pytest

import numba_flash  # before numba: it decides whether the simulator is needed
from numba import cuda
from numba_flash import _plans, api
from conftest import ON_GPU, check_forward, host, make_qkv, np_dtype
from numba_flash.testing import check_forward_low

GPU_ONLY = pytest.mark.skipif(not ON_GPU, reason="launch plans exist only on a GPU")


@pytest.fixture
def plan_runs(monkeypatch):
    """Counts the calls answered by a cached plan; starts with no plans."""
    monkeypatch.setattr(_plans, "_PLANS", {})
    runs = []
    original = _plans.Plan.run

    def counted(self, sig, poison=None, uploads=(), like=None):
        runs.append(sig.key)
        return original(self, sig, poison, uploads, like)
    monkeypatch.setattr(_plans.Plan, "run", counted)
    return runs


def test_no_plans_in_the_simulator_or_for_numpy():
    q = np.ones((4, 8), np.float32)
    assert _plans.signature("forward", (q, q, q), (False, None)) is None
    assert _plans.signature("forward", ([1.0], [1.0], [1.0]), (False, None)) is None


# (lead, nq, nk, d, dtype): plain, folded leading dims, key splits (few query tiles, many keys,
# so forward_splits chooses a merge), float64, and a head dim above 256.
SHAPES = [((2, 3), 100, 77, 64, "float32"), ((), 128, 4096, 64, "float32"), ((3,), 65, 300, 32, "float64"),
          ((1, 1), 64, 1024, 1024, "float32")]


@GPU_ONLY
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}-{s[1]}x{s[2]}-d{s[3]}-{s[4]}")
def test_repeat_calls_match_the_oracle(shape, causal, plan_runs):
    """Fresh data each call, same signature: the first call leaves a plan, later calls use it,
    and each call's outputs (NaN-poisoned first) match the oracle."""
    lead, nq, nk, d, dtype = shape
    n_launches = len(api.plan_forward(*(cuda.to_device(x) for x in make_qkv(0, lead, nq, nk, d, dtype)),
                                  causal=causal)[1])
    for call in range(3):
        q, k, v = make_qkv(100 + call, lead, nq, nk, d, dtype)
        out, lse = numba_flash.attention_fwd(cuda.to_device(q), cuda.to_device(k), cuda.to_device(v),
                                             causal=causal, scale=0.3)
        check_forward(host(out), host(lse), q, k, v, causal, 0.3)
        assert len(plan_runs) == call, "calls after the first must run through the plan"
    if nk >= 1024:
        assert n_launches == 2, "this shape is meant to exercise the key-split merge"


@GPU_ONLY
@pytest.mark.parametrize("kind", ["numba", "torch"])
def test_attention_repeat_calls_return_out_alone(kind, plan_runs):
    """``attention`` (no lse) has plans of its own, whose lse lives in their scratch: one
    output per call, matching the oracle, fresh data and NaN-poisoned outputs each call."""
    if kind == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("torch without CUDA")
        to_device = lambda x: torch.as_tensor(x, device="cuda")   # noqa: E731
    else:
        to_device = cuda.to_device
    for call in range(3):
        q, k, v = make_qkv(200 + call, (2, 3), 37, 300, 32, "float32")
        out = numba_flash.attention(*(to_device(x) for x in (q, k, v)), causal=True)
        check_forward(host(out), None, q, k, v, True, None)
        assert len(plan_runs) == call
    (plan,) = _plans._PLANS.values()
    assert len(plan.outputs) == 1 and plan.scratch_bytes > 0


@GPU_ONLY
def test_plan_keeps_the_argument_checks(plan_runs):
    q, k, v = (cuda.to_device(x) for x in make_qkv(1, (), 40, 50, 16, "float32"))
    numba_flash.attention_fwd(q, k, v, causal=True, scale=1.0)
    numba_flash.attention_fwd(q, k, v, causal=True, scale=1.0)
    assert len(plan_runs) == 1
    with pytest.raises(TypeError, match="causal"):
        numba_flash.attention_fwd(q, k, v, causal=1, scale=1.0)
    with pytest.raises(TypeError, match="scale"):
        numba_flash.attention_fwd(q, k, v, causal=True, scale=True)
    with pytest.raises(ValueError, match="scale"):
        numba_flash.attention_fwd(q, k, v, causal=True, scale=-1.0)


@GPU_ONLY
def test_a_signature_change_takes_the_full_path(plan_runs):
    """Another scale, causality, stride or alignment is another signature."""
    q, k, v = make_qkv(2, (), 40, 50, 16, "float32")
    qd, kd, vd = (cuda.to_device(x) for x in (q, k, v))
    numba_flash.attention_fwd(qd, kd, vd)
    for kwargs in ({"scale": 0.5}, {"causal": True}):
        out, lse = numba_flash.attention_fwd(qd, kd, vd, **kwargs)
        check_forward(host(out), host(lse), q, k, v, kwargs.get("causal", False), kwargs.get("scale"))
    base = cuda.device_array(q.size + 1, np.float32)
    shifted = base[1:].reshape(q.shape)            # 4-byte aligned only: plain loads
    shifted.copy_to_device(q)
    out, lse = numba_flash.attention_fwd(shifted, kd, vd, scale=0.5)
    check_forward(host(out), host(lse), q, k, v, False, 0.5)
    assert len(plan_runs) == 0
    out, lse = numba_flash.attention_fwd(qd, kd, vd, scale=0.5)
    assert len(plan_runs) == 1
    check_forward(host(out), host(lse), q, k, v, False, 0.5)


@GPU_ONLY
def test_same_array_twice(plan_runs):
    q, k, v = make_qkv(3, (2,), 33, 33, 8, "float64")
    qd = cuda.to_device(q)
    for _ in range(2):
        out, lse = numba_flash.attention_fwd(qd, qd, qd, causal=True)
        check_forward(host(out), host(lse), q, q, q, True, None)


@GPU_ONLY
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_packed_qkv_on_a_side_stream(dtype, plan_runs, monkeypatch):
    """q, k, v as strided views of one packed tensor, made on a busy side stream: the plan
    launches on that stream, after the work that writes them, and its outputs are made by
    PyTorch's allocator on that stream (no Numba array from the pool: allocations counted),
    in q's dtype (lse float32), NaN-poisoned before the launch."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from numba_flash import _arrays
    pooled = []
    for name in ("pool_empty", "pool_alloc"):
        original = getattr(_arrays, name)
        monkeypatch.setattr(_arrays, name, lambda *a, _f=original, **k: pooled.append(a) or _f(*a, **k))
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(5)
    s = torch.cuda.Stream()
    results, first = [], None
    with torch.cuda.stream(s):
        for call in range(3):
            torch.cuda._sleep(200_000_000 if call else 0)
            qkv = torch.randn(2, 70, 3, 4, 64, device="cuda", generator=g).to(tdt)
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            results.append((q, k, v) + tuple(numba_flash.attention_fwd(q, k, v, causal=True)))
            if call == 0:
                first = len(pooled)          # the full path's outputs
    torch.cuda.synchronize()
    assert len(plan_runs) == 2
    assert len(pooled) == first, "a plan's PyTorch outputs came from the pool"
    for q, k, v, out, lse in results:
        assert out.dtype == tdt and lse.dtype == torch.float32 and out.device == q.device
        assert out.shape == q.shape and lse.shape == q.shape[:-1]
        check = check_forward_low if dtype == "bfloat16" else check_forward
        check(host(out), host(lse), host(q), host(k), host(v), True, None)


@GPU_ONLY
def test_torch_stream_handle():
    """The raw stream query the plans use names PyTorch's current stream, on the default
    stream and on a side stream."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from numba_flash import _arrays
    device = torch.zeros(1, device="cuda").device
    assert _arrays.torch_stream(device) == torch.cuda.current_stream(device).cuda_stream
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert _arrays.torch_stream(device) == s.cuda_stream != 0


@GPU_ONLY
def test_cupy_repeat_calls(plan_runs):
    cp = pytest.importorskip("cupy")
    rng = cp.random.default_rng(6)
    for _ in range(2):
        q, k, v = (rng.standard_normal((3, 50, 24), dtype=cp.float32) for _ in range(3))
        out, lse = numba_flash.attention_fwd(q, k, v)
        cp.cuda.runtime.deviceSynchronize()
        check_forward(host(out), host(lse), cp.asnumpy(q), cp.asnumpy(k), cp.asnumpy(v), False, None)
    assert len(plan_runs) == 1


@GPU_ONLY
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unpoisoned_plan_calls_wrap_their_outputs_after_the_launch(dtype, plan_runs, monkeypatch):
    """Without the poison a plan allocates its outputs as pool memory and makes them Numba
    arrays once its kernels are queued: each call's outputs are arrays of their own (all
    kept alive), of the logical dtype, matching the oracle, given back to the pool when
    dropped. Before each call a NaN-filled block of out's size is freed into the pool, which
    the call's allocation then likely reuses: an element the kernel failed to write would
    stay NaN."""
    from numba.cuda.cudadrv import devices
    from numba_flash import _arrays
    monkeypatch.setattr(api, "_POISON", None)
    ctx = devices.get_context()
    pool = _arrays.pool_for(ctx.device.id)
    if not pool:
        pytest.skip("the driver offers no memory pools")
    kept = []
    for call in range(3):
        q, k, v = make_qkv(300 + call, (2, 3), 130, 200, 64, dtype)
        stale = _arrays.pool_empty(ctx, pool, q.shape, np.dtype(np.uint16 if dtype == "bfloat16" else dtype), 0,
                                   np.dtype(np.float32 if dtype == "float32" else np.uint16),
                                   np.nan if dtype == "float32" else 0x7FC0)
        del stale
        out, lse = numba_flash.attention_fwd(*(_arrays.to_device(x) for x in (q, k, v)), causal=True)
        assert len(plan_runs) == call
        assert str(out.dtype) == dtype and lse.dtype == np.float32 and out.shape == q.shape
        check = check_forward_low if dtype == "bfloat16" else check_forward
        check(host(out), host(lse), q, k, v, True, None)
        kept.append((out, lse))
    pointers = [_arrays.device_pointer(a) for pair in kept for a in pair]
    assert len(set(pointers)) == len(pointers), "two live outputs share memory"
    cuda.synchronize()
    used = _arrays.pool_usage()[0]
    del kept, out, lse
    cuda.synchronize()
    assert _arrays.pool_usage()[0] < used, "dropped outputs were not given back to the pool"


@GPU_ONLY
def test_float16_repeat_calls(plan_runs):
    q, k, v = (x.astype(np.float16) for x in make_qkv(7, (2,), 64, 64, 64, "float32"))
    outs = [numba_flash.attention_fwd(*(cuda.to_device(x) for x in (q, k, v))) for _ in range(2)]
    assert len(plan_runs) == 1
    assert outs[1][0].dtype == np.float16 and outs[1][1].dtype == np.float32
    np.testing.assert_array_equal(host(outs[0][0]), host(outs[1][0]))
    np.testing.assert_array_equal(host(outs[0][1]), host(outs[1][1]))


@GPU_ONLY
@pytest.mark.parametrize("causal", [False, True])
def test_hopper_family_repeat_calls(causal, plan_runs, monkeypatch):
    """The Hopper family (on cc 9.0) through plans: each call's q, k, v fresh device
    arrays (the plan makes, or finds, the TMA maps of the new addresses); every call's
    outputs match the oracle."""
    from numba_flash import registry
    if cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    for call in range(3):
        q, k, v = (x.astype(np.float16) for x in make_qkv(200 + call, (2, 3), 200, 330, 128, "float32"))
        out, lse = numba_flash.attention_fwd(*(cuda.to_device(x) for x in (q, k, v)), causal=causal)
        check_forward_low(host(out), host(lse), q, k, v, causal, None)
        assert len(plan_runs) == call, "calls after the first must run through the plan"


@GPU_ONLY
def test_hopper_plan_calls_with_the_same_tensors(plan_runs, monkeypatch):
    """A model's next step: the same device arrays with new values written in place (the
    plan reuses each slot's tensor map), between calls with other arrays of the same
    signature (which replace the maps the plan remembers), and after the table of maps
    started afresh; every call's outputs match the oracle."""
    from numba_flash import families, registry
    if cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    inputs = [[cuda.device_array((2, 3, 200, 128), np.float16) for _ in range(3)] for _ in range(2)]
    for call, which in enumerate((0, 0, 0, 1, 0, 0)):
        if call == 5:           # as if the table had started afresh: the maps are looked up again
            monkeypatch.setattr(families, "_GENERATION", [families.map_generation() + 1])
        q, k, v = (x.astype(np.float16) for x in make_qkv(400 + call, (2, 3), 200, 200, 128, "float32"))
        for dev, x in zip(inputs[which], (q, k, v)):
            dev.copy_to_device(x)
        out, lse = numba_flash.attention_fwd(*inputs[which], causal=True)
        check_forward_low(host(out), host(lse), q, k, v, True, None)
    assert len(plan_runs) == 5


@GPU_ONLY
def test_hopper_plans_with_a_table_of_one_map(plan_runs, monkeypatch):
    """A table of tensor maps that starts afresh at every new map (``MAX_MAPS = 1``, from
    the second call: the first call's plan needs each of its maps' sources, which the table
    forgets when it starts afresh) and memory freed as soon as it is dropped: a plan's run
    makes q's, k's and v's maps one after the other, each dropping the one before from the
    table, and must still launch with all three alive (a dropped map freed and its memory
    reused by the next map would send the kernel to the wrong tensor)."""
    from numba.cuda.core import config     # numba-cuda's own configuration (its deallocations)
    from numba_flash import families, registry
    if cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    monkeypatch.setattr(config, "CUDA_DEALLOCS_COUNT", 0)
    for call in range(4):
        q, k, v = (x.astype(np.float16) for x in make_qkv(300 + call, (2,), 150, 260, 64, "float32"))
        out, lse = numba_flash.attention_fwd(*(cuda.to_device(x) for x in (q, k, v)))
        check_forward_low(host(out), host(lse), q, k, v, False, None)
        monkeypatch.setattr(families, "MAX_MAPS", 1)
    assert len(plan_runs) == 3


@GPU_ONLY
def test_new_tensor_maps_do_not_wait_for_queued_work(plan_runs, monkeypatch):
    """A Hopper call with new tensors (so new tensor maps) queued behind a long kernel on
    PyTorch's current stream returns while that kernel still runs: the maps are copied to
    the device on the stream (a synchronous copy from pageable memory waited for the queued
    work), and the results match the oracle."""
    torch = pytest.importorskip("torch")
    from numba_flash import registry
    if not torch.cuda.is_available() or cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1")
    g = torch.Generator(device="cuda").manual_seed(13)

    def fresh():
        return [torch.randn(2, 3, 200, 64, device="cuda", generator=g).half() for _ in range(3)]
    numba_flash.attention_fwd(*fresh())          # compiles, and leaves a plan
    # through the plan: loads PyTorch's fill kernels for the poison (loading a module waits
    # for the device)
    numba_flash.attention_fwd(*fresh())
    q, k, v = fresh()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)             # about half a second on the current stream
    out, lse = numba_flash.attention_fwd(q, k, v)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert len(plan_runs) == 2
    assert busy, "the call waited for the work queued before it"
    check_forward_low(host(out), host(lse), host(q), host(k), host(v), False, None)


def test_plan_holds_the_tensor_maps_it_launches_with(monkeypatch):
    """``Plan.run`` writes each tensor map's device address into a launch's parameters; the
    table of maps may drop an earlier map while a later one is made, so the run keeps
    every map it used until its launches are queued. (Host-side only.)"""
    from numba_flash import _arrays, families
    made = []

    class Map:
        pass

    def tensor_map(ptr, *view, stream=0):
        made.append(Map())
        return made[-1]
    monkeypatch.setattr(families, "tensor_map", tensor_map)
    monkeypatch.setattr(_arrays, "device_pointer", id)
    held = []
    pointers = [_plans._map_pointer(p, ((1, 1, 8, 64), (16384, 16384, 128, 2), 64), held, 0) for p in (0, 256, 512)]
    made.clear()                 # the table's references gone
    assert [id(m) for m in held] == pointers and len(set(pointers)) == 3


def test_maps_of_a_full_table_stay_alive_until_it_fills_again(monkeypatch):
    """When the table of tensor maps fills up it starts afresh, but the maps it held are
    kept until it fills again (launches already queued, or queued by the call under way,
    may still read them); on a GPU it first waits for the queued kernels. (Host-side.)"""
    from numba_flash import families
    for name, value in (("_MAPS", {}), ("MAP_SOURCES", {}), ("_RETIRED", []), ("MAX_MAPS", 2), ("_SLOTS", {})):
        monkeypatch.setattr(families, name, value)
    monkeypatch.setattr(families, "_new_map", lambda *args: object())
    view = ((1, 1, 8, 64), (1024, 1024, 128, 2), 64)
    a, b = (families.tensor_map(p, *view) for p in (0, 256))
    c = families.tensor_map(512, *view)                  # the table was full: a and b retire
    assert families._RETIRED == [a, b] and list(families._MAPS.values()) == [c]
    assert families.tensor_map(512, *view) is c and families.tensor_map(0, *view) is not a
    families.tensor_map(768, *view)                      # full again: the last table retires
    assert c in families._RETIRED and a not in families._RETIRED


def test_plan_reuses_a_slots_tensor_map_while_the_table_stands(monkeypatch):
    """A plan remembers, per parameter slot, the last call's pointer and tensor map: the
    same pointer again reuses that map's address (and holds the map for the launch); a new
    pointer, or a table of maps started afresh since, makes the map anew. (Host-side.)"""
    from numba_flash import families
    made = []

    def map_pointer(ptr, tmap, held, stream):
        made.append((ptr, families.map_generation()))
        held.append(("map", len(made)))
        return 1000 + len(made)
    monkeypatch.setattr(_plans, "_map_pointer", map_pointer)
    monkeypatch.setattr(families, "_GENERATION", [5])
    plan = _plans.Plan.__new__(_plans.Plan)
    plan.maps = {}
    view = ((1, 1, 8, 64), (1024, 1024, 128, 2), 64)
    held = []
    first = plan._map_address((0, 4), 256, view, held, 0, False)
    assert plan._map_address((0, 4), 256, view, held, 0, False) == first and held == [("map", 1)] * 2
    assert plan._map_address((0, 5), 256, view, held, 0, False) != first          # another slot: its own map
    assert plan._map_address((0, 4), 512, view, held, 0, False) not in (first,)   # another pointer
    assert len(made) == 3
    families._GENERATION[0] += 1                                            # the table started afresh
    plan._map_address((0, 4), 512, view, held, 0, False)
    assert made[-1] == (512, 6) and len(made) == 4
    assert plan._map_address((0, 4), 512, view, held, 0, False) == 1004 and len(made) == 4
    assert plan._map_address((0, 4), 512, view, held, 0, True) == 1005 and len(made) == 5   # under capture


def test_tensor_maps_under_capture_are_made_for_the_graph(monkeypatch):
    """While the stream is captured into a CUDA graph, a map found in the table is used
    only if it lies in the slots kept for captured maps (else a new one is made there), and
    a full table does not start afresh (that waits for the device). (Host-side: capture,
    contexts and slots stand-ins.)"""
    from numba_flash import _runtime, families, launch
    captured = set()

    class Slots:
        def holds_captured(self, m):
            return m in captured

    capturing = [False]

    def new_map(*args):
        m = object()
        if capturing[0]:
            captured.add(m)
        return m
    for name, value in (("_MAPS", {}), ("MAP_SOURCES", {}), ("_RETIRED", []), ("MAX_MAPS", 2),
                        ("_SLOTS", {"ctx": Slots()}), ("_new_map", new_map), ("_capturing", lambda s: capturing[0])):
        monkeypatch.setattr(families, name, value)
    monkeypatch.setattr(_runtime, "SIMULATOR", False)
    monkeypatch.setattr(launch, "context_handle", lambda: "ctx")
    view = ((1, 1, 8, 64), (1024, 1024, 128, 2), 64)
    eager = families.tensor_map(0, *view)
    assert families.tensor_map(0, *view) is eager
    capturing[0] = True
    graph = families.tensor_map(0, *view)
    assert graph is not eager and graph in captured, "an eager slot may be taken by later maps"
    assert families.tensor_map(0, *view) is graph
    generation = families.map_generation()
    more = [families.tensor_map(p, *view) for p in (256, 512, 768)]      # past MAX_MAPS, under capture
    assert families.map_generation() == generation and all(m in captured for m in more)
    capturing[0] = False
    assert families.tensor_map(0, *view) is graph                        # eager calls may use it too


def test_plan_uploads_are_copied_only_when_they_change(monkeypatch):
    """A plan keeps its uploads (sequence tables) in a device buffer of its own and queues
    a copy only when a call's tables differ from the last call's; the launches get each
    table's address in that buffer. (Host-side: the copy is recorded, not made.)"""
    copies = []
    monkeypatch.setattr(_plans, "_upload", lambda uploads, offsets, dst, stream, ctx: copies.append(
        ([a.copy() for a in uploads], list(offsets), dst)))
    plan = _plans.Plan.__new__(_plans.Plan)
    plan.uploaded = None
    table = np.arange(24, dtype=np.int32).reshape(4, 6)
    lens = np.array([3, 5], np.int32)
    offsets = _plans._offsets([table, lens])
    assert offsets == [0, 256, 512]
    addresses = plan._resident([table, lens], offsets, 0, None)
    base = copies[0][2]
    assert addresses == [base, base + 256] and len(copies) == 1
    assert plan._resident([table.copy(), lens.copy()], offsets, 0, None) == addresses and len(copies) == 1
    lens[1] = 6                                    # a decoding step: the lengths grew
    assert plan._resident([table, lens], offsets, 0, None) == addresses and len(copies) == 2
    assert copies[1][0][1].tolist() == [3, 6] and copies[1][2] == base
    from numba_flash import families
    monkeypatch.setattr(families, "_capturing", lambda stream: True)     # under CUDA-graph capture:
    assert plan._resident([table, lens], offsets, 0, None) == addresses   # the same tables copy nothing
    lens[1] = 7
    with pytest.raises(RuntimeError, match="check_metadata=False"):      # new ones would be copied at
        plan._resident([table, lens], offsets, 0, None)                   # every replay from a reused buffer
    assert len(copies) == 2


def test_staged_uploads_copy_the_tables_bytes_and_check_the_copy(monkeypatch):
    """The pinned staging copy writes the uploads' own bytes, ending at the last table's
    last byte and not at the aligned end of the offsets (a plan may have adopted the full
    path's device copy of a lone 84-byte table: copying 256 bytes into it failed in the
    driver, so the plan's launches read the last call's table); a failed copy raises.
    (Host-side: the driver's calls are recorded, not made.)"""
    cu = pytest.importorskip("cuda.bindings.driver")
    ok = cu.CUresult.CUDA_SUCCESS
    pinned = np.zeros(4096, np.uint8)
    copies, result = [], {"copy": ok, "record": ok}
    monkeypatch.setattr(cu, "cuMemHostAlloc", lambda size, flags: (ok, pinned.ctypes.data))
    monkeypatch.setattr(cu, "cuEventCreate", lambda flags: (ok, object()))
    monkeypatch.setattr(cu, "cuEventRecord", lambda event, stream: (result["record"],))
    monkeypatch.setattr(cu, "cuEventSynchronize", lambda event: (ok,))
    monkeypatch.setattr(cu, "cuMemcpyHtoDAsync", lambda dst, src, n, stream: copies.append(
        (dst, pinned[:n].copy())) or (result["copy"],))
    table = np.arange(21, dtype=np.int32).reshape(3, 7)
    lens = np.array([3, 5], np.int32)
    staging = _plans._Staging()
    assert staging.copy([table], _plans._offsets([table]), 1000, 0)
    assert copies[-1][0] == 1000 and copies[-1][1].tobytes() == table.tobytes()        # 84 bytes, not 256
    offsets = _plans._offsets([table, lens])
    assert staging.copy([table, lens], offsets, 1000, 0)
    assert copies[-1][1].size == 256 + lens.nbytes
    assert copies[-1][1][:84].tobytes() == table.tobytes() and copies[-1][1][256:].tobytes() == lens.tobytes()
    result["record"] = cu.CUresult.CUDA_ERROR_INVALID_VALUE     # (the slot's next use could not wait)
    with pytest.raises(RuntimeError, match="cuEventRecord failed"):
        staging.copy([table], _plans._offsets([table]), 1000, 0)
    result["copy"] = cu.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(RuntimeError, match="cuMemcpyHtoDAsync failed"):
        staging.copy([table], _plans._offsets([table]), 1000, 0)


def test_parameter_buffer_layout():
    """Each kernel parameter sits in its own 8-byte cell, as cuLaunchKernel reads it through
    the array of pointers: float32 in the low 4 bytes, float64 and int64 whole; the pointer
    array holds each cell's address. (Host-side only: runs without a GPU.)"""
    import ctypes
    values = [0, 7, np.float32(1.5), np.float64(-2.25), 123456789012]
    types = [ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_double, ctypes.c_int64]
    ln = _plans._Launch(None, (3, 2), 128, 4096, values, types, [(0, 1, 16)])
    assert ln.grid == (3, 2, 1) and ln.block == (128, 1, 1) and ln.smem == 4096
    raw = ln.buf.tobytes()
    assert np.frombuffer(raw[16:20], np.float32)[0] == np.float32(1.5)
    assert np.frombuffer(raw[24:32], np.float64)[0] == -2.25
    assert np.frombuffer(raw[32:40], np.int64)[0] == 123456789012
    assert list(ln.pointers) == [ln.buf.ctypes.data + 8 * i for i in range(len(values))]
    assert ln.address == ln.pointers.ctypes.data
    for i, (value, ctype) in enumerate(zip(values, types)):   # what the driver would read
        assert ctype.from_address(int(ln.pointers[i])).value == pytest.approx(float(value))


def test_plan_table_is_bounded(monkeypatch):
    monkeypatch.setattr(_plans, "_PLANS", {})
    monkeypatch.setattr(_plans, "MAX_PLANS", 3)
    for i in range(7):
        _plans.remember(_plans.Signature(("key", i), [], 0, None), object())
        assert len(_plans._PLANS) <= 3
    assert ("key", 6) in _plans._PLANS
    _plans.remember(None, object())            # no signature (simulator, NumPy): nothing kept
    assert _plans.lookup(None) is None


@GPU_ONLY
@pytest.mark.parametrize("dtype,causal", [("float32", True), ("float64", False)])
def test_backward_repeat_calls_match_the_oracle(dtype, causal, plan_runs):
    """The backward's plan (its delta buffer is the plan's scratch): fresh data each call."""
    from test_backward import check_backward
    lead, nq, nk, d = (2,), 70, 90, 40
    for call in range(3):
        q, k, v = make_qkv(200 + call, lead, nq, nk, d, dtype)
        dout = make_qkv(300 + call, lead, nq, nk, d, dtype)[0]
        dev = [cuda.to_device(x) for x in (q, k, v, dout)]
        out, lse = numba_flash.attention_fwd(*dev[:3], causal=causal)
        grads = numba_flash.attention_bwd(dev[3], *dev[:3], out, lse, causal=causal)
        check_backward([host(g) for g in grads], dout, q, k, v, causal, None)
    assert len(plan_runs) == 4, "forward and backward: each call after the first through its plan"


@GPU_ONLY
def test_backward_plan_with_torch_inputs_and_the_forward_outputs(plan_runs):
    """PyTorch q, k, v, dout with the out and lse that attention_fwd returned (PyTorch
    tensors too, over numba_flash's pool memory), as a PyTorch training step makes them:
    each call after the first finds its plans."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from test_backward import check_backward
    g = torch.Generator(device="cuda").manual_seed(7)
    for call in range(3):
        q, k, v, dout = (torch.randn(2, 60, 32, device="cuda", generator=g) for _ in range(4))
        out, lse = numba_flash.attention_fwd(q, k, v, causal=True)
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=True)
        check_backward([host(x) for x in grads], *(x.cpu().numpy() for x in (dout, q, k, v)), True, None)
    assert len(plan_runs) == 4, "forward and backward: each call after the first through its plan"


def doc_mask(b, h, i, j, docs):
    return docs[i] == docs[j]


def doc_mask_w(b, h, i, j, docs, w):      # the score_mod's mod_args: the functions share them
    return docs[i] == docs[j]


def doc_bias(s, b, h, i, j, docs, w):
    return s - w * abs(i - j)


def doc_bias_grad(s, b, h, i, j, docs, w):
    return 1.0


@GPU_ONLY
@pytest.mark.parametrize("hopper", [False, True])
def test_user_functions_through_plans(hopper, plan_runs, monkeypatch):
    """Calls with user functions take plans too: a block mask (its own mod_args), and a
    score_mod with a device array and a number among mod_args; each call's data fresh
    (new q, k, v, new document ids at a new address), every result against the oracle;
    a different number is another signature (the full path), a NumPy mod_args none."""
    from numba_flash import registry
    from numba_flash.testing import assert_attention_close
    if hopper and cuda.get_current_device().compute_capability != (9, 0):
        pytest.skip("the Hopper family runs on compute capability 9.0 only")
    monkeypatch.setenv(registry.HOPPER_ENV, "1" if hopper else "0")
    n = 300
    docs = np.sort(np.random.default_rng(1).integers(0, 4, n)).astype(np.int32)
    bm = numba_flash.block_mask(doc_mask, 1, 1, n, n, mod_args=(docs,))
    for call in range(3):
        q, k, v = (x.astype(np.float16) for x in make_qkv(300 + call, (2, 3), n, n, 64, "float32"))
        dev = [cuda.to_device(x) for x in (q, k, v)]
        out, lse = numba_flash.attention_fwd(*dev, block_mask=bm)
        assert_attention_close(host(out), q, k, v, host(lse), mask_mod=doc_mask, mod_args=(bm.mod_args[0],))
        assert len(plan_runs) == call, "block-mask calls after the first must run through the plan"
    for call in range(3):
        docs = np.sort(np.random.default_rng(10 + call).integers(0, 4, n)).astype(np.int32)
        q, k, v = (x.astype(np.float16) for x in make_qkv(400 + call, (2, 3), n, n, 64, "float32"))
        dev = [cuda.to_device(x) for x in (q, k, v)]
        args = (cuda.to_device(docs), 0.01)
        before = len(plan_runs)
        out, lse = numba_flash.attention_fwd(*dev, score_mod=doc_bias, mask_mod=doc_mask_w, mod_args=args)
        assert_attention_close(host(out), q, k, v, host(lse), score_mod=doc_bias, mask_mod=doc_mask_w,
                               mod_args=(docs, 0.01))
        assert len(plan_runs) - before == (call > 0), "calls after the first must run through the plan"
        dout = cuda.to_device(np.random.default_rng(call).standard_normal(q.shape).astype(np.float16))
        grads = numba_flash.attention_bwd(dout, *dev, out, lse, score_mod=doc_bias, score_mod_grad=doc_bias_grad,
                                          mask_mod=doc_mask_w, mod_args=args)
        again = numba_flash.attention_bwd(dout, *dev, out, lse, score_mod=doc_bias, score_mod_grad=doc_bias_grad,
                                          mask_mod=doc_mask_w, mod_args=args)
        assert all(host(a).tobytes() == host(b).tobytes() for a, b in zip(grads, again))   # the plan's = the full path's
    runs = len(plan_runs)
    numba_flash.attention_fwd(*dev, score_mod=doc_bias, mask_mod=doc_mask_w, mod_args=(args[0], 0.02))
    numba_flash.attention_fwd(*dev, score_mod=doc_bias, mask_mod=doc_mask_w, mod_args=(docs, 0.01))
    assert len(plan_runs) == runs, "another number, or NumPy mod_args, must take the full path"


@GPU_ONLY
@pytest.mark.parametrize("dtype,nq,hq,hkv,page,n_new,kind", [
    ("bfloat16", 1, 8, 2, 0, 0, "numba"),     # decoding with grouped heads (a group's rows in one block)
    ("float16", 1, 4, 4, 16, 1, "numba"),     # a paged cache, appending a row each step
    ("float32", 3, 2, 1, 0, 2, "numba"),      # a few queries a step on the CUDA-core kernels, appends
    ("bfloat16", 1, 8, 2, 32, 1, "torch"),    # PyTorch tensors: paged, grouped heads, appends
])
def test_kvcache_repeat_calls_take_the_short_path(dtype, nq, hq, hkv, page, n_new, kind, plan_runs, monkeypatch):
    """Decoding steps: the first call leaves a plan, later ones (other cache_seqlens, fresh
    queries and appended rows) run it after checking their metadata only, and every step's
    result (and the appended cache rows) match the oracle; bad metadata still gets the
    full path's errors."""
    from numba_flash import varlen
    from test_varlen import _check, _heads_first
    monkeypatch.setattr(varlen, "_KV_CALLS", {})
    monkeypatch.setattr(_plans, "_STAGING", {})
    monkeypatch.setattr(_plans._Staging, "SLOTS", 2)      # the steps wrap the ring of pinned uploads
    if kind == "torch":
        torch = pytest.importorskip("torch")

        def dev(x):
            if x.dtype == np_dtype("bfloat16"):
                return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).cuda()
            return torch.from_numpy(x).cuda()
    else:
        dev = numba_flash.to_device
    rng = np.random.default_rng(30 + nq)
    dt = np_dtype(dtype)
    b, nmax, d = 3, 96, 64
    if page:
        max_pages = nmax // page
        table = rng.permutation(b * max_pages + 3)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
        kc, vc = (rng.standard_normal((b * max_pages + 3, page, hkv, d)).astype(dt) for _ in range(2))
        rows = lambda c, i: np.concatenate([c[p] for p in table[i]])    # noqa: E731  sequence i's cache rows
        extra = {"block_table": table}
    else:
        kc, vc = (rng.standard_normal((b, nmax, hkv, d)).astype(dt) for _ in range(2))
        rows = lambda c, i: c[i]                                        # noqa: E731
        extra = {}
    kc_d, vc_d = dev(kc), dev(vc)
    for step in range(4):
        lens = rng.integers(0, nmax - n_new + 1, b)
        lens[step % b] = nmax - n_new             # one sequence with a full cache each step
        q = rng.standard_normal((b, nq, hq, d)).astype(dt)
        new = {}
        if n_new:
            kn, vn = (rng.standard_normal((b, n_new, hkv, d)).astype(dt) for _ in range(2))
            new = {"k_new": dev(kn), "v_new": dev(vn)}
        out, lse = numba_flash.attention_with_kvcache(dev(q), kc_d, vc_d, lens.astype(np.int32),
                                                      causal=True, return_lse=True, **new, **extra)
        out, lse = host(out), host(lse)
        kc_now, vc_now = host(kc_d), host(vc_d)
        for i in range(b):
            k_i, v_i = rows(kc_now, i), rows(vc_now, i)
            if n_new:
                np.testing.assert_array_equal(k_i[lens[i]:lens[i] + n_new].view(np.uint8), kn[i].view(np.uint8))
                np.testing.assert_array_equal(v_i[lens[i]:lens[i] + n_new].view(np.uint8), vn[i].view(np.uint8))
            n = lens[i] + n_new
            _check(dtype, _heads_first(out[i]), np.ascontiguousarray(lse[i].T), _heads_first(q[i]),
                   _heads_first(k_i[:n]), _heads_first(v_i[:n]), dict(causal=True))
        assert len(varlen._KV_CALLS) == 1 and len(plan_runs) == step, "steps after the first take the short path"
    q_d = dev(q)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, Nmax=96\]"):
        numba_flash.attention_with_kvcache(q_d, kc_d, vc_d, np.array([0, 97, 0], np.int32), causal=True,
                                           **new, **extra)
    if n_new:
        with pytest.raises(ValueError, match="the cache overflows: sequence 1"):
            numba_flash.attention_with_kvcache(q_d, kc_d, vc_d, np.array([0, 96, 0], np.int32), causal=True,
                                               **new, **extra)
    if page:
        bad = table.copy()
        bad[2, 0] = -1
        with pytest.raises(ValueError, match=r"block_table\[2\] names page -1"):
            numba_flash.attention_with_kvcache(q_d, kc_d, vc_d, np.array([0, 0, 5], np.int32), causal=True,
                                               block_table=bad, **new)
