"""Device-side building blocks that need LLVM IR or PTX, each with a simulator twin.

This is the only module that speaks LLVM IR. Every operation here has two
implementations with the same semantics:

* compiled: a numba ``@intrinsic`` that emits the instruction we want;
* simulator: plain Python, because the simulator cannot run intrinsics.

``SIMULATOR`` (from ``_runtime``) picks one at import time, so kernels call
``ops.ld_shared_x4(...)`` and run unchanged in both modes.
"""
from llvmlite import ir
from numba import cuda, types

from ._runtime import SIMULATOR


def _elem_ptr(ctx, builder, aryty, ary, idxty, idx):
    """LLVM pointer to ``ary[idx]`` of a 1-D array (no bounds check, no wraparound)."""
    from numba.cuda import cgutils
    arr = ctx.make_array(aryty)(ctx, builder, ary)
    idx = ctx.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(ctx, builder, aryty, arr, [idx])


if not SIMULATOR:
    from numba.cuda.extending import intrinsic

    @intrinsic
    def ld_shared_x4(typingctx, ary, idx):
        """``(a[i], a[i+1], a[i+2], a[i+3])`` of a 1-D float32 shared array as one ``ld.shared.v4.f32``.

        The caller guarantees ``i % 4 == 0`` and a 16-byte aligned array base; nothing checks it.
        """
        if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype == types.float32
                and isinstance(idx, types.Integer)):
            return None
        rty = types.UniTuple(types.float32, 4)

        def codegen(ctx, builder, sig, args):
            p = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1], args[1])
            vec = ir.VectorType(ir.FloatType(), 4)
            p = builder.addrspacecast(p, ir.PointerType(ir.FloatType(), 3))
            v = builder.load(builder.bitcast(p, ir.PointerType(vec, 3)), align=16)
            return ctx.make_tuple(builder, rty, [builder.extract_element(v, ir.IntType(32)(i)) for i in range(4)])

        return rty(ary, idx), codegen

    @cuda.jit(device=True, inline="always")
    def ld_x4(a, i):
        """Four consecutive elements as scalar loads (any dtype; no alignment needed)."""
        return a[i], a[i + 1], a[i + 2], a[i + 3]

else:
    def ld_shared_x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    ld_x4 = ld_shared_x4
