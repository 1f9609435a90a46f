"""``bench.py backward``: ``numba_flash.attention_bwd`` against the SDPA peers' autograd."""
import dataclasses
import sys
import traceback

import numpy as np

import numba_flash
from numba_flash import api, families, reference, registry, scores
from numba_flash.kernels.backward_mma import stats_rows

from ..harness import (MIB, Shape, forward_flops, make_dout, make_inputs, max_abs_err, spec_record,
                       time_numba, time_torch, to_host, uses_async)
from ..peers import add_peers, run_peer
from ..report import common_notes, make_columns, simulator_notes
from ..runner import new_record, run_mode


# per gradient: max abs err <= tol · max(1, max|oracle|); 16-bit as the forward's (P and dS are rounded)
BWD_TOLERANCE = {"float32": 3e-4, "float64": 1e-9, "float16": 4e-3, "bfloat16": 3e-2}
BWD_FULL_N = 1024            # validate on the timed inputs themselves up to this Nq and Nk ...
BWD_VALIDATE_N = 512         # ... else on a separate problem with N = this (same B, H, d, causal, dtype)
BWD_FLOP_FACTOR = 2.5        # FlashAttention convention: backward = 2.5 x forward FLOPs
BWD_LEAD = (0, 0)            # the leading index compared with the oracle
GRADS = ("dq", "dk", "dv")

def backward_flops(s: Shape, causal: bool) -> float:
    return BWD_FLOP_FACTOR * forward_flops(s, causal)


# --------------------------------------------------------------------------- backward
def backward_validation_shape(s: Shape) -> Shape:
    """The problem dq, dk, dv are checked on: the timed one when small enough, else a smaller one
    with the same B, H, d (so the same kernels, tiling and launch path)."""
    if max(s.Nq, s.Nk) <= BWD_FULL_N:
        return s
    return Shape(s.B, s.H, min(s.Nq, BWD_VALIDATE_N), min(s.Nk, BWD_VALIDATE_N), s.d)


def backward_inputs(shape, dtype, bench):
    """q, k, v and dout of the given shape, as the mode generates them everywhere."""
    q, k, v = make_inputs(shape, dtype, bench.kind, bench.torch)
    return q, k, v, make_dout(shape, dtype, bench.kind, bench.torch)


def backward_oracle(q, k, v, dout, causal, lead=BWD_LEAD):
    """{"dq", "dk", "dv"} of leading index ``lead`` from ``reference.attention_bwd`` (float64)."""
    qh, kh, vh, dh = (to_host(a[lead]).astype(np.float64) for a in (q, k, v, dout))
    return dict(zip(GRADS, reference.attention_bwd(dh, qh, kh, vh, causal=causal)))


def compare_grads(grads, refs, rel_tol, lead=BWD_LEAD):
    """Per gradient: max abs error at ``lead``, max |oracle| and the bound ``rel_tol·max(1, max|oracle|)``."""
    res = {}
    for name, g in zip(GRADS, grads):
        ref = refs[name]
        ref_max = float(np.max(np.abs(ref), initial=0.0))
        res[name] = {"max_abs_err": max_abs_err(to_host(g[lead]), ref), "ref_max_abs": ref_max,
                     "tolerance": rel_tol * max(1.0, ref_max)}
    return res


def validate_backward_config(cfg, bench):
    """Run attention_fwd, then attention_bwd on full tensors; dq, dk, dv of one head vs the oracle.

    Returns the record and the oracle's gradients when they are of the timed inputs (for
    the peers' errors), else None.
    """
    s, causal = cfg["shape"], cfg["causal"]
    vs = backward_validation_shape(s)
    rel = BWD_TOLERANCE[cfg["dtype"]]
    val = {"tolerance_rel": rel, "problem": dataclasses.asdict(vs), "same_inputs": vs == s,
           "leading_index": list(BWD_LEAD), "error": None, "grads": None, "max_abs_err": None,
           "max_err_over_tol": None, "summary": None}
    try:
        q, k, v, dout = backward_inputs(vs, cfg["dtype"], bench)
        refs = backward_oracle(q, k, v, dout, causal)
        out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
        grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=causal)
        per = compare_grads(grads, refs, rel)
    except Exception as exc:  # noqa: BLE001 - reported, row marked invalid
        val["error"] = f"{type(exc).__name__}: {exc}"
        val["traceback"] = traceback.format_exc()
        val["valid"] = False
        return val, None
    worst = max(g["max_abs_err"] / g["tolerance"] for g in per.values())
    val.update(grads=per, max_abs_err=max(g["max_abs_err"] for g in per.values()), max_err_over_tol=worst)
    val["valid"] = bool(all(g["max_abs_err"] <= g["tolerance"] for g in per.values()))
    val["summary"] = ("max abs err " + ", ".join(f"{n} {g['max_abs_err']:.2e}" for n, g in per.items())
                      + f" (worst err/tol {worst:.1e}; tol {rel:.0e}·max(1, max|ref|)"
                      + ("" if vs == s else f"; on {vs}") + ")")
    return val, (refs if vs == s else None)


def backward_kernels(cfg, use_async):
    """The dK/dV and dQ specialisations attention_bwd launches (the delta pre-pass has no tiling)."""
    s, rules = cfg["shape"], scores.spec_of(cfg["causal"])
    dkdv, dq = families.BACKWARD_FAMILIES[cfg["dtype"] in registry.LOW_DTYPES]
    return {variant: spec_record(registry.specialisation(variant, cfg["dtype"], s.d, rules, use_async), s, rows)
            for variant, rows in ((dkdv, s.Nk), (dq, s.Nq))}


