"""``bench.py variants``: GQA, sliding windows, softcap and ALiBi, against the plain call, SDPA
and FlexAttention."""
import dataclasses
import sys
import traceback
from pathlib import Path

import numpy as np

import numba_flash
from numba_flash import api, reference, registry, scores

from numba import cuda  # noqa: E402  (after numba_flash)

from ..environment import environment
from ..harness import SEED, TOLERANCE, max_abs_err, random_arrays, time_numba, time_torch, to_host
from ..peers import _flex, ratio, variant_peers
from ..report import Progress, _fmt, _header, labelled_series, wrote
from ..options import _csv_choice
from ..runner import finish_rows, interrupted, make_bench
from .backward import BWD_FLOP_FACTOR, BWD_TOLERANCE


# --------------------------------------------------------------------------- variants
@dataclasses.dataclass(frozen=True)
class VariantRow:
    """One ``variants`` row: q (B, Hq, N, d), k, v (B, Hkv, N, d) and the score options.
    ``base``: the label of the row (same dtype) this one's time is compared with."""
    label: str
    B: int
    Hq: int
    Hkv: int
    N: int
    d: int
    dtype: str
    causal: bool = False
    window: tuple = None
    softcap: float = None
    alibi: bool = False
    base: str = None
    mask: str = None        # a mask_mod with its block mask: "causal", "documents" or "shared"
    docs: int = 0           # equal documents of the "documents" and "shared" masks

    def options(self, slopes=None, n=None):
        found = {"causal": self.causal, "window": self.window, "softcap": self.softcap,
                 "alibi_slopes": slopes if self.alibi else None}
        if self.mask:
            found["block_mask"] = row_block_mask(self, n or self.N)
        return found


def causal_mod(b, h, i, j):
    return j <= i


def same_document(b, h, i, j, docs):
    return docs[i] == docs[j]


def shared_first(b, h, i, j, docs):
    return docs[i] == docs[j] or docs[j] == 0


