"""Device-side building blocks that need LLVM IR or PTX, each with a simulator twin.

This module and ``ops_hopper`` (sm_90a instructions, GPU only) are the only ones
that speak LLVM IR. Every operation here has two
implementations with the same semantics:

* compiled: a numba ``@intrinsic`` that emits the instruction we want;
* simulator: plain Python, because the simulator cannot run intrinsics.

``SIMULATOR`` (from ``_runtime``) picks one at import time, so kernels call
``ops.ld_shared_x4(...)`` and run unchanged in both modes.

Operations: 128-bit accesses (``ld_shared_x4``, ``ld_global_x4``, ``st_shared_x4``);
asynchronous copies (``cp_async16`` from 4-D and ``cp_async16_2d`` from 2-D arrays,
``cp_async16_rows``, ``cp_async_commit``, ``cp_async_wait``); special functions
(``exp2_approx``, ``tanh_approx``, ``rcp_approx``; ``exp2_fma``: 2^x without the
special-function unit); tensor cores: TF32 (``tf32_round``, ``mma_tf32_m16n8k8``) and 16-bit (``ldmatrix_x4``, ``ldmatrix_x4_trans``,
``mma_bf16_m16n8k16``, ``mma_f16_m16n8k16``, ``pack_bf16x2``, ``pack_f16x2``), emulated
in the simulator by a warp rendezvous, as ``warp`` does for shuffles.

16-bit fragments. ``g = lane >> 2``, ``t = lane & 3``; a 32-bit register holds two
16-bit values, the lower column (or row, for B) in its low half. For ``m16n8k16``
(PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; checked on an
H200)::

     A (16×16, row-major)         B (16×8, "col": B[k, n])       C, D (16×8, float32)
     a0 = A[g,   2t : 2t+2]       b0 = B[2t   : 2t+2,  g]        c0, c1 = C[g,   2t : 2t+2]
     a1 = A[g+8, 2t : 2t+2]       b1 = B[2t+8 : 2t+10, g]        c2, c3 = C[g+8, 2t : 2t+2]
     a2 = A[g,   2t+8 : 2t+10]
     a3 = A[g+8, 2t+8 : 2t+10]

``ldmatrix_x4`` loads four 8×8 16-bit matrices from shared memory; lane ``8i + r``
supplies the address of row ``r`` of matrix ``i`` (16 contiguous bytes), and register
``i`` of lane ``4g + t`` receives ``M_i[g, 2t : 2t+2]`` (``.trans``: ``M_iᵀ[g, 2t : 2t+2]``,
i.e. ``M_i[2t, g]`` and ``M_i[2t+1, g]``). So the C fragment of one ``mma`` is, packed in
pairs, the A fragment of the next: S = Q Kᵀ feeds O += P V with no data movement.
"""
from llvmlite import ir
from numba import cuda, types

from ._runtime import SIMULATOR

# ``exp2_fma``: 2^x = 2^j · 2^f with j = round(x), f = x − j in [−1/2, 1/2]. Adding 1.5·2²³
# rounds x to an integer held in the sum's low mantissa bits; 2^f is a degree-4 polynomial
# (coefficients c0..c4, float32, fitted to the relative error: at most 2.7e-6 in float32
# arithmetic, the special-function unit's ex2 2 ulp = 2.4e-7; P is then rounded to
# 16 bits, 2⁻⁹ or 2⁻¹²); 2^j is j added to its exponent field. x is clamped at −127 so
# the sum stays an integer of a few bits, and x < −125 gives 0 (ex2.approx.ftz gives 0
# below −126: both are below 2⁻¹²⁵ relative to a row's largest term, 1). NaN is passed on by
# a select of its own (the integer add would make the canonical NaN's bits a finite number).
EXP2_POLY = tuple(float.fromhex(h) for h in ("0x1.ffffe8p-1", "0x1.62e0dcp-1", "0x1.ec06dap-3", "0x1.ca1442p-5",
                                              "0x1.3997d2p-7"))
EXP2_POLY_ROUND = 12582912.0        # 1.5 · 2²³
EXP2_POLY_FLOOR = -127.0
EXP2_POLY_ZERO = -125.0