def grads_mib(cfg):
    """Theoretical extra memory of the backward: dq, dk, dv and the pre-pass's rows (delta,
    one value per query row; for 16-bit inputs lse in log2 units and delta, float32,
    padded to ``backward_mma.STATS_ROWS``)."""
    s = cfg["shape"]
    if cfg["dtype"] in registry.LOW_DTYPES:
        stats = 2 * 4 * stats_rows(s.Nq)
    else:
        stats = s.Nq * registry.itemsize(cfg["dtype"])
    return s.B * s.H * ((s.Nq + 2 * s.Nk) * s.d * registry.itemsize(cfg["dtype"]) + stats) / MIB


def time_backward_ours(cfg, q, k, v, dout, bench):
    """Time attention_bwd alone: out and lse come from one attention_fwd call before."""
    causal = cfg["causal"]
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, causal=causal)
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"error": f"forward failed: {type(exc).__name__}: {exc}"}
    call = lambda: numba_flash.attention_bwd(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    plan = lambda: api.plan_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    op = None
    if bench.kind == "torch":
        from numba_flash import torch as _registers_the_op  # noqa: F401
        bwd = bench.torch.ops.numba_flash.attention_bwd
        op = lambda: bwd(dout, q, k, v, out, lse, causal, None, -1, -1, None, None)  # noqa: E731
    return time_numba(call, bench, backward_flops(cfg["shape"], causal), plan, op)


def time_backward_peer(name, cfg, q, k, v, dout, bench, refs):
    """One SDPA backend: forward once (graph kept), then time ``autograd.grad`` (ours: attention_bwd)."""
    torch = bench.torch
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def body():
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        out = sdpa(qg, kg, vg, is_causal=cfg["causal"])
        call = lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True)  # noqa: E731
        per = None if refs is None else compare_grads(call(), refs, BWD_TOLERANCE[cfg["dtype"]])
        rec = time_torch(call, bench, backward_flops(cfg["shape"], cfg["causal"]))
        rec["grads"] = per
        rec["max_abs_err"] = None if per is None else max(g["max_abs_err"] for g in per.values())
        return rec
    return run_peer(name, bench, body)


def time_backward_row(cfg, val, refs, bench):
    q, k, v, dout = backward_inputs(cfg["shape"], cfg["dtype"], bench)
    val.pop("summary")
    rec = new_record("backward", cfg, backward_flops(cfg["shape"], cfg["causal"]), val)
    use_async = uses_async((q, k, v, dout))
    rec["ours"] = {"use_async": use_async, "kernels": backward_kernels(cfg, use_async),
                   "grads_mib": grads_mib(cfg)}
    if val["valid"]:
        rec["ours"].update(time_backward_ours(cfg, q, k, v, dout, bench))
    else:
        rec["ours"]["error"] = "not timed: validation failed"
    add_peers(rec, cfg, bench, lambda name: time_backward_peer(name, cfg, q, k, v, dout, bench, refs))
    return rec


def run_backward(args):
    low = [dt for dt in args.dtype if dt not in registry.dtypes("backward")]
    if low:
        sys.exit(f"bench.py backward: no {', '.join(low)} backward yet; choose from {', '.join(registry.dtypes('backward'))}")
    settings = {"tolerance": BWD_TOLERANCE, "tolerance_kind": "per gradient: max abs err <= tol * max(1, max|ref|)",
                "validation": {"leading_index": list(BWD_LEAD), "full_inputs_up_to_n": BWD_FULL_N,
                               "else_separate_problem_n": BWD_VALIDATE_N},
                "flop_convention": f"{BWD_FLOP_FACTOR} * forward (4*B*H*Nq*Nk*d, halved when causal)",
                "timed_call": "numba_flash.attention_bwd with out, lse precomputed (public API: Python "
                              "dispatch included); peers: torch.autograd.grad(out, (q, k, v), dout, "
                              "retain_graph=True)"}
    return run_mode(args, "backward", validate_backward_config, time_backward_row,
                    BACKWARD_COLUMNS, backward_notes, settings)


def backward_notes(doc):
    s = doc["settings"]
    return common_notes(doc, "one attention_bwd call (out, lse precomputed; peers: autograd.grad through "
                        "an SDPA output)", f"{BWD_FLOP_FACTOR:g} × forward (4·B·H·N²·d, halved when causal)") + [
        "extra MiB: peak extra device memory of one attention_bwd call (pool high-water mark, plus any "
        "drop of the driver's free memory outside it), vs grads MiB = dq+dk+dv+delta, the theoretical size; peers' max_memory_allocated growth "
        "in the JSON. err: max abs error of dq, dk, dv vs the float64 oracle for leading index (0,0), on "
        f"the timed inputs when N <= {BWD_FULL_N}, else on a separate N = {BWD_VALIDATE_N} problem; "
        "tolerance " + ", ".join(f"{t:.0e}" for t in s["tolerance"].values())
        + " (" + ", ".join(s["tolerance"]) + ") × max(1, max|ref|), per gradient.",
    ] + simulator_notes(doc)


BACKWARD_COLUMNS = make_columns("grads MiB", "grads_mib")