def document_ids(n, docs):
    """Position -> document of ``docs`` equal documents (int32)."""
    return (np.arange(n) * docs // n).astype(np.int32)


_BLOCK_MASKS = {}


def row_block_mask(r, n):
    """The row's block mask at length ``n`` (built once; independent of batch and head)."""
    key = (r.mask, r.docs, n)
    if key not in _BLOCK_MASKS:
        if r.mask == "causal":
            _BLOCK_MASKS[key] = numba_flash.block_mask(causal_mod, 1, 1, n, n)
        else:
            fn = same_document if r.mask == "documents" else shared_first
            _BLOCK_MASKS[key] = numba_flash.block_mask(fn, 1, 1, n, n, mod_args=(document_ids(n, r.docs),))
    return _BLOCK_MASKS[key]


def _variant_rows(dtypes, B, H, N, d, long_n, left):
    rows = []
    for dt in dtypes:
        rows += [VariantRow("mha", B, 2 * H, 2 * H, N, d, dt),
                 VariantRow("gqa 4:1", B, 2 * H, H // 2, N, d, dt, base="mha"),
                 VariantRow("plain", B, H, H, N, d, dt),
                 VariantRow("softcap", B, H, H, N, d, dt, softcap=30.0, base="plain"),
                 VariantRow("alibi", B, H, H, N, d, dt, alibi=True, base="plain"),
                 VariantRow("softcap+alibi", B, H, H, N, d, dt, softcap=30.0, alibi=True, base="plain"),
                 VariantRow("causal", 1, H, H, long_n, d, dt, causal=True),
                 VariantRow(f"window {left}", 1, H, H, long_n, d, dt, causal=True, window=(left, 0), base="causal"),
                 VariantRow("mask_mod causal", 1, H, H, long_n, d, dt, mask="causal", base="causal"),
                 VariantRow("full", 1, H, H, long_n, d, dt),
                 VariantRow("8 documents", 1, H, H, long_n, d, dt, mask="documents", docs=8, base="full"),
                 # every query also sees the first document (a shared prompt): two runs of keys
                 # per row, a mask with holes (not exact), whose block mask's lists skip the
                 # documents in between
                 VariantRow("8 docs + shared first", 1, H, H, long_n, d, dt, mask="shared", docs=8, base="full")]
    return rows


# The issue's targets: GQA (4, 32 -> 8, 4096, 128) within 5% of MHA's TFLOP/s; a causal
# window of 1024 at N = 16384 in <= 0.15x full causal's time; softcap, ALiBi <= 10% slower.
# Programmable attention: a mask_mod expressing causal, with its block mask, >= 0.9x the
# built-in causal's speed; 8 equal documents at N = 16384 >= 4x faster than full attention
# and >= 1.0x FlexAttention on the same mask.
VARIANT_ROWS = _variant_rows(("bfloat16", "float32"), 4, 16, 4096, 128, 16384, 1024)
TINY_VARIANT_ROWS = _variant_rows(("float32", "bfloat16"), 1, 2, 19, 16, 40, 5)
VARIANT_VALIDATE_N = 2048      # validated on the first batch index, N cut to this, two K/V heads
VARIANT_VALIDATE_MASK_N = 512  # (rows with a mask_mod: the oracle calls it per pair, in Python)


def oracle_options(options):
    """The oracle's options for a call's: a block mask as its mask_mod and mod_args."""
    options = dict(options)
    bm = options.pop("block_mask", None)
    if bm is not None:
        options.update(mask_mod=bm.mask_mod, mod_args=bm.mod_args)
    return options


def alibi_slopes(h):
    """The ALiBi paper's slopes for h heads: 2^(-8 i / h), i = 1 .. h."""
    return (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)


def variant_flops(r: VariantRow) -> float:
    """4·d per visible (query, key) pair per head: the FlashAttention convention for the
    visible area (a causal square is half of N², plus its diagonal)."""
    if r.mask:          # the block mask counts the visible pairs
        return 4.0 * r.d * r.B * r.Hq * row_block_mask(r, r.N).density * r.N * r.N
    rules = scores.parse(r.causal, r.window, r.softcap, r.alibi)
    return 4.0 * r.d * r.B * r.Hq * scores.visible_pairs(rules, r.N, r.N)


def variant_inputs(r: VariantRow, bench, n=None, b=None, hq=None):
    n, b, hq = n or r.N, b or r.B, hq or r.Hq
    hk = hq * r.Hkv // r.Hq
    q, k, v = random_arrays([(b, hq, n, r.d), (b, hk, n, r.d), (b, hk, n, r.d)], r.dtype, bench.kind, bench.torch)
    slopes = alibi_slopes(r.Hq)[:hq]
    if bench.kind == "torch":
        slopes = bench.torch.from_numpy(slopes).cuda()
    elif bench.kind == "numba":
        slopes = cuda.to_device(slopes)
    return q, k, v, slopes


def validate_variant(r: VariantRow, bench, backward=True):
    """Ours against the float64 oracle on a cut of the row's problem: batch 0, N at most
    ``VARIANT_VALIDATE_N``, the first two K/V heads and their query heads (same kernels);
    the backward too where the dtype has one, unless ``backward`` is False."""
    g = r.Hq // r.Hkv
    n = min(r.N, VARIANT_VALIDATE_MASK_N if r.mask else VARIANT_VALIDATE_N)
    q, k, v, slopes = variant_inputs(r, bench, n=n, b=1, hq=g * min(2, r.Hkv))
    try:
        out, lse = numba_flash.attention_fwd(q, k, v, **r.options(slopes, n))
        host = [to_host(x).astype(np.float64) for x in (q, k, v)]
        opts = oracle_options(r.options(to_host(slopes).astype(np.float64), n))
        ref_out, ref_lse = reference.attention_fwd(*host, **opts)
        err = max(max_abs_err(to_host(out).astype(np.float64), ref_out), max_abs_err(to_host(lse), ref_lse))
        ok = bool(err <= TOLERANCE[r.dtype])
        val = {"valid": ok, "max_abs_err": err, "tolerance": TOLERANCE[r.dtype], "n": n, "error": None}
        if backward and has_backward(r):     # dq, dk, dv: max abs error relative to max(1, max|oracle|)
            dout = random_arrays([tuple(q.shape)], r.dtype, bench.kind, bench.torch, SEED + 1)[0]
            grads = numba_flash.attention_bwd(dout, q, k, v, out, lse, **r.options(slopes, n))
            refs = reference.attention_bwd(to_host(dout).astype(np.float64), *host, **opts)
            bwd = max(max_abs_err(to_host(g), ref) / max(1.0, float(np.abs(ref).max())) for g, ref in zip(grads, refs))
            val.update(bwd_rel_err=bwd, bwd_tolerance=BWD_TOLERANCE[r.dtype])
            val["valid"] = ok and bool(bwd <= BWD_TOLERANCE[r.dtype])
        return val
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return {"valid": False, "max_abs_err": None, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


def has_backward(r: VariantRow):
    return r.dtype in registry.dtypes("backward")


def time_variant_backward(r: VariantRow, q, k, v, slopes, bench, flops):
    """``attention_bwd`` alone (out and lse from one forward call), as ``time_numba``."""
    opts = r.options(slopes)
    out, lse = numba_flash.attention_fwd(q, k, v, **opts)
    dout = random_arrays([tuple(q.shape)], r.dtype, bench.kind, bench.torch, SEED + 1)[0]
    return time_numba(lambda: numba_flash.attention_bwd(dout, q, k, v, out, lse, **opts), bench,
                      BWD_FLOP_FACTOR * flops, lambda: api.plan_backward(dout, q, k, v, out, lse, **opts))


def run_variants(args):
    """GQA, sliding window, softcap and ALiBi rows: validated, then timed against the row
    they vary (``base``) and the PyTorch peers that express them."""
    bench = make_bench(args)
    env = environment(bench.torch)
    print(_header(env), flush=True)
    rows_cfg = TINY_VARIANT_ROWS if args.tiny else VARIANT_ROWS
    rows_cfg = select_rows([r for r in rows_cfg if r.dtype in args.variant_dtypes], args.variant_rows)
    flex = _flex(bench.torch) if bench.torch is not None and not args.no_flex else None
    rows, by_label, status = [], {}, 0
    progress = Progress("variants", len(rows_cfg))
    try:
        for r in rows_cfg:
            progress.step(variant_label(r))
            val = validate_variant(r, bench, args.variant_backward)
            rec = {"mode": "variants", "row": dataclasses.asdict(r), "flops": variant_flops(r), "validation": val,
                   "valid": val["valid"], "ours": {}, "peers": {}}
            if not val["valid"]:
                status = 1
                print(f"VALIDATION FAILED for {r.label} {r.dtype}: {val.get('error') or val['max_abs_err']}\n"
                      f"{val.get('traceback', '')}", file=sys.stderr, flush=True)
            else:
                q, k, v, slopes = variant_inputs(r, bench)
                opts = r.options(slopes)
                rec["ours"] = time_numba(lambda: numba_flash.attention_fwd(q, k, v, **opts), bench, rec["flops"],
                                         lambda: api.plan_forward(q, k, v, **opts))
                if has_backward(r) and args.variant_backward:
                    rec["backward"] = time_variant_backward(r, q, k, v, slopes, bench, rec["flops"])
                base = by_label.get((r.base, r.dtype))
                for key, name in (("ours", "vs_base"), ("backward", "bwd_vs_base")):
                    mine, theirs = rec.get(key, {}), (base or {}).get(key, {})
                    if mine.get("ms_median") and theirs.get("ms_median"):
                        rec[name] = {"base": r.base, "time_ratio": mine["ms_median"] / theirs["ms_median"],
                                     "tflops_ratio": mine["tflops"] / theirs["tflops"]}
                if bench.torch is not None and bench.peers:
                    for name, call in variant_peers(r, q, k, v, slopes, bench.torch, flex).items():
                        try:
                            peer = time_torch(call, bench, rec["flops"])
                        except Exception as exc:  # noqa: BLE001 - unsupported, out of memory, no compiler
                            peer = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
                        peer["ratio"] = ratio(rec["ours"], peer)
                        rec["peers"][name] = peer
                        bench.torch.cuda.empty_cache()
                del q, k, v
            by_label[(r.label, r.dtype)] = rec
            rows.append(rec)
            progress.clear()
            print(f"  {variant_line(rec)}", flush=True)
    except KeyboardInterrupt:
        interrupted(rows, len(rows_cfg))
    doc, written = finish_rows(args, bench, env, "variants", rows, progress, variant_point, len(rows_cfg))
    table = "\n".join([VARIANT_HEADER, "-" * len(VARIANT_HEADER)] + [variant_line(r) for r in rows])
    if args.markdown:
        Path(args.markdown).write_text(render_variants_markdown(doc))
        written.append(args.markdown)
    print(wrote(written))
    print()
    print(table)
    print("TFLOP/s count 4·d per visible (query, key) pair. vs base: ours ms ÷ the base row's ms (same dtype). "
          "ratio: ours TFLOP/s ÷ the peer's. sdpa mask / sdpa bias: SDPA with an explicit attn_mask; flex: "
          "FlexAttention under torch.compile.")
    return status


def select_rows(rows, labels):
    """The rows named in ``labels`` (all when None) and the rows they are compared with, in
    table order; a label no row has is a ValueError naming the labels there are."""
    if labels is None:
        return rows
    known = {r.label for r in rows}
    unknown = [x for x in labels if x not in known]
    if unknown:
        raise ValueError(f"--variant-rows: no row is labelled {', '.join(map(repr, unknown))}; "
                         f"the rows are {', '.join(sorted(known))}")
    wanted = set(labels) | {r.base for r in rows if r.label in labels and r.base}
    return [r for r in rows if r.label in wanted]


def variant_label(r: VariantRow):
    """What the progress line says of a row: dtype, label, shape."""
    return f"{r.dtype} {r.label} ({r.B},{r.Hq}/{r.Hkv},{r.N},{r.d})"


def variant_point(rec):
    """``tflops_chart``'s point of a variants row: ours and each peer, a line per row label."""
    r, series = rec["row"], labelled_series(rec)
    return r["dtype"], r["causal"], r["d"], r["N"], series


VARIANT_HEADER = (f"{'row':>14} {'dtype':>8} {'shape (B,Hq/Hkv,N,d)':>22} {'ours ms':>8} {'TF/s':>7} "
                  f"{'vs base':>14} {'valid':>7}  peers (TF/s, ours/peer)")


def variant_line(rec):
    r, o = rec["row"], rec["ours"]
    shape = f"({r['B']},{r['Hq']}/{r['Hkv']},{r['N']},{r['d']})"
    vb = rec.get("vs_base")
    vs = f"{vb['time_ratio']:.3f}x {vb['base']}" if vb else "—"
    bw = rec.get("backward") or {}
    bvb = rec.get("bwd_vs_base")
    bwd = (f"  bwd {_fmt(bw.get('ms_median'), '.3f')} ms {_fmt(bw.get('tflops'), '.1f')} TF/s"
           + (f" ({bvb['time_ratio']:.3f}x)" if bvb else "")) if bw else ""
    peers = "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                      + (f" [{p['error'][:60]}]" if p.get("error") else "") for n, p in rec["peers"].items())
    return (f"{r['label']:>14} {r['dtype']:>8} {shape:>22} {_fmt(o.get('ms_median'), '.3f'):>8} "
            f"{_fmt(o.get('tflops'), '.1f'):>7} {vs:>14} {'ok' if rec['valid'] else 'INVALID':>7}  {peers}{bwd}")


def render_variants_markdown(doc):
    lines = [f"**variants** · {doc['date']} · {doc['gpu']['name']} · git `{(doc['git_sha'] or '?')[:12]}`", "",
             "| row | dtype | shape (B,Hq/Hkv,N,d) | ours ms | kernels ms | ours TFLOP/s | vs base (time) "
             "| peers: TFLOP/s (ours/peer) | backward ms | bwd vs base |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|"]
    for rec in doc["rows"]:
        r, o, vb = rec["row"], rec["ours"], rec.get("vs_base")
        vs = "—" if not vb else f"{vb['time_ratio']:.3f}× {vb['base']}"
        bb = rec.get("bwd_vs_base")
        peers = "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                          for n, p in rec["peers"].items() if not p.get("error")) or "—"
        lines.append(f"| {r['label']} | {r['dtype']} | ({r['B']},{r['Hq']}/{r['Hkv']},{r['N']},{r['d']}) | "
                     f"{_fmt(o.get('ms_median'), '.3f')} | {_fmt(o.get('kernel_ms_median'), '.3f')} | "
                     f"{_fmt(o.get('tflops'), '.1f')} | {vs} | {peers} | "
                     f"{_fmt(rec.get('backward', {}).get('ms_median'), '.3f')} | "
                     f"{'—' if not bb else format(bb['time_ratio'], '.3f') + '×'} |")
    return "\n".join(lines) + "\n"


def variants_options(p):
    p.add_argument("--variant-dtypes", type=_csv_choice(("float32", "bfloat16")), default=["bfloat16", "float32"],
                   help="dtypes of the variants rows (default: bfloat16,float32)")
    p.add_argument("--variant-rows", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                   metavar="LABELS", help="only these rows (comma-separated labels, e.g. '8 documents,alibi'), "
                   "with the rows they are compared with")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer (torch.compile)")
    p.add_argument("--no-backward", dest="variant_backward", action="store_false",
                   help="skip timing attention_bwd on the rows whose dtype has a backward")


