"""Hopper (``sm_90a``) instructions for Python kernels: warpgroup MMA, TMA, mbarriers.

The building blocks of the FlashAttention-3 design (a producer warpgroup loading K/V
tiles with the TMA engine into a shared-memory ring guarded by mbarriers, consumer
warpgroups multiplying them with ``wgmma``), as ``@intrinsic`` functions like those of
``ops`` (this module speaks LLVM IR too). Compiled, they run on compute capability 9.0
GPUs only; ``python -m numba_flash.ptx`` and the tests compile them for ``(9, 0, "a")``
without a GPU. As in ``ops``, ``SIMULATOR`` picks at import time: in Numba's simulator
every public name here is replaced by its plain-Python twin of ``_hopper_sim`` (same
semantics: fake shared addresses, mbarrier phases, swizzled TMA boxes, warpgroup products
by NumPy), so the Hopper kernels also run, slowly, without a GPU.

Facts they rely on (checked on an H200 with numba-cuda 0.30.4):

* numba-cuda compiles for ``sm_90a`` by itself on a cc 9.0 device; offline,
  ``cc=(9, 0, "a")`` gives ``.target sm_90a`` (plain ``sm_90`` rejects ``wgmma`` and
  ``setmaxnreg``).
* An intrinsic has a fixed arity; ``wgmma`` accumulators travel as a ``UniTuple`` of
  float32 tied to the instruction's outputs (C++'s ``"+f"``), indexed with constants only
  (else they go to local memory).
* A ``CUtensorMap`` cannot be a by-value kernel parameter from Numba: it lives in a
  128-byte device array, read through its generic address after
  ``fence.proxy.tensormap::generic.acquire``.

Accumulator layout of ``wgmma.m64nNk16`` (f32): thread ``t`` of the warpgroup (warp
``w = t // 32``, ``g = (t % 32) // 4``, ``q = t % 4``) holds element ``i < N / 2`` at row
``16 w + g + 8 · ((i // 2) % 2)``, column ``8 · (i // 4) + 2 q + i % 2``. Columns
``16 s .. 16 s + 15`` of an accumulator, packed in pairs (elements ``8 s .. 8 s + 7``),
are the register A operand of the k-slice ``s`` of the next product (P·V after S = Q·Kᵀ),
as with ``mma.sync`` (``ops``).
"""
from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic

from ._runtime import SIMULATOR

I32, I64, F32, VOID = ir.IntType(32), ir.IntType(64), ir.FloatType(), ir.VoidType()
U32, U64 = types.uint32, types.uint64


def _asm(builder, rty, args, text, constraints, side_effect=True):
    fty = ir.FunctionType(rty, [a.type for a in args])
    return builder.call(ir.InlineAsm(fty, text, constraints, side_effect=side_effect), args)


def _void(text, argtys=(), constraints="", doc=""):
    """An intrinsic running ``text`` with arguments of the numba types ``argtys`` (fixed
    arity) and no result; it clobbers memory (the compiler keeps memory accesses in order
    around it)."""
    def typer(*args):
        if len(args) != len(argtys) or not all(isinstance(a, types.Integer) for a in args):
            return None

        def codegen(ctx, builder, sig, llargs):
            vals = [ctx.cast(builder, v, t, nt) for v, t, nt in zip(llargs, sig.args, argtys)]
            _asm(builder, VOID, vals, text, ",".join(filter(None, [constraints, "~{memory}"])))
            return ctx.get_dummy_value()
        return types.void(*args), codegen
    names = ", ".join(f"a{i}" for i in range(len(argtys)))
    ns = {"typer": typer}
    exec(f"def op(typingctx{', ' if names else ''}{names}):\n    return typer({names})", ns)
    ns["op"].__doc__ = doc or f"``{text}``"
    return intrinsic(ns["op"])


