"""Benchmark probe: where the MegaMoE decode's time goes CTA by CTA (``moe_cuda.TIMELINE``). Each FC1 / FC2 CTA stamps
the GPU's %globaltimer at entry, before its staging, after its GEMV's stores and at exit, with its SM, expert and K
range; this script replays the call from a CUDA graph (the whole op: routing launch + experts) and turns the stamps
into: each kernel's span, the gap between them, the phases' medians, CTAs per SM, and the weight bytes in flight per
microsecond (each CTA's bytes spread evenly over its staging + GEMV), i.e. when HBM streams and when it idles.

Why (session 33): ``PREFETCH_FC2`` (FC2's first super-chunks asked of L2 by FC1's finished CTAs) measured 0.7-1.5 µs
slower at T = 1, against a predicted 1.5-3 µs gain, so "FC1's tail leaves HBM idle" is doubtful. This says what the
59 µs at T = 1 are made of before building FC1 + FC2 in one launch.

Usage (H200): PYTHONPATH=. python benchmarks/bench_moe_cta_timeline.py [--tokens 1,4,16] [--bin 1.0] [--knob QUEUE=1]
[--tag _x]
(``--knob``: a moe_cuda int / bool knob for both builds, e.g. DECODE=2 for the weight loads alone; with QUEUE the FC1 /
FC2 rows are moe_experts' items; ``--tag``: a suffix for the JSON's name).
The probe's stamps change the kernels a little (T = 16's FC2 spills 8 bytes); its graph time is printed beside the
plain build's.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
from _timing import bench_graph, write_results
from bench_moe_ab import INTER, E, H, K, set_knobs

from m3c.backends.kernels import moe_cuda
from m3c.fused.moe import MegaMoE, random_moe

READ_BW = 4.28e12  # bytes/s: the H200's measured read bandwidth (DESIGN.md)
ROWS = 128  # weight rows a CTA covers (moe_cuda.WARPS = 4)


def cta_rows(tl: torch.Tensor, kernel: str) -> list[dict]:
    """The stamps of one kernel's CTAs as dicts (ns; absent where the CTA found no work)."""
    out = []
    for r in tl.cpu().tolist():
        t0, t1, t2, t3, sm, expert, ks, kc = r
        expert = expert - (1 << 64) if expert >= 1 << 63 else expert
        shared = expert == -1
        nbytes = ROWS * kc * ((1 + 1 / 32) if shared else 0.5625) if t1 else 0.0
        out.append({"kernel": kernel, "entry": t0, "staged": t1, "gemv_end": t2, "exit": t3, "sm": sm,
                    "expert": expert, "ks": ks, "kc": kc, "bytes": nbytes})
    return out


def by_rank(cs: list[dict], rel: Callable[[int], float]) -> list[list[float]]:
    """Per SM rank (a CTA's place, in grid order, among the CTAs its SM ran; grid order is the rows' order, and a
    one-wave grid's rank r is mostly blocks 132 r ..): [CTAs with work, mean GB/s over staging + GEMV, mean exit µs].
    Session 36: with equal bytes, later ranks stream slower (T = 1, FC1's routed CTAs 9.8 / 9.1 / 8.2 GB/s at ranks
    1 / 2 / 3), so a wave's youngest CTAs end it."""
    seen: dict[int, int] = {}
    acc: dict[int, list[float]] = {}
    for c in cs:
        r = seen.get(c["sm"], 0)
        seen[c["sm"]] = r + 1
        if c["staged"]:
            a = acc.setdefault(r, [0, 0.0, 0.0])
            a[0] += 1
            a[1] += c["bytes"] / max(c["gemv_end"] - c["staged"], 1)
            a[2] += rel(c["exit"])
    return [[a[0], a[1] / a[0], a[2] / a[0]] for _, a in sorted(acc.items())]


