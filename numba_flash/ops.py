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


def _elem_ptr(ctx, builder, aryty, ary, idxtys, idxs):
    """LLVM pointer to ``ary[idx0, idx1, ...]`` (no bounds check, no wraparound)."""
    from numba.cuda import cgutils
    arr = ctx.make_array(aryty)(ctx, builder, ary)
    idxs = [ctx.cast(builder, i, t, types.intp) for i, t in zip(idxs, idxtys)]
    return cgutils.get_item_pointer(ctx, builder, aryty, arr, idxs)


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
            p = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
            vec = ir.VectorType(ir.FloatType(), 4)
            p = builder.addrspacecast(p, ir.PointerType(ir.FloatType(), 3))
            v = builder.load(builder.bitcast(p, ir.PointerType(vec, 3)), align=16)
            return ctx.make_tuple(builder, rty, [builder.extract_element(v, ir.IntType(32)(i)) for i in range(4)])

        return rty(ary, idx), codegen

    @cuda.jit(device=True, inline="always")
    def ld_x4(a, i):
        """Four consecutive elements as scalar loads (any dtype; no alignment needed)."""
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    @intrinsic
    def cp_async16(typingctx, dst, dst_idx, src, i0, i1, i2, i3, src_bytes):
        """Asynchronous 16-byte copy ``src[i0, i1, i2, i3:...] -> dst[dst_idx:...]`` (``cp.async.cg``).

        ``dst`` is a 1-D shared array, ``src`` a 4-D global array. Only the first
        ``src_bytes`` (0 or 16) bytes are read; the rest of the 16 are zero-filled, so
        ``src_bytes = 0`` writes zeros (keep the source address valid anyway). Both
        addresses must be 16-byte aligned. Completes at ``cp_async_wait``.
        """
        if not (isinstance(dst, types.Array) and dst.ndim == 1 and isinstance(src, types.Array)
                and src.ndim == 4):
            return None

        def codegen(ctx, builder, sig, args):
            d = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
            d = builder.ptrtoint(builder.addrspacecast(d, ir.PointerType(d.type.pointee, 3)), ir.IntType(32))
            g = _elem_ptr(ctx, builder, sig.args[2], args[2], sig.args[3:7], args[3:7])
            g = builder.ptrtoint(builder.addrspacecast(g, ir.PointerType(g.type.pointee, 1)), ir.IntType(64))
            n = ctx.cast(builder, args[7], sig.args[7], types.uint32)
            fty = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
            asm = ir.InlineAsm(fty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                               side_effect=True)
            builder.call(asm, [d, g, n])
            return ctx.get_dummy_value()

        return types.void(dst, dst_idx, src, i0, i1, i2, i3, src_bytes), codegen

    @intrinsic
    def cp_async_commit(typingctx):
        """Close the current group of ``cp_async16`` copies (``cp.async.commit_group``)."""
        def codegen(ctx, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.commit_group;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return ctx.get_dummy_value()
        return types.void(), codegen

    @intrinsic
    def cp_async_wait(typingctx, n):
        """Wait until at most ``n`` (a literal) most recent groups are still in flight."""
        if not isinstance(n, types.IntegerLiteral):
            return None
        pending = n.literal_value

        def codegen(ctx, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), f"cp.async.wait_group {pending};",
                               "~{memory}", side_effect=True)
            builder.call(asm, [])
            return ctx.get_dummy_value()
        return types.void(n), codegen

else:
    def ld_shared_x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    ld_x4 = ld_shared_x4

    import threading
    _async = threading.local()   # per simulated thread: committed groups and the open one

    def _groups():
        if not hasattr(_async, "groups"):
            _async.groups, _async.open = [], []
        return _async

    def cp_async16(dst, dst_idx, src, i0, i1, i2, i3, src_bytes):
        # Deferred until cp_async_wait, as late as the hardware may complete it, so a
        # kernel that reads the tile before waiting reads stale data and fails its test.
        n = 16 // dst.itemsize
        k = int(src_bytes) // dst.itemsize
        vals = [src[i0, i1, i2, i3 + e] if e < k else 0 for e in range(n)]
        _groups().open.append((dst, int(dst_idx), vals))

    def cp_async_commit():
        st = _groups()
        st.groups.append(st.open)
        st.open = []

    def cp_async_wait(n):
        st = _groups()
        while len(st.groups) > n:
            for dst, i, vals in st.groups.pop(0):
                dst[i:i + len(vals)] = vals
