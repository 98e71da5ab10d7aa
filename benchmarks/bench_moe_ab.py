"""Same-run A/B of two source trees for the MegaMoE decode: run this script once per tree (PYTHONPATH picks the
tree), alternating, with the same seed: each T's whole op (``MegaMoE`` from a CUDA graph) and, where the CUDA decode
kernels take T, the expert launches alone over the same routing; the error against the float32 reference and a hash
of the output (equal hashes: bitwise the same result).

Usage (H200): PYTHONPATH=<tree> python benchmarks/bench_moe_ab.py --tag new --tokens 1,4,16,64 >> ab.jsonl
A knob of one tree instead: ... --tag d1 --knob DECODE=1 (moe_cuda's module attributes, ints).
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
from _timing import bench_graph

from m3c.backends.kernels import moe_cuda
from m3c.backends.kernels.moe_routing import moe_route
from m3c.fused.moe import MegaMoE, random_moe

H, INTER, E, K, S = 6144, 1536, 64, 8, 1536


def point(tag: str, t: int, moe, mm: MegaMoE, gen: torch.Generator) -> dict:
    """One T: error, output hash, the whole op and (where the CUDA decode kernels take T) the experts alone."""
    w13, w2, s13, s2 = mm.weights()
    cfg = moe.cfg
    x = torch.randn(t, H, generator=gen, device="cuda").to(torch.bfloat16)
    ids, w = moe_route(x, moe.gate.weight, moe.e_score_correction_bias, top_k=K,
                       routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob)
    w = w.float()
    out = mm(x)
    truth = moe(x.float())
    row = {"tag": tag, "T": t, "experts": int(torch.unique(ids).numel()),
           "err": float((out.float() - truth).norm() / truth.norm()),
           "hash": hashlib.sha256(out.float().cpu().numpy().tobytes()).hexdigest()[:12],
           "megamoe_us": bench_graph(lambda: mm(x)) * 1e3}
    if t <= moe_cuda.MAX_TOKENS:
        row["experts_us"] = bench_graph(lambda: moe_cuda.moe_decode_mma(x, ids, w, w13, w2, s13, s2)) * 1e3
    return row


def main() -> None:
    """Time every T in this tree and print one JSON line per T."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--tokens", default="1,4,16,64")
    ap.add_argument("--knob", action="append", default=[], metavar="NAME=INT",
                    help="set moe_cuda.NAME (an int or bool knob, e.g. DECODE=1) before timing")
    args = ap.parse_args()
    for kv in args.knob:
        name, value = kv.split("=")
        old = getattr(moe_cuda, name)  # (an unknown name fails here)
        setattr(moe_cuda, name, type(old)(int(value)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    moe = random_moe(H, INTER, E, K, "mxfp8", gen, device="cuda")
    mm = MegaMoE.from_reference(moe)
    for t in (int(v) for v in args.tokens.split(",")):
        print(json.dumps(point(args.tag, t, moe, mm, gen)), flush=True)


if __name__ == "__main__":
    main()