def summarize(ctas: list[dict], bin_us: float) -> dict:
    """Spans, gap, phase medians, CTAs per SM and the bytes-in-flight curve (TB/s a bin) of one replay."""
    t0 = min(c["entry"] for c in ctas)
    rel = lambda v: (v - t0) / 1e3  # noqa: E731  (ns -> µs from FC1's first entry)
    res: dict = {}
    for k in ("moe_fc1", "moe_fc2"):
        cs = [c for c in ctas if c["kernel"] == k]
        work = [c for c in cs if c["staged"]]
        med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
        res[k] = {
            "ctas": len(cs), "with_work": len(work), "bytes_mb": sum(c["bytes"] for c in work) / 1e6,
            "first_entry": rel(min(c["entry"] for c in cs)), "last_entry": rel(max(c["entry"] for c in cs)),
            "first_exit": rel(min(c["exit"] for c in cs)), "last_exit": rel(max(c["exit"] for c in cs)),
            "first_gemv_end": rel(min(c["gemv_end"] for c in work)),
            "pre_us_median": med([(c["staged"] - c["entry"]) / 1e3 for c in work]),
            "stream_us_median": med([(c["gemv_end"] - c["staged"]) / 1e3 for c in work]),
            "stream_us_max": max((c["gemv_end"] - c["staged"]) / 1e3 for c in work),
            "post_us_median": med([(c["exit"] - c["gemv_end"]) / 1e3 for c in work]),
            "post_us_max": max((c["exit"] - c["gemv_end"]) / 1e3 for c in work),
            "ctas_per_sm_max": max(sum(1 for c in cs if c["sm"] == s) for s in {c["sm"] for c in cs}),
        }
        # an SM streams at most ~1/132 of HBM, so its load is the bytes of its CTAs (session 34: QUEUE's ticket
        # order gave some SMs 885 KB of FC1 and others 541, where moe_fc1's grid gives 713-799)
        per_sm: dict[int, float] = {}
        for c in work:
            per_sm[c["sm"]] = per_sm.get(c["sm"], 0.0) + c["bytes"] / 1e3
        loads = sorted(per_sm.values())
        res[k].update({"sm_kb_min": loads[0], "sm_kb_median": med(loads), "sm_kb_max": loads[-1]})
        # each SM's rate: its bytes over the time from the kernel's first entry to its own last exit. If every SM
        # streamed at the median rate with equal bytes, the kernel would take equal_span_us: near the span, the
        # kernel is bound by the SMs' rate, not by a tail (session 37: ~26 GB/s an SM with the decode math, ~31.5
        # with the loads alone)
        k0, ends = min(c["entry"] for c in cs), {}
        for c in work:
            ends[c["sm"]] = max(ends.get(c["sm"], 0), c["exit"])
        rates = sorted(per_sm[sm] * 1e3 / max(ends[sm] - k0, 1) for sm in per_sm)  # bytes a ns = GB/s
        res[k].update({"sm_gbps_min": rates[0], "sm_gbps_median": med(rates), "sm_gbps_max": rates[-1],
                       "equal_span_us": sum(per_sm.values()) / len(per_sm) / med(rates)})
        res[k]["by_rank"] = by_rank(cs, rel)
    res["gap_us"] = res["moe_fc2"]["first_entry"] - res["moe_fc1"]["last_exit"]
    end = max(c["exit"] for c in ctas)
    nbins = int((end - t0) / 1e3 / bin_us) + 1
    curve = [[0.0, 0.0, 0, 0] for _ in range(nbins)]  # TB/s FC1, TB/s FC2, CTAs streaming, CTAs resident
    for c in ctas:
        a, b = rel(c["entry"]), rel(c["exit"])
        for i in range(int(a / bin_us), min(nbins, int(b / bin_us) + 1)):
            curve[i][3] += 1
        if not c["staged"]:
            continue
        s, e = rel(c["staged"]), rel(c["gemv_end"])
        rate = c["bytes"] / max(e - s, 1e-3)  # bytes a µs
        for i in range(int(s / bin_us), min(nbins, int(e / bin_us) + 1)):
            lo, hi = max(s, i * bin_us), min(e, (i + 1) * bin_us)
            if hi > lo:
                curve[i][0 if c["kernel"] == "moe_fc1" else 1] += rate * (hi - lo) / bin_us / 1e6
                curve[i][2] += 1
    res["curve"] = curve
    stamps = sorted({c[f] for c in ctas for f in ("entry", "staged", "gemv_end", "exit") if c[f]})
    res["timer_step_ns"] = min((b - a for a, b in itertools.pairwise(stamps) if b > a), default=0)
    res["span_us"] = (end - t0) / 1e3
    return res


