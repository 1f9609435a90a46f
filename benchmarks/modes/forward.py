"""``bench.py forward``: ``numba_flash.attention_fwd`` against the SDPA peers."""
import dataclasses
import traceback

import numba_flash
from numba_flash import api, registry, scores

from ..harness import (MIB, NP_DTYPES, TOLERANCE, VALIDATE_ROWS, compare_blocks, describe_blocks, forward_flops,
                       make_inputs, oracle_for, spec_record, time_numba, time_torch, uses_async, validation_blocks)
from ..peers import add_peers, run_peer
from ..report import common_notes, make_columns, simulator_notes
from ..runner import mode_configs, new_record, run_mode


def validate_forward(cfg, arrays, refs):
    """Run the API once on the full inputs and compare the checked blocks with the oracle."""
    q, k, v = arrays
    tol = TOLERANCE[cfg["dtype"]]
    res = {"tolerance": tol, "checked": describe_blocks(list(refs)), "error": None,
           "out_err": None, "lse_err": None, "max_abs_err": None}
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, causal=cfg["causal"])
        e_out, e_lse = compare_blocks(out, lse, refs)
    except Exception as exc:  # noqa: BLE001 - reported, row marked invalid
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        res["valid"] = False
        return res
    res.update(out_err=e_out, lse_err=e_lse, max_abs_err=max(e_out, e_lse))
    res["valid"] = bool(res["max_abs_err"] <= tol)
    return res


# --------------------------------------------------------------------------- forward
def forward_configs(args):
    return mode_configs(args)


def launch_records(launches):
    """What one call launches (from ``api.plan_forward`` / ``plan_backward``), as the JSON
    records it: kernel name, grid, block, dynamic shared memory and tiling per launch."""
    out = []
    for kern, grid, block, smem, _args, _stream in launches:
        fn = getattr(kern, "py_func", None) or getattr(kern, "fn", None)
        t = getattr(kern, "tiling", None)
        out.append({"kernel": getattr(fn, "__name__", repr(kern)),
                    "grid": list(grid) if isinstance(grid, tuple) else [grid], "block": block,
                    "smem_bytes": smem, "tiling": dataclasses.asdict(t) if dataclasses.is_dataclass(t) else None})
    return out


def kernel_record(cfg, use_async):
    s = cfg["shape"]
    spec = registry.forward_specialisation(cfg["dtype"], s.d, scores.spec_of(cfg["causal"]), use_async)
    return spec_record(spec, s, s.Nq)


def out_lse_mib(cfg):
    s = cfg["shape"]
    lse_bytes = 4 if cfg["dtype"] in registry.LOW_DTYPES else NP_DTYPES[cfg["dtype"]].itemsize
    return s.B * s.H * s.Nq * (s.d * NP_DTYPES[cfg["dtype"]].itemsize + lse_bytes) / MIB


def time_ours(cfg, arrays, bench):
    q, k, v = arrays
    call = lambda: numba_flash.attention_fwd(q, k, v, causal=cfg["causal"])  # noqa: E731
    plan = lambda: api.plan_forward(q, k, v, causal=cfg["causal"])  # noqa: E731
    op = None
    if bench.kind == "torch":
        import numba_flash.torch as nft
        op = lambda: nft.attention_fwd(q, k, v, causal=cfg["causal"])  # noqa: E731
    return time_numba(call, bench, forward_flops(cfg["shape"], cfg["causal"]), plan, op)


def time_peer(name, cfg, arrays, bench, refs):
    """One SDPA backend on the same tensors: error vs the oracle, time, extra memory."""
    q, k, v = arrays
    sdpa = bench.torch.nn.functional.scaled_dot_product_attention
    call = lambda: sdpa(q, k, v, is_causal=cfg["causal"])  # noqa: E731

    def body():
        err, _ = compare_blocks(call(), None, refs)
        rec = time_torch(call, bench, forward_flops(cfg["shape"], cfg["causal"]))
        rec["max_abs_err"] = err
        return rec
    return run_peer(name, bench, body)


def validate_forward_config(cfg, bench):
    arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
    refs = oracle_for(*arrays, validation_blocks(cfg["shape"]), cfg["causal"])
    val = validate_forward(cfg, arrays, refs)
    val["use_async"] = uses_async(arrays)
    val["summary"] = (f"max abs err {val['max_abs_err']:.2e} (tol {val['tolerance']:.0e})"
                      if val["max_abs_err"] is not None else None)
    return val, refs


def time_forward_row(cfg, val, refs, bench):
    arrays = make_inputs(cfg["shape"], cfg["dtype"], bench.kind, bench.torch)
    val.pop("summary")
    rec = new_record("forward", cfg, forward_flops(cfg["shape"], cfg["causal"]), val)
    rec["ours"] = kernel_record(cfg, val.pop("use_async"))
    rec["ours"]["out_lse_mib"] = out_lse_mib(cfg)
    rec["ours"]["launches"] = launch_records(api.plan_forward(*arrays, causal=cfg["causal"])[1])   # key splits
    if val["valid"]:
        rec["ours"].update(time_ours(cfg, arrays, bench))
    else:
        rec["ours"]["error"] = "not timed: validation failed"
    add_peers(rec, cfg, bench, lambda name: time_peer(name, cfg, arrays, bench, refs))
    return rec


def run_forward(args):
    settings = {"tolerance": TOLERANCE, "validate_rows": VALIDATE_ROWS,
                "flop_convention": "4*B*H*Nq*Nk*d, halved when causal",
                "timed_call": "numba_flash.attention_fwd (public API: Python dispatch included)"}
    return run_mode(args, "forward", validate_forward_config, time_forward_row,
                    FORWARD_COLUMNS, forward_notes, settings)


def forward_notes(doc):
    s = doc["settings"]
    return common_notes(doc, "one call of the public API", "4·B·H·N²·d, halved when causal") + [
        "extra MiB: peak extra device memory of one call (numba_flash's pool high-water mark, plus "
        "any drop of the driver's free memory outside it, granularity 2 MiB), vs out+lse MiB, the theoretical output size. err: max abs error vs the float64 oracle (out, lse) "
        "on a sub-slice; tolerance " + ", ".join(f"{t:.0e} ({dt})" for dt, t in s["tolerance"].items()) + ".",
    ] + simulator_notes(doc)


FORWARD_COLUMNS = make_columns("out+lse MiB", "out_lse_mib")
