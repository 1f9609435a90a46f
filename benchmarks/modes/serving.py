"""``bench.py serving``: decoding against KV caches (contiguous and paged) and a packed
variable-length prefill against its padded batch."""
import dataclasses
import itertools
import sys
import traceback

import numpy as np

import numba_flash
from numba_flash import reference, scores

from numba import cuda  # noqa: E402  (after numba_flash)

from ..environment import environment
from ..gpu_pace import gpu_pace_ms
from ..harness import (L2_FLUSH_BYTES, NP_DTYPES, SEED, TorchEvents, max_abs_err, measure_back_to_back, random_arrays,
                       time_numba, time_torch, to_host)
from ..peers import PEER_DTYPES, PEERS, ratio, run_peer
from ..report import Progress, _fmt, _header, labelled_series, simulator_notes, write_markdown, wrote
from ..options import _csv_choice
from ..runner import finish_rows, interrupted, make_bench


# --------------------------------------------------------------------------- serving mode
@dataclasses.dataclass(frozen=True)
class ServingRow:
    """One serving problem. ``kind``: "kvcache" (``attention_with_kvcache``, one new query
    per sequence, the (B, N, H, d) cache layout), "paged" (the same through a paged cache of
    ``page`` rows a page, its pages in shuffled order), "decode" (``attention`` with ``Nq = 1``
    in the (B, H, N, d) layout), "varlen" (``attention_varlen``, causal prefill of
    sequences of ``lens``) or "padded" (the same sequences padded to the longest, one
    ``attention`` call). ``device_meta``: a "kvcache" row's ``cache_seqlens`` on the
    device, read there (``check_metadata=False``), where the array kind allows."""
    label: str
    kind: str
    B: int
    Hq: int
    Hkv: int
    Nk: int
    d: int
    dtype: str
    lens: tuple = ()
    page: int = 0
    device_meta: bool = False