# --------------------------------------------------------------------------- fences, registers
wgmma_fence = _void("wgmma.fence.sync.aligned;", doc="Order register accesses before the next wgmma.")
wgmma_commit = _void("wgmma.commit_group.sync.aligned;", doc="Close the group of wgmma issued so far.")
fence_async_shared = _void("fence.proxy.async.shared::cta;",
                           doc="Make generic-proxy writes to shared memory visible to wgmma and TMA.")
fence_mbarrier_init = _void("fence.mbarrier_init.release.cluster;", doc="Publish mbarrier initialisation.")


def wgmma_wait(pending):
    """``wgmma.wait_group.sync.aligned pending``: wait until at most ``pending`` groups are in flight."""
    return _void(f"wgmma.wait_group.sync.aligned {int(pending)};")


def setmaxnreg(count, increase):
    """``setmaxnreg.{inc,dec}.sync.aligned.u32 count``: a warpgroup's register budget (count a
    multiple of 8 in 24..256); producers give registers up, consumers take them
    (``kernels.wgmma_parts.consumer_registers`` says how many they can)."""
    assert count % 8 == 0 and 24 <= count <= 256, count
    return _void(f"setmaxnreg.{'inc' if increase else 'dec'}.sync.aligned.u32 {count};")


named_barrier = _void("bar.sync $0, $1;", (U32, U32), "r,r",
                      "``bar.sync id, threads``: a barrier among ``threads`` threads (a multiple of 32) on id 1..15.")
named_arrive = _void("bar.arrive $0, $1;", (U32, U32), "r,r", "``bar.arrive id, threads``: arrive without waiting.")

# --------------------------------------------------------------------------- mbarriers (shared addresses, u32)
mbarrier_init = _void("mbarrier.init.shared::cta.b64 [$0], $1;", (U32, U32), "r,r",
                      "Initialise the mbarrier at a shared address for ``count`` arrivals.")
mbarrier_arrive = _void("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }", (U32,), "r",
                        "Arrive once on the mbarrier.")
mbarrier_arrive_expect_tx = _void("mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", (U32, U32), "r,r",
                                  "Arrive and expect ``bytes`` more from asynchronous copies.")


@intrinsic
def mbarrier_try_wait(typingctx, addr, parity):
    """1 if the mbarrier's phase of ``parity`` (0 or 1) has completed, else 0 (after a
    bounded wait): spin on it."""
    if not (isinstance(addr, types.Integer) and isinstance(parity, types.Integer)):
        return None

    def codegen(ctx, builder, sig, args):
        vals = [ctx.cast(builder, v, t, U32) for v, t in zip(args, sig.args)]
        return _asm(builder, I32, vals, "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; "
                    "selp.u32 $0, 1, 0, p; }", "=r,r,r,~{memory}")
    return U32(addr, parity), codegen


# --------------------------------------------------------------------------- shared words (shared addresses)
st_shared_v4 = _void("st.shared.v4.u32 [$0], {$1, $2, $3, $4};", (U32, U32, U32, U32, U32), "r,r,r,r,r",
                     "Store four 32-bit words (each value's low 32 bits) at a 16-byte aligned shared address.")


@intrinsic
def ld_shared_v4(typingctx, addr):
    """The four 32-bit words (int32) at a 16-byte aligned shared address, read where it
    stands (memory clobbered: after the waits before it, before the arrivals after it)."""
    if not isinstance(addr, types.Integer):
        return None
    rty = types.UniTuple(types.int32, 4)

    def codegen(ctx, builder, sig, args):
        at = ctx.cast(builder, args[0], sig.args[0], U32)
        words = _asm(builder, ir.LiteralStructType([I32] * 4), [at], "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];",
                     "=r,=r,=r,=r,r,~{memory}")
        return ctx.make_tuple(builder, rty, [builder.extract_value(words, k) for k in range(4)])
    return rty(addr), codegen


@intrinsic
def clock64(typingctx):
    """The multiprocessor's cycle counter (``%clock64``, uint64): the same clock for every
    thread of a block; read where it stands (volatile, memory clobbered). For traces
    (``forward_wgmma``'s ``trace``)."""
    def codegen(ctx, builder, sig, args):
        return _asm(builder, I64, [], "mov.u64 $0, %clock64;", "=l,~{memory}")
    return U64(), codegen