def point(t: int, moe, mm: MegaMoE, gen: torch.Generator, bin_us: float) -> dict:
    """One T: the whole op's graph time (plain build, then the probe build) and the probe's timeline."""
    x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
    moe_cuda.TIMELINE = False
    plain = bench_graph(lambda: mm(x)) * 1e3
    moe_cuda.TIMELINE = True
    mm(x)  # the probe build's cubins before capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mm(x)
    tls = list(moe_cuda.last_timeline)  # (allocated in the graph's pool: each replay rewrites them)
    for _ in range(30):
        g.replay()
    torch.cuda.synchronize()
    probe = bench_graph(lambda: mm(x)) * 1e3
    g.replay()
    torch.cuda.synchronize()
    ctas = cta_rows(tls[0], "moe_fc1") + cta_rows(tls[1], "moe_fc2")
    moe_cuda.TIMELINE = False
    res = summarize(ctas, bin_us)
    res.update({"T": t, "whole_op_us": plain, "whole_op_probe_us": probe,
                "floor_us": sum(c["bytes"] for c in ctas) / READ_BW * 1e6, "ctas": ctas})
    return res


def show(r: dict, bin_us: float) -> None:
    """The point's summary and its bytes-in-flight curve as text."""
    print(f"\nT = {r['T']}: whole op {r['whole_op_us']:.1f} µs (probe build {r['whole_op_probe_us']:.1f}); "
          f"FC1 + FC2 span {r['span_us']:.1f} µs, weight floor {r['floor_us']:.1f} µs; gap FC1 last exit -> FC2 "
          f"first entry {r['gap_us']:.2f} µs; timer step {r['timer_step_ns']} ns")
    keys = ("ctas", "with_work", "bytes_mb", "first_entry", "last_entry", "first_gemv_end", "first_exit", "last_exit",
            "pre_us_median", "stream_us_median", "stream_us_max", "post_us_median", "post_us_max", "ctas_per_sm_max",
            "sm_kb_min", "sm_kb_median", "sm_kb_max", "sm_gbps_min", "sm_gbps_median", "sm_gbps_max", "equal_span_us")
    print(f"  {'':<18}" + "".join(f"{k:>10}" for k in ("moe_fc1", "moe_fc2")))
    for k in keys:
        print(f"  {k:<18}" + "".join(f"{r[n][k]:>10.2f}" for n in ("moe_fc1", "moe_fc2")))
    for n in ("moe_fc1", "moe_fc2"):
        print(f"  {n} by SM rank (CTAs, GB/s, mean exit µs): "
              + "  ".join(f"{i}: {a:.0f} {b:.2f} {c:.1f}" for i, (a, b, c) in enumerate(r[n]["by_rank"][:8])))
    curve = r["curve"]
    g = -(-len(curve) // 60)  # bins a printed line (at most ~60 lines; the JSON keeps every bin)
    print(f"  {'µs':>6} {'FC1 TB/s':>9} {'FC2 TB/s':>9} {'total':>6} {'stream':>7} {'resident':>9}   (means over "
          f"{g * bin_us:g} µs)")
    for i in range(0, len(curve), g):
        part = curve[i:i + g]
        a, b, n, m = (sum(v[j] for v in part) / len(part) for j in range(4))
        print(f"  {i * bin_us:>6.1f} {a:>9.2f} {b:>9.2f} {a + b:>6.2f} {n:>7.0f} {m:>9.0f}")


def main() -> None:
    """Every T: a summary and curve printed, the raw stamps to $OUT/moe_cta_timeline<--tag>.json."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--bin", type=float, default=1.0, help="µs a bin of the bytes-in-flight curve")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=INT",
                    help="set moe_cuda.NAME (an int or bool knob, e.g. QUEUE=1) for both builds")
    ap.add_argument("--tag", default="", help="a suffix for the JSON's name")
    args = ap.parse_args()
    set_knobs(args.knob)
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        r = point(t, moe, mm, gen, args.bin)
        show(r, args.bin)
        rows.append(r)
    write_results("moe_cta_timeline" + args.tag, rows)


if __name__ == "__main__":
    main()