def _elem_ptr(ctx, builder, aryty, ary, idxtys, idxs):
    """LLVM pointer to ``ary[idx0, idx1, ...]`` (no bounds check, no wraparound)."""
    from numba.cuda import cgutils
    arr = ctx.make_array(aryty)(ctx, builder, ary)
    idxs = [ctx.cast(builder, i, t, types.intp) for i, t in zip(idxs, idxtys)]
    return cgutils.get_item_pointer(ctx, builder, aryty, arr, idxs)


if not SIMULATOR:
    from numba.cuda.extending import intrinsic

    def _ld_f32x4_codegen(addrspace):
        """Codegen of a 128-bit float32 load from ``ary[indices...]`` in ``addrspace``
        (1 global, 3 shared); arguments: the array, then one index per dim."""
        def codegen(ctx, builder, sig, args):
            p = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:], args[1:])
            vec = ir.VectorType(ir.FloatType(), 4)
            p = builder.addrspacecast(p, ir.PointerType(ir.FloatType(), addrspace))
            v = builder.load(builder.bitcast(p, ir.PointerType(vec, addrspace)), align=16)
            return ctx.make_tuple(builder, sig.return_type,
                                  [builder.extract_element(v, ir.IntType(32)(i)) for i in range(4)])
        return codegen

    @intrinsic
    def ld_shared_x4(typingctx, ary, idx):
        """``(a[i], a[i+1], a[i+2], a[i+3])`` of a 1-D float32 shared array as one ``ld.shared.v4.f32``.

        The caller guarantees ``i % 4 == 0`` and a 16-byte aligned array base; nothing checks it.
        """
        if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype == types.float32
                and isinstance(idx, types.Integer)):
            return None
        rty = types.UniTuple(types.float32, 4)

        return rty(ary, idx), _ld_f32x4_codegen(3)

    @cuda.jit(device=True, inline="always")
    def ld_x4(a, i):
        """Four consecutive elements as scalar loads (any dtype; no alignment needed)."""
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    def _cp_async16_codegen(ctx, builder, sig, args, rows=None):
        """``cp.async.cg.shared.global.L2::128B [dst + dst_idx], [&src[indices...]], 16, src_bytes``;
        arguments: dst, dst_idx, src, one index per dim of src, src_bytes. ``rows`` (the
        LLVM value of an index): the source address moves on by that many row strides
        (the stride of src's second-to-last dim)."""
        from numba.cuda import cgutils
        d = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
        d = builder.ptrtoint(builder.addrspacecast(d, ir.PointerType(d.type.pointee, 3)), ir.IntType(32))
        g = _elem_ptr(ctx, builder, sig.args[2], args[2], sig.args[3:-1], args[3:-1])
        if rows is not None:
            strides = cgutils.unpack_tuple(builder, ctx.make_array(sig.args[2])(ctx, builder, args[2]).strides,
                                           sig.args[2].ndim)
            g = builder.gep(builder.bitcast(g, ir.IntType(8).as_pointer()), [builder.mul(rows, strides[-2])])
        g = builder.ptrtoint(builder.addrspacecast(g, ir.PointerType(g.type.pointee, 1)), ir.IntType(64))
        n = ctx.cast(builder, args[-1], sig.args[-1], types.uint32)
        fty = ir.FunctionType(ir.VoidType(), [ir.IntType(32), ir.IntType(64), ir.IntType(32)])
        # ``.L2::128B``: L2 fetches the whole 128-byte line a copy falls in. The one-warp
        # decoding kernel's streams of K/V rows ran 2-3% faster with it on an H200 (DRAM
        # 86.6 -> 89.6% of peak), the 8-warp and CUDA-core kernels unchanged, ``.L2::256B``
        # no faster (docs/performance.md, item 66).
        asm = ir.InlineAsm(fty, "cp.async.cg.shared.global.L2::128B [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [d, g, n])
        return ctx.get_dummy_value()

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

        return types.void(dst, dst_idx, src, i0, i1, i2, i3, src_bytes), _cp_async16_codegen

    @intrinsic
    def cp_async16_rows(typingctx, dst, dst_idx, src, i0, i1, i2, i3, rows, src_bytes):
        """``cp_async16`` from ``src[i0, i1, i2 + rows, i3:...]``, addressed as the element
        ``src[i0, i1, i2, i3]`` plus ``rows`` row strides: a copy loop that varies ``rows``
        computes the 4-D index once. Same contract as ``cp_async16`` (the address of
        ``src[i0, i1, i2 + rows, i3]`` is what must be valid)."""
        if not (isinstance(dst, types.Array) and dst.ndim == 1 and isinstance(src, types.Array)
                and src.ndim == 4 and isinstance(rows, types.Integer)):
            return None

        def codegen(ctx, builder, sig, args):
            rows = ctx.cast(builder, args[7], sig.args[7], types.intp)
            keep = [i for i in range(9) if i != 7]          # the cp_async16 arguments
            return _cp_async16_codegen(ctx, builder, sig.replace(args=tuple(sig.args[i] for i in keep)),
                                       [args[i] for i in keep], rows)

        return types.void(dst, dst_idx, src, i0, i1, i2, i3, rows, src_bytes), codegen

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

    @intrinsic
    def ld_global_x4(typingctx, ary, row, col):
        """``(a[r, c], a[r, c+1], a[r, c+2], a[r, c+3])`` of a 2-D float32 global array as one
        ``ld.global.v4.f32`` (128 bits).

        The caller guarantees a 16-byte aligned address (``c % 4 == 0``, rows a multiple of
        16 bytes long, 16-byte aligned base); nothing checks it.
        """
        if not (isinstance(ary, types.Array) and ary.ndim == 2 and ary.dtype == types.float32
                and isinstance(row, types.Integer) and isinstance(col, types.Integer)):
            return None
        rty = types.UniTuple(types.float32, 4)

        return rty(ary, row, col), _ld_f32x4_codegen(1)

    @intrinsic
    def st_shared_x4(typingctx, ary, idx, x0, x1, x2, x3):
        """``a[i:i+4] = (x0, x1, x2, x3)`` into a 1-D float32 shared array as one ``st.shared.v4.f32``.

        The caller guarantees ``i % 4 == 0`` and a 16-byte aligned array base; nothing checks it.
        """
        if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype == types.float32
                and isinstance(idx, types.Integer)
                and all(isinstance(x, (types.Float, types.Integer)) for x in (x0, x1, x2, x3))):
            return None

        def codegen(ctx, builder, sig, args):
            p = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:2], args[1:2])
            vec = ir.VectorType(ir.FloatType(), 4)
            v = ir.Constant(vec, ir.Undefined)
            for i in range(4):
                x = ctx.cast(builder, args[2 + i], sig.args[2 + i], types.float32)
                v = builder.insert_element(v, x, ir.IntType(32)(i))
            p = builder.addrspacecast(p, ir.PointerType(ir.FloatType(), 3))
            builder.store(v, builder.bitcast(p, ir.PointerType(vec, 3)), align=16)
            return ctx.get_dummy_value()

        return types.void(ary, idx, x0, x1, x2, x3), codegen

    @intrinsic
    def cp_async16_2d(typingctx, dst, dst_idx, src, row, col, src_bytes):
        """``cp_async16`` from a 2-D global array: ``src[row, col:...] -> dst[dst_idx:...]``.

        Same contract as ``cp_async16``: 16-byte aligned addresses, ``src_bytes`` 0 or 16
        (0 writes zeros; keep the source address valid anyway), complete at ``cp_async_wait``.
        """
        if not (isinstance(dst, types.Array) and dst.ndim == 1 and isinstance(src, types.Array)
                and src.ndim == 2):
            return None

        return types.void(dst, dst_idx, src, row, col, src_bytes), _cp_async16_codegen

    @intrinsic
    def tf32_round(typingctx, x):
        """``x`` rounded to TF32 (8-bit exponent, 10-bit mantissa; nearest, ties away from zero)
        by ``cvt.rna.tf32.f32``, returned as a float32 whose low 13 mantissa bits are zero."""
        if not isinstance(x, types.Float):
            return None

        def codegen(ctx, builder, sig, args):
            f = ctx.cast(builder, args[0], sig.args[0], types.float32)
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.FloatType()]), "cvt.rna.tf32.f32 $0, $1;",
                               "=r,f")
            return builder.bitcast(builder.call(asm, [f]), ir.FloatType())

        return types.float32(x), codegen

    @intrinsic
    def tf32_round_fast(typingctx, x):
        """``tf32_round`` for finite ``x`` in two integer instructions (add half of the
        dropped 13 bits to the bit pattern, clear them): ``cvt.rna.tf32.f32`` compiles to
        the same two plus an infinity test. Infinities and NaNs are not preserved."""
        if not isinstance(x, types.Float):
            return None

        def codegen(ctx, builder, sig, args):
            f = ctx.cast(builder, args[0], sig.args[0], types.float32)
            bits = builder.bitcast(f, ir.IntType(32))
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [ir.IntType(32)]),
                               "{ .reg .b32 t; add.u32 t, $1, 4096; and.b32 $0, t, -8192; }", "=r,r")
            return builder.bitcast(builder.call(asm, [bits]), ir.FloatType())

        return types.float32(x), codegen

    @intrinsic
    def mma_tf32_m16n8k8(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """One warp-wide ``D = A·B + C`` on tensor cores, ``A`` 16×8 (TF32), ``B`` 8×8 (TF32),
        ``C``/``D`` 16×8 (float32): ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32``.

        All 32 lanes call it together (convergent, full warp). Each lane passes its fragments
        and gets its four elements of D. With ``g = lane >> 2`` and ``t = lane & 3`` (PTX ISA,
        "Matrix Fragments for mma.m16n8k8", .tf32)::

                 A (16×8, row-major)            B (8×8, "col")            C, D (16×8)
                 k: 0..3     4..7               n: 0 .. 7                 n: 2t   2t+1
            row g    a0        a2           k=t     b0 (n = g)       row g     c0    c1
            row g+8  a1        a3           k=t+4   b1 (n = g)       row g+8   c2    c3
                   (col t)  (col t+4)

            a0 = A[g, t]    a1 = A[g+8, t]    a2 = A[g, t+4]    a3 = A[g+8, t+4]
            b0 = B[t, g]    b1 = B[t+4, g]
            c0 = C[g, 2t]   c1 = C[g, 2t+1]   c2 = C[g+8, 2t]   c3 = C[g+8, 2t+1]

        Pass A and B values already rounded with ``tf32_round``: the tensor core reads only
        the TF32 bits of each operand. (Layout from the PTX ISA; the m16n8k16 bf16 layout of
        the same family was checked on an H200, this one has not been run on hardware yet.)
        """
        if not all(isinstance(x, types.Float) for x in (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)):
            return None
        rty = types.UniTuple(types.float32, 4)

        def codegen(ctx, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            vals = [ctx.cast(builder, a, t, types.float32) for a, t in zip(args, sig.args)]
            ops_in = [builder.bitcast(x, i32) for x in vals[:6]] + vals[6:]
            fty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(
                fty, "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                     "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, ops_in)
            return ctx.make_tuple(builder, rty, [builder.extract_value(res, i) for i in range(4)])

        return rty(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen

    def _ldmatrix(trans):
        suffix = ".trans" if trans else ""

        def ldmatrix(typingctx, ary, idx):
            if not (isinstance(ary, types.Array) and ary.ndim == 1 and ary.dtype.bitwidth == 16
                    and isinstance(idx, types.Integer)):
                return None
            rty = types.UniTuple(types.uint32, 4)

            def codegen(ctx, builder, sig, args):
                p = _elem_ptr(ctx, builder, sig.args[0], args[0], sig.args[1:], args[1:])
                p = builder.ptrtoint(builder.addrspacecast(p, ir.PointerType(p.type.pointee, 3)), ir.IntType(32))
                i32 = ir.IntType(32)
                asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 4), [i32]),
                                   f"ldmatrix.sync.aligned.m8n8.x4{suffix}.shared.b16 {{$0, $1, $2, $3}}, [$4];",
                                   "=r,=r,=r,=r,r,~{memory}", side_effect=True)
                res = builder.call(asm, [p])
                return ctx.make_tuple(builder, rty, [builder.extract_value(res, i) for i in range(4)])

            return rty(ary, idx), codegen
        ldmatrix.__doc__ = (f"Four 8×8 16-bit matrices from a 1-D shared array (``ldmatrix...x4{suffix}``): "
                            "``idx`` is this lane's row start (16-byte aligned); see the module docstring.")
        return intrinsic(ldmatrix)

    ldmatrix_x4 = _ldmatrix(False)
    ldmatrix_x4_trans = _ldmatrix(True)

    def _mma_m16n8k16(ab):
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            if not (all(isinstance(x, types.Integer) for x in (a0, a1, a2, a3, b0, b1))
                    and all(isinstance(x, types.Float) for x in (c0, c1, c2, c3))):
                return None
            rty = types.UniTuple(types.float32, 4)

            def codegen(ctx, builder, sig, args):
                f32, i32 = ir.FloatType(), ir.IntType(32)
                ins = ([ctx.cast(builder, a, t, types.uint32) for a, t in zip(args[:6], sig.args[:6])]
                       + [ctx.cast(builder, a, t, types.float32) for a, t in zip(args[6:], sig.args[6:])])
                fty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(
                    fty, f"mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32 "
                         "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                res = builder.call(asm, ins)
                return ctx.make_tuple(builder, rty, [builder.extract_value(res, i) for i in range(4)])

            return rty(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3), codegen
        mma.__doc__ = (f"Warp-wide ``D = A·B + C``, A 16×16 and B 16×8 in {ab} (packed pairs, uint32), "
                       f"C and D 16×8 float32: ``mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32``. "
                       "All 32 lanes call it together; fragments: see the module docstring.")
        return intrinsic(mma)

    mma_bf16_m16n8k16 = _mma_m16n8k16("bf16")
    mma_f16_m16n8k16 = _mma_m16n8k16("f16")

    def _pack(kind):
        def pack(typingctx, lo, hi):
            if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
                return None

            def codegen(ctx, builder, sig, args):
                lo_, hi_ = (ctx.cast(builder, a, t, types.float32) for a, t in zip(args, sig.args))
                f32 = ir.FloatType()
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]),
                                   f"cvt.rn.{kind}x2.f32 $0, $1, $2;", "=r,f,f")
                return builder.call(asm, [hi_, lo_])     # PTX puts its first source in the upper half
            return types.uint32(lo, hi), codegen
        pack.__doc__ = (f"``(lo, hi)`` rounded to nearest-even {kind} and packed into one uint32, ``lo`` in "
                        f"bits 0-15 (``cvt.rn.{kind}x2.f32``).")
        return intrinsic(pack)

    pack_bf16x2 = _pack("bf16")
    pack_f16x2 = _pack("f16")

    def _unary_f32(instr, doc):
        def op(typingctx, x):
            if not isinstance(x, types.Float):
                return None

            def codegen(ctx, builder, sig, args):
                f = ctx.cast(builder, args[0], sig.args[0], types.float32)
                asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.FloatType()]), f"{instr} $0, $1;", "=f,f")
                return builder.call(asm, [f])
            return types.float32(x), codegen
        op.__doc__ = doc
        return intrinsic(op)

    def _widen(kind):
        def widen(typingctx, bits):
            if not isinstance(bits, types.Integer):
                return None

            def codegen(ctx, builder, sig, args):
                b = builder.trunc(args[0], ir.IntType(16)) if sig.args[0].bitwidth > 16 else args[0]
                if kind == "bf16":      # the upper half of a float32
                    return builder.bitcast(builder.shl(builder.zext(b, ir.IntType(32)), ir.IntType(32)(16)),
                                           ir.FloatType())
                return builder.fpext(builder.bitcast(b, ir.HalfType()), ir.FloatType())
            return types.float32(bits), codegen
        widen.__doc__ = f"The float32 value of {kind} bits (the low 16 bits of an integer): exact."
        return intrinsic(widen)

    bf16_to_f32 = _widen("bf16")
    f16_to_f32 = _widen("f16")

    tanh_approx = _unary_f32("tanh.approx.f32", "``tanh(x)`` in float32 by the special-function unit "
                             "(``tanh.approx.f32``, one instruction): relative error at most 2⁻¹¹ by the PTX "
                             "manual, 2⁻¹⁶·⁶ measured on an H200 (docs/performance.md).")
    rcp_approx = _unary_f32("rcp.approx.ftz.f32", "``1 / x`` in float32 by the special-function unit "
                            "(``rcp.approx.ftz.f32``, one instruction): within 1 ulp; subnormals flush to zero.")
    exp2_approx = _unary_f32("ex2.approx.ftz.f32", "``2^x`` in float32 by the special-function unit "
                             "(``ex2.approx.ftz.f32``, one instruction; ``math.exp2`` adds three to keep "
                             "subnormal results): within 2 ulp; results below 2⁻¹²⁶ flush to zero.")

    @intrinsic
    def exp2_fma(typingctx, x):
        """``2^x`` for ``x <= 0`` in float32 on the FMA and integer units, none on the
        special-function unit (:data:`EXP2_POLY` says how)."""
        if not isinstance(x, types.Float):
            return None

        def codegen(ctx, builder, sig, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            x = ctx.cast(builder, args[0], sig.args[0], types.float32)
            fma = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
            low = f32(EXP2_POLY_FLOOR)
            xc = builder.select(builder.fcmp_ordered("<", x, low), low, x)
            t = builder.fadd(xc, f32(EXP2_POLY_ROUND))          # round(x) in the low bits
            f = builder.fsub(xc, builder.fsub(t, f32(EXP2_POLY_ROUND)))    # x - round(x), in [-1/2, 1/2]
            p = f32(EXP2_POLY[-1])
            for c in EXP2_POLY[-2::-1]:
                p = builder.call(fma, [p, f, f32(c)])
            bits = builder.add(builder.bitcast(p, i32), builder.shl(builder.bitcast(t, i32), i32(23)))
            y = builder.bitcast(bits, f32)
            y = builder.select(builder.fcmp_ordered("<", x, f32(EXP2_POLY_ZERO)), f32(0.0), y)
            return builder.select(builder.fcmp_unordered("uno", x, x), x, y)
        return types.float32(x), codegen

else:
    def ld_shared_x4(a, i):
        return a[i], a[i + 1], a[i + 2], a[i + 3]

    ld_x4 = ld_shared_x4

    import types as _types

    from . import _simulator

    def _groups():
        """This simulated thread's committed cp.async groups and its open one."""
        t = _simulator.current_thread()
        st = t.__dict__.get("_cp_async")
        if st is None:
            st = t._cp_async = _types.SimpleNamespace(groups=[], open=[])
        return st

    def cp_async16(dst, dst_idx, src, i0, i1, i2, i3, src_bytes):
        # Deferred until cp_async_wait, as late as the hardware may complete it, so a
        # kernel that reads the tile before waiting reads stale data and fails its test.
        n = 16 // dst.itemsize
        k = int(src_bytes) // dst.itemsize
        vals = [src[i0, i1, i2, i3 + e] if e < k else 0 for e in range(n)]
        _groups().open.append((dst, int(dst_idx), vals))

    def cp_async16_rows(dst, dst_idx, src, i0, i1, i2, i3, rows, src_bytes):
        cp_async16(dst, dst_idx, src, i0, i1, i2 + rows, i3, src_bytes)

    def cp_async_commit():
        st = _groups()
        st.groups.append(st.open)
        st.open = []

    def cp_async_wait(n):
        st = _groups()
        while len(st.groups) > n:
            for dst, i, vals in st.groups.pop(0):
                dst[i:i + len(vals)] = vals


    def ld_global_x4(a, row, col):
        return a[row, col], a[row, col + 1], a[row, col + 2], a[row, col + 3]

    def st_shared_x4(a, i, x0, x1, x2, x3):
        a[i], a[i + 1], a[i + 2], a[i + 3] = x0, x1, x2, x3

    def cp_async16_2d(dst, dst_idx, src, row, col, src_bytes):
        n = 16 // dst.itemsize
        k = int(src_bytes) // dst.itemsize
        vals = [src[row, col + e] if e < k else 0 for e in range(n)]
        _groups().open.append((dst, int(dst_idx), vals))

    import numpy as _np

    def tf32_round_fast(x):
        # Round the float32 bit pattern to 10 mantissa bits: add half of the dropped
        # 13 bits to the magnitude, then clear them (ties away from zero, like .rna).
        b = _np.float32(x).view(_np.uint32)
        return ((b + _np.uint32(0x1000)) & _np.uint32(0xFFFFE000)).view(_np.float32)

    def tf32_round(x):
        b = _np.float32(x).view(_np.uint32)
        if (b & _np.uint32(0x7F800000)) == _np.uint32(0x7F800000):   # inf, nan: unchanged
            return _np.float32(x)
        return tf32_round_fast(x)

    import struct as _struct

    def _tf32_bits(x):
        """What the tensor core reads of an operand: its TF32 bits (the low 13 are ignored)."""
        bits = _struct.unpack("<I", _struct.pack("<f", x))[0] & 0xFFFFE000
        return _struct.unpack("<f", _struct.pack("<I", bits))[0]

    def _acc_rz(c, x, y):
        """``c + Σ x·y`` summed in float64, then rounded toward zero to float32: the tensor
        core's fp32 accumulation truncates, and an emulation that rounds to nearest hides
        the bias that follows (measured on an H200: docs/ladder.md, rung 8)."""
        total = float(c) + sum(xi * yi for xi, yi in zip(x, y))
        f = _np.float32(total)
        if abs(float(f)) > abs(total):
            f = _np.nextafter(f, _np.float32(0))
        return f

    def mma_tf32_m16n8k8(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # Every lane publishes its A and B fragments (as the tensor core reads them) at a
        # warp rendezvous, then computes its own four elements of D = A·B + C from the
        # lanes that hold rows g, g+8 of A and columns 2t, 2t+1 of B (layout: see the
        # compiled version's docstring). Exact sum, truncated to float32 (_acc_rz).
        from . import warp
        mine = tuple(_tf32_bits(x) for x in (a0, a1, a2, a3, b0, b1))
        lane, frags = warp._exchange(warp.FULL_MASK, mine)
        g, t = lane >> 2, lane & 3
        rows = frags[4 * g:4 * g + 4]            # lane 4g + j holds A[g, j], A[g+8, j], A[g, j+4], A[g+8, j+4]
        a_g = [f[0] for f in rows] + [f[2] for f in rows]          # A[g, 0..7]
        a_g8 = [f[1] for f in rows] + [f[3] for f in rows]         # A[g+8, 0..7]
        b = []
        for n in (2 * t, 2 * t + 1):             # lane 4n + j holds B[j, n], B[j+4, n]
            cols = frags[4 * n:4 * n + 4]
            b.append([f[4] for f in cols] + [f[5] for f in cols])  # B[0..7, n]

        return (_acc_rz(c0, a_g, b[0]), _acc_rz(c1, a_g, b[1]), _acc_rz(c2, a_g8, b[0]), _acc_rz(c3, a_g8, b[1]))


    # ---------------------------------------------------------------- 16-bit tensor cores
    def _bf16_bits(x):
        """Nearest-even bfloat16 bit pattern of a float32 value (NaN stays NaN)."""
        b = int(_np.float32(x).view(_np.uint32))
        if (b & 0x7F800000) == 0x7F800000 and b & 0x7FFFFF:
            return (b >> 16) | 0x40
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF

    def _f16_bits(x):
        return int(_np.float16(_np.float32(x)).view(_np.uint16))

    def pack_bf16x2(lo, hi):
        return _np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))

    def bf16_to_f32(bits):
        return _np.uint32((int(bits) & 0xFFFF) << 16).view(_np.float32)

    def f16_to_f32(bits):
        return _np.float32(_np.uint16(int(bits) & 0xFFFF).view(_np.float16))

    def tanh_approx(x):
        return _np.float32(_np.tanh(_np.float32(x)))

    def rcp_approx(x):
        return _np.float32(1) / _np.float32(x)

    def exp2_approx(x):
        y = _np.float32(_np.exp2(_np.float32(x)))
        return _np.float32(0) if 0 < y < _np.float32(2.0 ** -126) else y    # NaN stays NaN

    def exp2_fma(x):
        f32 = _np.float32
        x = f32(x)
        if x != x:
            return x
        xc = f32(EXP2_POLY_FLOOR) if x < EXP2_POLY_FLOOR else x
        t = f32(xc + f32(EXP2_POLY_ROUND))
        f = f32(xc - f32(t - f32(EXP2_POLY_ROUND)))
        p = f32(EXP2_POLY[-1])
        for c in EXP2_POLY[-2::-1]:
            p = f32(float(p) * float(f) + float(c))         # (one rounding, as an FMA's, but twice)
        bits = (int(p.view(_np.uint32)) + (int(t.view(_np.uint32)) << 23)) & 0xFFFFFFFF
        return f32(0) if x < EXP2_POLY_ZERO else _np.uint32(bits).view(f32)

    def pack_f16x2(lo, hi):
        return _np.uint32(_f16_bits(lo) | (_f16_bits(hi) << 16))

    _HALF_VALUES = {}

    def _half_values(kind):
        """Every 16-bit pattern's value as a Python float (bf16 or f16): a table, built once."""
        found = _HALF_VALUES.get(kind)
        if found is None:
            bits = _np.arange(1 << 16, dtype=_np.uint32)
            halves = (bits << 16).view(_np.float32) if kind == "bf16" else bits.astype(_np.uint16).view(_np.float16)
            found = _HALF_VALUES[kind] = halves.astype(_np.float64).tolist()
        return found

    def _unpack(kind, reg):
        reg = int(reg)
        values = _half_values(kind)
        return [values[reg & 0xFFFF], values[reg >> 16]]

    def _ldmatrix_sim(trans):
        def ldmatrix(ary, idx):
            # Lane 8i + r names row r of matrix i; lane 4g + t receives M_i[g, 2t:2t+2]
            # (.trans: M_i[2t, g], M_i[2t+1, g]), the lower one in the low half.
            from . import warp
            lane, starts = warp._exchange(warp.FULL_MASK, int(idx))
            g, t = lane >> 2, lane & 3
            regs = []
            for i in range(4):
                if trans:
                    lo, hi = ary[starts[8 * i + 2 * t] + g], ary[starts[8 * i + 2 * t + 1] + g]
                else:
                    row = starts[8 * i + g]
                    lo, hi = ary[row + 2 * t], ary[row + 2 * t + 1]
                regs.append(_np.uint32(int(lo) | (int(hi) << 16)))
            return tuple(regs)
        return ldmatrix

    ldmatrix_x4 = _ldmatrix_sim(False)
    ldmatrix_x4_trans = _ldmatrix_sim(True)

    def _mma_m16n8k16_sim(kind):
        def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            # Every lane publishes its fragments; lane 4g + t then forms rows g, g+8 of A
            # and columns 2t, 2t+1 of B from the lanes that hold them (module docstring)
            # and sums exactly, truncating to float32 (_acc_rz).
            from . import warp
            lane, frags = warp._exchange(warp.FULL_MASK, (a0, a1, a2, a3, b0, b1))
            g, t = lane >> 2, lane & 3

            def a_row(r):          # A[r, 0..15]
                quad = frags[4 * (r % 8):4 * (r % 8) + 4]
                lo, hi = (0, 2) if r < 8 else (1, 3)
                return ([x for f in quad for x in _unpack(kind, f[lo])]
                        + [x for f in quad for x in _unpack(kind, f[hi])])

            def b_col(n):          # B[0..15, n]
                quad = frags[4 * n:4 * n + 4]
                return ([x for f in quad for x in _unpack(kind, f[4])]
                        + [x for f in quad for x in _unpack(kind, f[5])])

            ag, ag8, bn0, bn1 = a_row(g), a_row(g + 8), b_col(2 * t), b_col(2 * t + 1)
            return _acc_rz(c0, ag, bn0), _acc_rz(c1, ag, bn1), _acc_rz(c2, ag8, bn0), _acc_rz(c3, ag8, bn1)
        return mma

    mma_bf16_m16n8k16 = _mma_m16n8k16_sim("bf16")
    mma_f16_m16n8k16 = _mma_m16n8k16_sim("f16")