# --------------------------------------------------------------------------- addresses
@intrinsic
def shared_address(typingctx, ary):
    """The 32-bit shared-window address of a shared array's first element."""
    if not isinstance(ary, types.Array):
        return None

    def codegen(ctx, builder, sig, args):
        p = ctx.make_array(sig.args[0])(ctx, builder, args[0]).data
        return builder.ptrtoint(builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3)), I32)
    return U32(ary), codegen


@intrinsic
def global_address(typingctx, ary):
    """The 64-bit generic address of a device array's first element."""
    if not isinstance(ary, types.Array):
        return None

    def codegen(ctx, builder, sig, args):
        return builder.ptrtoint(ctx.make_array(sig.args[0])(ctx, builder, args[0]).data, I64)
    return U64(ary), codegen


# --------------------------------------------------------------------------- TMA
tensormap_acquire = _void("fence.proxy.tensormap::generic.acquire.gpu [$0], 128;", (U64,), "l",
                          "Make a tensor map written by the host visible to the TMA engine (its global address).")
tma_load_3d = _void("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                    "[$0], [$1, {$2, $3, $4}], [$5];", (U32, U64, types.int32, types.int32, types.int32, U32),
                    "r,l,r,r,r,r",
                    "TMA: the box of the tensor map (global address) at coordinates (c0, c1, c2), innermost "
                    "first, into shared memory; completes ``box bytes`` on the mbarrier. Out-of-bounds "
                    "elements are zero-filled.")

tma_load_4d = _void("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                    "[$0], [$1, {$2, $3, $4, $5}], [$6];",
                    (U32, U64, types.int32, types.int32, types.int32, types.int32, U32), "r,l,r,r,r,r,r",
                    "``tma_load_3d`` with four coordinates: a tensor map over the kernels' 4-D views "
                    "``(d, N, B2, B1)``, any strides.")


def smem_descriptor(lbo, sbo, swizzle):
    """An intrinsic ``(shared address) -> u64``: the wgmma matrix descriptor of the tile at that
    address: start address >> 4, leading-dimension byte offset ``lbo``, stride byte offset
    ``sbo``, layout ``swizzle`` (0 none, 1 128-byte, 2 64-byte, 3 32-byte)."""
    high = ((lbo >> 4) << 16) | ((sbo >> 4) << 32) | (swizzle << 62)

    @intrinsic
    def descriptor(typingctx, addr):
        if not isinstance(addr, types.Integer):
            return None

        def codegen(ctx, builder, sig, args):
            a = builder.zext(ctx.cast(builder, args[0], sig.args[0], U32), I64)
            return builder.or_(builder.lshr(builder.and_(a, I64(0x3FFFF)), I64(4)), I64(high))
        return U64(addr), codegen
    return descriptor