def _serving_rows(B, Hq, N, d, lens, dtypes, pages=(16, 256)):
    rows = []
    for dt in dtypes:
        rows += [ServingRow("kvcache", "kvcache", B, Hq, Hq, N, d, dt)]
        rows += [ServingRow(f"paged {p}", "paged", B, Hq, Hq, N, d, dt, page=p) for p in pages]
        rows += [ServingRow("kvcache gqa", "kvcache", B, Hq, Hq // 4, N, d, dt),
                 ServingRow("decode", "decode", B, Hq, Hq, N, d, dt),
                 ServingRow("decode gqa", "decode", B, Hq, Hq // 4, N, d, dt),
                 ServingRow("decode gqa b1", "decode", 1, Hq, Hq // 4, N, d, dt),
                 ServingRow("kvcache gqa b1", "kvcache", 1, Hq, Hq // 4, N, d, dt),
                 ServingRow("kv gqa b1 dev", "kvcache", 1, Hq, Hq // 4, N, d, dt, device_meta=True),
                 ServingRow("varlen", "varlen", len(lens), Hq // 2, Hq // 2, max(lens), d, dt, tuple(lens)),
                 ServingRow("padded", "padded", len(lens), Hq // 2, Hq // 2, max(lens), d, dt, tuple(lens))]
    return rows


# The issue's targets: decode bf16 (B=16, Hq=32, Nk=8192, d=128) >= 0.9x SDPA and >= 3.5 TB/s of
# K/V read; with GQA (Hkv=8) K/V read once per group; varlen prefill (16 sequences of 256..4096,
# causal) within 10% of the padded batch's TFLOP/s and faster than it in time.
SERVING_ROWS = _serving_rows(16, 32, 8192, 128, tuple(int(x) for x in np.linspace(256, 4096, 16)),
                             ("bfloat16", "float32"))
TINY_SERVING_ROWS = _serving_rows(2, 4, 40, 16, (5, 17, 33), ("bfloat16", "float32"), pages=(8,))
SERVING_TOLERANCE = {"float32": 1e-4, "float64": 1e-10, "float16": 4e-3, "bfloat16": 3e-2}


def serving_flops(r: ServingRow) -> float:
    """4·d per visible (query, key) pair per head; "padded" counts its padded problem."""
    if r.kind in ("kvcache", "paged", "decode"):
        return 4.0 * r.d * r.B * r.Hq * r.Nk
    rules = scores.parse(True)
    lens = (r.Nk,) * len(r.lens) if r.kind == "padded" else r.lens
    return 4.0 * r.d * r.Hq * sum(scores.visible_pairs(rules, n, n) for n in lens)


def serving_bytes(r: ServingRow) -> float:
    """Bytes of K and V a decode row must read (once per K/V head)."""
    return 2.0 * r.B * r.Nk * r.Hkv * r.d * NP_DTYPES[r.dtype].itemsize


# A decoding step's layers each read their own cache: the decoding rows' back-to-back and
# GPU-pace calls take turns over copies of the inputs holding together at least this many
# bytes of K/V (twice an H200's 60 MB L2), so that no call finds the last one's K/V in L2.
LAYER_BYTES = L2_FLUSH_BYTES // 2
MAX_LAYERS = 8


def layer_count(r: ServingRow, tiny=False) -> int:
    """Copies of a decoding row's inputs its back-to-back calls take turns over: at least two
    (two in the simulator, where the count only exercises the turns), enough for
    :data:`LAYER_BYTES`, at most :data:`MAX_LAYERS`."""
    if tiny:
        return 2
    return int(min(MAX_LAYERS, max(2, -(-LAYER_BYTES // serving_bytes(r)))))


def in_turn(calls):
    """One callable that calls ``calls`` in turn, one per call."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def _oracle_err(got, q, k, v, causal):
    """Max abs error of ``got (Hq, n, d)`` against the float64 oracle (K/V heads repeated)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[0] // k.shape[0]
    k, v = np.repeat(k, g, axis=0), np.repeat(v, g, axis=0)
    return max_abs_err(got, reference.attention(q, k, v, causal=causal))


def serving_inputs(r: ServingRow, bench):
    """``(call, peer_calls, check)``: ours, the SDPA calls of the same problem (PyTorch
    inputs only) and ``check()`` -> ours' max abs error against the float64 oracle on
    sequence 0 (its first 256 queries for the padded batch)."""
    kind, torch = bench.kind, bench.torch
    sdpa = None if kind != "torch" else torch.nn.functional.scaled_dot_product_attention
    peers = {}
    if r.kind in ("kvcache", "paged", "decode"):
        gqa = r.Hkv != r.Hq
        if r.kind == "paged":
            n_pages = r.B * r.Nk // r.page
            q, kp, vp = random_arrays([(r.B, 1, r.Hq, r.d), (n_pages, r.page, r.Hkv, r.d),
                                       (n_pages, r.page, r.Hkv, r.d)], r.dtype, kind, torch)
            order = np.random.default_rng(SEED).permutation(n_pages).astype(np.int32).reshape(r.B, -1)
            # the block table on the host, as cache_seqlens: device metadata is copied back to be
            # checked, which waits for the work queued before it (attention_with_kvcache's docs)
            table = order
            lens = np.full(r.B, r.Nk, np.int32)
            call = lambda: numba_flash.attention_with_kvcache(q, kp, vp, lens, block_table=table)  # noqa: E731
            heads_first = lambda x: np.swapaxes(x, 0, 1)  # noqa: E731
            # the contiguous cache of the same rows (sequence b's row j: page order[b, j // page])
            flat = order.reshape(-1)
            gather = {"torch": lambda x: x[torch.as_tensor(flat.astype(np.int64), device=x.device)],
                      "numpy": lambda x: x[flat],
                      "numba": lambda x: cuda.to_device(to_host(x)[flat])}[kind]
            kc, vc = (gather(x).reshape(r.B, r.Nk, r.Hkv, r.d) for x in (kp, vp))
            if sdpa:
                tq, tk, tv = (x.transpose(1, 2) for x in (q, kc, vc))
        elif r.kind == "kvcache":
            q, kc, vc = random_arrays([(r.B, 1, r.Hq, r.d), (r.B, r.Nk, r.Hkv, r.d), (r.B, r.Nk, r.Hkv, r.d)],
                                      r.dtype, kind, torch)
            lens = np.full(r.B, r.Nk, np.int32)
            meta = {}
            if r.device_meta and kind != "numpy":     # (NumPy calls check their metadata on the host)
                lens = torch.tensor(lens, device="cuda") if kind == "torch" else cuda.to_device(lens)
                meta = dict(check_metadata=False)
            call = lambda: numba_flash.attention_with_kvcache(q, kc, vc, lens, **meta)  # noqa: E731
            heads_first = lambda x: np.swapaxes(x, 0, 1)  # noqa: E731
            if sdpa:
                tq, tk, tv = (x.transpose(1, 2) for x in (q, kc, vc))
        else:
            q, kc, vc = random_arrays([(r.B, r.Hq, 1, r.d), (r.B, r.Hkv, r.Nk, r.d), (r.B, r.Hkv, r.Nk, r.d)],
                                      r.dtype, kind, torch)
            call = lambda: numba_flash.attention(q, kc, vc)  # noqa: E731
            heads_first = lambda x: x  # noqa: E731
            tq, tk, tv = q, kc, vc
        if sdpa:
            peers = {name: lambda: sdpa(tq, tk, tv, enable_gqa=gqa) for name in PEERS}
        q0, k0, v0 = (heads_first(to_host(x)[0]) for x in (q, kc, vc))
        return call, peers, lambda: _oracle_err(heads_first(to_host(call())[0]), q0, k0, v0, False)
    if r.kind == "varlen":
        lens = np.asarray(r.lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        q, k, v = random_arrays([(int(cu[-1]), r.Hq, r.d)] * 3, r.dtype, kind, torch)
        call = lambda: numba_flash.attention_varlen(q, k, v, cu, cu, causal=True)  # noqa: E731
        n0 = int(lens[0])
        q0, k0, v0 = (np.swapaxes(to_host(x)[:n0], 0, 1) for x in (q, k, v))
        return call, peers, lambda: _oracle_err(np.swapaxes(to_host(call())[:n0], 0, 1), q0, k0, v0, True)
    q, k, v = random_arrays([(r.B, r.Hq, r.Nk, r.d)] * 3, r.dtype, kind, torch)
    call = lambda: numba_flash.attention(q, k, v, causal=True)  # noqa: E731
    if sdpa:
        peers = {name: lambda: sdpa(q, k, v, is_causal=True) for name in PEERS}
    n0 = min(256, r.Nk)
    q0, k0, v0 = (to_host(x)[0, :, :n0] for x in (q, k, v))
    return call, peers, lambda: _oracle_err(to_host(call())[0, :, :n0], q0, k0, v0, True)


def run_serving(args):
    """Decoding against KV caches, and a packed variable-length prefill against its padded
    batch: validated on sequence 0, then timed against SDPA."""
    bench = make_bench(args)
    env = environment(bench.torch)
    print(_header(env), flush=True)
    rows_cfg = [r for r in (TINY_SERVING_ROWS if args.tiny else SERVING_ROWS)
                if r.dtype in args.serving_dtypes and r.kind in args.serving_kinds]
    rows, status, varlen, contiguous = [], 0, {}, {}
    progress = Progress("serving", len(rows_cfg))
    try:
        for r in rows_cfg:
            progress.step(f"{r.dtype} {r.label} ({r.B},{r.Hq}/{r.Hkv},{r.Nk},{r.d})")
            rec = {"mode": "serving", "row": dataclasses.asdict(r), "flops": serving_flops(r), "ours": {}, "peers": {}}
            try:
                call, peers, check = serving_inputs(r, bench)
                rec["max_abs_err"] = check()
                rec["valid"] = bool(rec["max_abs_err"] <= SERVING_TOLERANCE[r.dtype])
            except Exception as exc:  # noqa: BLE001 - reported in the row
                rec.update(valid=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
            if not rec["valid"]:
                status = 1
                print(f"VALIDATION FAILED for {r.label} {r.dtype}: {rec.get('error') or rec['max_abs_err']}\n"
                      f"{rec.get('traceback', '')}", file=sys.stderr, flush=True)
            else:
                rec["ours"] = time_numba(call, bench, rec["flops"])
                decoding = r.kind in ("kvcache", "paged", "decode")
                calls, runs = (1, 1) if args.tiny else (20, 5)      # (the simulator: one call, a smoke test)
                layers = []         # the other layers' (call, peers): back to back, the calls take turns
                if decoding and rec["ours"].get("ms_median"):
                    rec["ours"]["tb_per_s"] = serving_bytes(r) / (rec["ours"]["ms_median"] * 1e-3) / 1e12
                    layers = [serving_inputs(r, bench)[:2] for _ in range(layer_count(r, args.tiny) - 1)]
                    rec["layers"] = 1 + len(layers)
                    ours_in_turn = in_turn([call] + [c for c, _ in layers])
                    rec["ours"]["back_to_back_ms"] = measure_back_to_back(ours_in_turn, bench.events, bench, calls,
                                                                          runs)
                    if bench.torch is not None:
                        rec["ours"]["gpu_pace_ms"] = gpu_pace_ms(ours_in_turn, bench.torch)
                for name, peer_call in peers.items():
                    if r.dtype in PEER_DTYPES[name] and bench.peers:
                        peer = run_peer(name, bench, lambda: time_torch(peer_call, bench, rec["flops"]))
                        peer["ratio"] = ratio(rec["ours"], peer)
                        if layers and "error" not in peer:
                            peer_in_turn = in_turn([peer_call] + [p[name] for _, p in layers])
                            peer["back_to_back_ms"] = measure_back_to_back(peer_in_turn, TorchEvents(bench.torch),
                                                                           bench, calls, runs)
                            peer["gpu_pace_ms"] = gpu_pace_ms(peer_in_turn, bench.torch)
                        rec["peers"][name] = peer
                layers = ours_in_turn = peer_in_turn = None    # (their inputs freed before the next row's)
                if r.kind == "varlen":
                    varlen[r.dtype] = rec
                if r.kind == "kvcache" and r.Hkv == r.Hq:
                    contiguous[r.dtype] = rec["ours"]
                base = contiguous.get(r.dtype, {}).get("ms_median")
                if r.kind == "paged" and base and rec["ours"].get("ms_median"):
                    rec["vs_contiguous"] = {"time_ratio": rec["ours"]["ms_median"] / base}
                mine = varlen.get(r.dtype, {}).get("ours", {})
                if r.kind == "padded" and mine.get("ms_median") and rec["ours"].get("ms_median"):
                    varlen[r.dtype]["vs_padded"] = {"time_ratio": mine["ms_median"] / rec["ours"]["ms_median"],
                                                    "tflops_ratio": mine["tflops"] / rec["ours"]["tflops"]}
            rows.append(rec)
            progress.clear()
            print(f"  {serving_line(rec)}", flush=True)
    except KeyboardInterrupt:
        interrupted(rows, len(rows_cfg))
    doc, written = finish_rows(args, bench, env, "serving", rows, progress, serving_point, len(rows_cfg))
    if args.markdown:
        write_markdown(args.markdown, doc, SERVING_COLUMNS, serving_notes(doc))
        written.append(args.markdown)
    print(wrote(written) + "\n")
    print("\n".join([SERVING_HEADER, "-" * len(SERVING_HEADER)] + [serving_line(r) for r in rows]))
    print(serving_notes(doc)[0])
    return status


SERVING_HEADER = (f"{'row':>12} {'dtype':>8} {'B,Hq/Hkv,Nk,d':>18} {'ours ms':>8} {'TF/s':>7} {'TB/s':>6} "
                  f"{'valid':>7}  peers; vs padded or contiguous")


def _serving_shape(r):
    return f"{r['B']},{r['Hq']}/{r['Hkv']},{r['Nk']},{r['d']}"


def _serving_peers(rec):
    return "; ".join(f"{n} {_fmt(p.get('tflops'), '.1f')} ({_fmt(p.get('ratio'), '.2f')})"
                     + (f" [{p['error'][:50]}]" if p.get("error") else "") for n, p in rec["peers"].items())


def _back_to_back(rec, key="back_to_back_ms"):
    """Ours back to back (ms per call; ``key`` "gpu_pace_ms": at the GPU's pace) and its
    ratio to each peer's (peer time / ours)."""
    mine = rec["ours"].get(key)
    if not mine:
        return ""
    peers = "; ".join(f"{n} {p[key] / mine:.2f}" for n, p in rec["peers"].items() if p.get(key))
    return f"{mine:.3f}" + (f" ({peers})" if peers else "")


def _serving_versus(rec):
    vp = rec.get("vs_padded")
    extra = f"vs padded: {vp['time_ratio']:.3f}x time, {vp['tflops_ratio']:.3f}x TF/s" if vp else ""
    if rec.get("vs_contiguous"):
        extra = f"vs contiguous cache: {rec['vs_contiguous']['time_ratio']:.3f}x time"
    return extra


def serving_line(rec):
    r, o, b2b, pace = rec["row"], rec["ours"], _back_to_back(rec), _back_to_back(rec, "gpu_pace_ms")
    return (f"{r['label']:>12} {r['dtype']:>8} {_serving_shape(r):>18} {_fmt(o.get('ms_median'), '.3f'):>8} "
            f"{_fmt(o.get('tflops'), '.1f'):>7} {_fmt(o.get('tb_per_s'), '.2f'):>6} "
            f"{'ok' if rec.get('valid') else 'INVALID':>7}  {_serving_peers(rec)}{_serving_versus(rec)}"
            + (f"; back to back {b2b}" if b2b else "") + (f"; GPU pace {pace}" if pace else ""))


# (header, width, row -> text), for --markdown and docs/gen_performance.py
SERVING_COLUMNS = [
    ("row", 12, lambda rec: rec["row"]["label"]),
    ("dtype", 8, lambda rec: rec["row"]["dtype"]),
    ("B,Hq/Hkv,Nk,d", 18, lambda rec: _serving_shape(rec["row"])),
    ("ours ms", 8, lambda rec: _fmt(rec["ours"].get("ms_median"), ".3f")),
    ("TF/s", 7, lambda rec: _fmt(rec["ours"].get("tflops"), ".1f")),
    ("TB/s", 6, lambda rec: _fmt(rec["ours"].get("tb_per_s"), ".2f")),
    ("valid", 7, lambda rec: "ok" if rec.get("valid") else "INVALID"),
    ("peers: TF/s (ours/peer)", 24, lambda rec: _serving_peers(rec) or "—"),
    ("vs padded or contiguous", 24, lambda rec: _serving_versus(rec) or "—"),
    ("back to back: ms (peer/ours)", 24, lambda rec: _back_to_back(rec) or "—"),
    ("GPU pace: ms (peer/ours)", 24, lambda rec: _back_to_back(rec, "gpu_pace_ms") or "—"),
]


def serving_notes(doc):
    # (runs before the layers' turns re-read one cache back to back: their tables say so)
    turns = ("taking turns over copies of the inputs (the JSON's \"layers\": together at least 128 MB of K/V, so "
             "that no call finds the last one's K/V in L2)" if any("layers" in r for r in doc.get("rows", ()))
             else "each on the same inputs")
    return ["TFLOP/s: 4·d per visible (query, key) pair (padded: of its padded problem). TB/s: K and V bytes read "
            "once per K/V head ÷ time. varlen vs padded: time ratio and TFLOP/s ratio; paged vs contiguous: time "
            "ratio. peers: TFLOP/s (ours/peer). Back to back (decoding rows): ms per call of 20 calls queued "
            f"without synchronisation or L2 flush between them (a decoding step's layers), {turns}, and each "
            "peer's time over ours (above 1: ours faster). GPU pace (decoding rows, with PyTorch): the same calls "
            "queued behind a GPU sleep, so that they run at the GPU's pace whatever the host's "
            "(benchmarks/gpu_pace.py)."] + simulator_notes(doc)


def serving_point(rec):
    """``tflops_chart``'s point of a serving row: ours and each peer, a line per row label."""
    r, series = rec["row"], labelled_series(rec)
    return r["dtype"], r["kind"] in ("varlen", "padded"), r["d"], r["Nk"], series


def serving_options(p):
    p.add_argument("--serving-dtypes", type=_csv_choice(("float32", "bfloat16")), default=["bfloat16", "float32"],
                   help="dtypes of the serving rows (default: bfloat16,float32)")
    kinds = ("kvcache", "paged", "decode", "varlen", "padded")
    p.add_argument("--serving-kinds", type=_csv_choice(kinds), default=list(kinds),
                   help=f"kinds of serving rows (default: {','.join(kinds)})")


