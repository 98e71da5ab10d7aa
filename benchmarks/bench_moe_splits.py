"""Benchmark: the CUDA C++ MegaMoE decode's grid: K splits (moe_cuda._splits) and CTA size (moe_cuda.WARPS), m3.1-small.

The decode kernels split K so each FC1 CTA streams a shorter range: routed FC1 2 NT splits, the shared expert twice
that (3x where FC1's grid is one wave: moe_cuda.call_splits), shared FC2 2. This times the expert launches (CUDA graphs, precomputed routing) for other choices side by side
with the default, with the CTAs that do work (touched experts' and the shared expert's; the grid also holds
exiting CTAs for untouched slots), and checks each output against the reference (a different split sums in another
order: not bitwise). FC1 splits other than 1, 2, 3, 4, 6, 8 are refused (act sums those only): such a setting's row
records the error. ``--warps`` sets the FC1 / FC2 CTAs' warps (32 weight rows each; 4 ships), ``--decode 2`` adds
the probe build that only streams the weights (bench_moe_mma.py): together, what grid the weight stream itself
prefers. Usage (H200):
    PYTHONPATH=. python benchmarks/bench_moe_splits.py [--tokens 1,4,16] [--splits default 1,2,2 4,8,2]
        [--warps 4 2 1] [--decode 0 2]
"""

from __future__ import annotations

import argparse
import json

import torch
from _timing import bench_graph, token_sweep
from bench_moe_mma import INTER, E, H, K, S, decode_point

from m3c.backends.kernels import moe_cuda
from m3c.errors import ConfigError, ShapeError
from m3c.fused.moe import MegaMoE, random_moe


def _fixed(ks: tuple[int, int, int]):
    return lambda *_: ks


def run(t: int, moe, mm: MegaMoE, gen: torch.Generator, settings: list[tuple]) -> list[dict]:
    """One T: every (splits, warps, decode) setting's time and error."""
    x, ids, w, touched, floor_ms, truth = decode_point(t, moe, mm, gen)
    w13, w2, s13, s2 = mm.weights()
    default, saved = moe_cuda._splits, (moe_cuda.WARPS, moe_cuda.DECODE, moe_cuda.BALANCE_SHARED)
    rows = []
    try:
        for ks, warps, decode in settings:
            moe_cuda._splits = _fixed(ks) if ks else default
            moe_cuda.WARPS, moe_cuda.DECODE = warps, decode
            moe_cuda.BALANCE_SHARED = saved[2] and not ks  # a fixed split as given; "default": the module's choice
            moe_cuda._mma_specs.cache_clear()  # its shared-memory sizes follow the splits
            nt = moe_cuda._nt(t)
            r1, r1s, r2s = moe_cuda.call_splits(t, H, INTER, E, K, S)
            cta, groups = 32 * warps, -(-t // (8 * nt))  # the shared expert: a CTA per column group, as moe_decode_mma
            row = {"T": t, "experts": touched, "splits": [r1, r1s, r2s], "warps": warps, "decode": decode,
                   "floor_ms": floor_ms,
                   "fc1_working_ctas": touched * 2 * INTER // cta * r1 + 2 * S // cta * r1s * groups,
                   "fc2_working_ctas": touched * H // cta + H // cta * r2s * groups}
            try:
                out = moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)
            except (ConfigError, ShapeError) as e:  # a split or CTA size the kernels refuse
                rows.append(dict(row, error=str(e)))
                print(json.dumps(rows[-1]), flush=True)
                continue
            ms = bench_graph(lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2))
            row.update(ms=ms, bw_fraction=floor_ms / ms, err=float((out.float() - truth).norm() / truth.norm()))
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        moe_cuda._splits = default
        moe_cuda.WARPS, moe_cuda.DECODE, moe_cuda.BALANCE_SHARED = saved
        moe_cuda._mma_specs.cache_clear()
    return rows


def main() -> None:
    """Every T and split; JSON and a short table."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,16")
    ap.add_argument("--splits", nargs="+", default=["default", "1,2,2", "2,4,2", "4,8,2", "2,4,1"],
                    help="FC1 routed, FC1 shared, FC2 shared K splits (or default)")
    ap.add_argument("--warps", type=int, nargs="+", default=[moe_cuda.WARPS], help="warps an FC1 / FC2 CTA")
    ap.add_argument("--decode", type=int, nargs="+", default=[moe_cuda.DECODE], help="2: the weight loads alone")
    args = ap.parse_args()
    splits = [None if s == "default" else tuple(int(v) for v in s.split(",")) for s in args.splits]
    settings = [(ks, wp, dec) for dec in args.decode for wp in args.warps for ks in splits]
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    rows = token_sweep("moe_splits", args.tokens, lambda t: run(t, moe, mm, gen, settings), shape=[H, INTER, E, K, S])
    print(f"\n{'T':>3} {'exp':>4} {'splits':>8} {'w':>2} {'dec':>3} {'fc1 CTAs':>8} {'fc2 CTAs':>8} {'µs':>8} "
          f"{'%bw':>5} {'err':>8}   (CTAs: those that do work; decode 2's err is meaningless)")
    for r in rows:
        if "ms" not in r:
            print(f"{r['T']:>3} {','.join(map(str, r.get('splits', [])))} w{r.get('warps')} d{r.get('decode')} "
                  f"{r['error']}")
            continue
        print(f"{r['T']:>3} {r['experts']:>4} {','.join(map(str, r['splits'])):>8} {r['warps']:>2} {r['decode']:>3} "
              f"{r['fc1_working_ctas']:>8} "
              f"{r['fc2_working_ctas']:>8} {r['ms'] * 1e3:>7.1f}u {100 * r['bw_fraction']:>5.1f} {r['err']:>8.1e}")


if __name__ == "__main__":
    main()