# --------------------------------------------------------------------------- warpgroup MMA
def _wgmma(n, dtype_name, a_in_registers, trans_b):
    kind = {"bfloat16": "bf16", "float16": "f16"}[dtype_name]
    assert n % 8 == 0 and 8 <= n <= 256, n
    regs = n // 2
    acc_t = types.UniTuple(types.float32, regs)
    d = "{" + ",".join(f"${i}" for i in range(regs)) + "}"
    head = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}"
    if a_in_registers:           # acc, a0..a3, desc_b, accumulate -> acc
        a = "{" + ",".join(f"${regs + i}" for i in range(4)) + "}"
        text = (f"{{ .reg .pred p; setp.ne.b32 p, ${regs + 5}, 0;\n"
                f"{head} {d}, {a}, ${regs + 4}, p, 1, 1, {trans_b}; }}")
        cons = ",".join(["=f"] * regs) + ",r,r,r,r,l,r," + ",".join(str(i) for i in range(regs))
        arg_types = (acc_t, U32, U32, U32, U32, U64, U32)
    else:                        # acc, desc_a, desc_b, accumulate -> acc
        text = (f"{{ .reg .pred p; setp.ne.b32 p, ${regs + 2}, 0;\n"
                f"{head} {d}, ${regs}, ${regs + 1}, p, 1, 1, 0, {trans_b}; }}")
        cons = ",".join(["=f"] * regs) + ",l,l,r," + ",".join(str(i) for i in range(regs))
        arg_types = (acc_t, U64, U64, U32)

    def typer(*args):
        def codegen(ctx, builder, sig, llargs):
            acc = [builder.extract_value(llargs[0], i) for i in range(regs)]
            rest = [ctx.cast(builder, v, t, nt) for v, t, nt in zip(llargs[1:], sig.args[1:], arg_types[1:])]
            r = _asm(builder, ir.LiteralStructType([F32] * regs), rest + acc, text, cons + ",~{memory}")
            return ctx.make_tuple(builder, acc_t, [builder.extract_value(r, i) for i in range(regs)])
        if len(args) != len(arg_types) or args[0] != acc_t:
            return None
        return acc_t(*args), codegen
    names = ", ".join(f"a{i}" for i in range(len(arg_types)))
    ns = {"typer": typer}
    exec(f"def op(typingctx, {names}):\n    return typer({names})", ns)
    ns["op"].__doc__ = (f"``{head}``: the 64 × {n} float32 accumulator tuple ({regs} per thread) plus "
                        + ("A (64 × 16, four packed registers per thread) times B (16 × n, a shared-memory "
                           "descriptor)" if a_in_registers else "A (64 × 16) times B (16 × n), both shared-memory "
                           "descriptors") + f"; B transposed (MN-major) if {trans_b}. ``accumulate`` 0 "
                        "overwrites the accumulator (its input values are then ignored).")
    return intrinsic(ns["op"])


def accumulator(n):
    """An intrinsic ``() -> acc``: the zero 64 × ``n`` float32 accumulator tuple of a warpgroup
    MMA (``n // 2`` per thread), to start a chain (or pass ``accumulate = 0``)."""
    regs = n // 2
    acc_t = types.UniTuple(types.float32, regs)

    @intrinsic
    def zeros(typingctx):
        def codegen(ctx, builder, sig, args):
            return ctx.make_tuple(builder, acc_t, [F32(0.0)] * regs)
        return acc_t(), codegen
    return zeros


@intrinsic
def scale_rows(typingctx, acc, row0, row1):
    """The accumulator tuple with its elements of row ``16 w + g`` times ``row0`` and those of
    row ``16 w + g + 8`` times ``row1`` (elements ``i`` with ``(i // 2) % 2`` 0 or 1): the
    online softmax's rescale of O, in registers."""
    if not (isinstance(acc, types.UniTuple) and acc.dtype == types.float32
            and isinstance(row0, types.Float) and isinstance(row1, types.Float)):
        return None

    def codegen(ctx, builder, sig, args):
        f = [ctx.cast(builder, v, t, types.float32) for v, t in zip(args[1:], sig.args[1:])]
        vals = [builder.fmul(builder.extract_value(args[0], i), f[(i // 2) % 2]) for i in range(acc.count)]
        return ctx.make_tuple(builder, acc, vals)
    return acc(acc, row0, row1), codegen


@intrinsic
def to_array(typingctx, acc, ary):
    """Store the accumulator tuple's elements into ``ary[0 .. n−1]`` (a local array) with
    constant indices, as straight-line code: a Python loop ``ary[i] = acc[i]`` indexes the
    tuple with a variable, which the compiler lowers to a copy through memory or a search
    when it does not unroll the loop. Later loops over ``ary`` then unroll into registers."""
    if not (isinstance(acc, types.UniTuple) and isinstance(ary, types.Array) and ary.ndim == 1):
        return None

    def codegen(ctx, builder, sig, args):
        data = ctx.make_array(sig.args[1])(ctx, builder, args[1]).data
        for i in range(acc.count):
            v = ctx.cast(builder, builder.extract_value(args[0], i), acc.dtype, ary.dtype)
            builder.store(v, builder.gep(data, [I32(i)]))
        return ctx.get_dummy_value()
    return types.void(acc, ary), codegen


_WGMMA = {}


def wgmma(n, dtype_name, a_in_registers=False, trans_b=0):
    """The ``wgmma.mma_async`` m64n{n}k16 intrinsic (float32 accumulators) for float16 or
    bfloat16 operands: ``wgmma(...)(acc, desc_a, desc_b, accumulate)`` or, with A in
    registers, ``(acc, a0, a1, a2, a3, desc_b, accumulate)``. Issue between
    :func:`wgmma_fence` and :func:`wgmma_commit`; read the result after :func:`wgmma_wait`."""
    key = (n, dtype_name, a_in_registers, int(trans_b))
    if key not in _WGMMA:
        _WGMMA[key] = _wgmma(*key)
    return _WGMMA[key]


# --------------------------------------------------------------------------- host: tensor maps
def tensor_map_4d(ary, box_rows, box_cols=64):
    """A TMA tensor map (in a 128-byte device array, for :func:`tensormap_acquire` and the
    ``tma_load_*`` intrinsics) over a 4-D device array ``(B1, B2, N, d)`` of 16-bit elements
    (float16/bfloat16 bits), any strides with a unit last one: dims ``(d, N, B2, B1)``,
    boxes of ``box_cols`` (at most 64: 128 bytes) × ``box_rows`` × 1 × 1, 128-byte swizzle,
    zero fill outside the array. Needs a GPU (the driver encodes it). The copy to the
    device is synchronous; ``families.tensor_map`` copies on the launch stream instead."""
    from numba import cuda
    return cuda.to_device(encode_tensor_map_4d(ary.__cuda_array_interface__["data"][0], tuple(ary.shape),
                                               tuple(ary.strides), box_rows, box_cols))


_ENCODE_CONSTANTS = {}    # (box_rows, box_cols) -> the arguments of every map with such boxes


def encode_tensor_map_4d(ptr, shape, strides, box_rows, box_cols=64, into=None):
    """The 128 bytes of :func:`tensor_map_4d`'s map of the view at device address ``ptr``
    with ``shape`` and byte ``strides``: as a NumPy uint8 array on the host, or written to
    the host address ``into`` (then None is returned)."""
    import ctypes

    import numpy as np
    from cuda.bindings import driver as cu

    assert len(shape) == 4 and strides[3] == 2 and box_cols * 2 <= 128, (shape, strides, box_cols)
    u64 = cu.cuuint64_t
    fixed = _ENCODE_CONSTANTS.get((box_rows, box_cols))
    if fixed is None:
        u32 = cu.cuuint32_t
        fixed = _ENCODE_CONSTANTS[box_rows, box_cols] = (
            [u32(box_cols), u32(box_rows), u32(1), u32(1)], [u32(1)] * 4,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE, cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    err, tmap = cu.cuTensorMapEncodeTiled(
        cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, ptr,
        [u64(shape[3]), u64(shape[2]), u64(shape[1]), u64(shape[0])],
        [u64(strides[2]), u64(strides[1]), u64(strides[0])], *fixed)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ValueError(f"cuTensorMapEncodeTiled failed ({err}) for shape {shape}, strides {strides}: TMA needs "
                         "16-byte aligned addresses and strides that are multiples of 16 bytes.")
    if into is not None:
        ctypes.memmove(into, tmap.getPtr(), 128)
        return None
    return np.frombuffer(ctypes.string_at(tmap.getPtr(), 128), np.uint8).copy()


# --------------------------------------------------------------------------- the simulator's twins
if SIMULATOR:
    # The simulator cannot run @intrinsic functions: every public name above gives way to its
    # twin (tests/test_hopper_ops.py checks that none is left out). Replaced rather than kept
    # in an ``if not SIMULATOR`` block so that the definitions above read as plain code.
    from . import _hopper_sim
    for _name in _hopper_sim.__all__:
        globals()[_name] = getattr(_hopper_sim, _name)
