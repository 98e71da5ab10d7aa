"""Benchmark: fused QKV GEMM + Norm + RoPE + NVFP4 KV-insert vs its baselines, m3.1-small shapes, one run.

Baselines in the same run: (a) our unfused kernels (same GEMM writing QKV in bf16, then one
norm/RoPE/quantize/insert kernel), (b) the reference sub-module (bf16 linear, then the model's
norm / RoPE / NVFP4 quantizer / cache write) eager and under torch.compile, (c) the GEMM alone (our
tiling, and cuBLAS via torch.matmul). Also checks, per token count, that the fused kernel's K/V
bytes match the reference quantizer, and that the offline-compiled cubin (if given) launched
through the CUDA driver gives the same bytes as the JIT kernel. Weights rotate over several copies
so the 31 MB projection is not served from L2.

Usage (on the H200): PYTHONPATH=. python benchmarks/bench_qkv_fused.py [--cubins DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from m3c.backends.kernels import qkv_fused_launch as qf
from m3c.model_defs import quant
from m3c.model_defs.layers import apply_rope, rms_norm, rope_cos_sin
from m3c.model_defs.presets import get_preset

PEAK_BF16 = 750e12  # measured dense bf16 GEMM on this H200 (DESIGN.md: ~700-790 TFLOP/s)
READ_BW = 4.28e12  # measured read bandwidth, bytes/s
PREFILL_TILES = [(64, 64, 4, 4, 1), (64, 128, 4, 3, 1), (128, 64, 8, 3, 1), (128, 64, 4, 4, 1), (128, 128, 8, 3, 1)]
DECODE_TILES = [(16, 128, 4, 4, 4), (16, 128, 4, 4, 8), (16, 128, 4, 4, 12), (16, 64, 4, 4, 16), (64, 128, 4, 4, 8),
                (64, 64, 4, 4, 12)]


def bench(fn, warmup_ms: int = 30, rep_ms: int = 150) -> float:
    """Median milliseconds of fn() (device events, via Triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def make_inputs(cfg, t: int, copies: int, device: str):
    """Fresh random inputs; `copies` weight copies to rotate through."""
    shape = qf.QKVShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_n_heads, cfg.head_dim,
                        cfg.rotary_dim)
    k, n = cfg.hidden_size, shape.num_heads * cfg.head_dim
    x = torch.randn(t, k, device=device).bfloat16()
    ws = [(torch.randn(n, k, device=device) / k**0.5).bfloat16() for _ in range(copies)]
    pos = torch.randint(0, 1 << 20, (t,), device=device)
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, torch.float32)
    bs = cfg.msa_block_size
    nb = (t + bs - 1) // bs + 4
    slots = torch.randperm(nb * bs, device=device)[:t]
    norms = tuple((1 + 0.1 * torch.randn(cfg.head_dim, device=device)).bfloat16() for _ in range(4))

    def cache(h: int) -> quant.NVFP4Tensor:
        d = cfg.head_dim
        return quant.NVFP4Tensor(torch.full((nb, bs, h, d // 2), 0xFF, dtype=torch.uint8, device=device),
                                 torch.zeros((nb, bs, h, d // 16), dtype=torch.uint8, device=device).view(
                                     torch.float8_e4m3fn), None)

    caches = (cache(shape.num_kv_heads), cache(shape.num_kv_heads), cache(1))
    return shape, x, ws, cos, sin, slots, norms, caches


class RefQKV(torch.nn.Module):
    """The reference chain as a user would write it: bf16 linear, split, norms, RoPE, NVFP4 quantize, cache write."""

    def __init__(self, shape: qf.QKVShape, eps: float) -> None:
        super().__init__()
        self.shape, self.eps = shape, eps

    def forward(self, x, w, cos, sin, slots, n0, n1, n2, n3, kd, ks, vd, vs, ikd, iks):
        s, t, d = self.shape, x.shape[0], self.shape.head_dim
        y = F.linear(x, w).float()
        q, k, v, iq, ik = torch.split(y, [s.num_q_heads * d, s.num_kv_heads * d, s.num_kv_heads * d,
                                          s.num_index_heads * d, d], -1)
        q = apply_rope(rms_norm(q.view(t, -1, d), n0, self.eps), cos, sin)
        k = apply_rope(rms_norm(k.view(t, -1, d), n1, self.eps), cos, sin)
        iq = apply_rope(rms_norm(iq.view(t, -1, d), n2, self.eps), cos, sin)
        ik = apply_rope(rms_norm(ik.view(t, -1, d), n3, self.eps), cos, sin)
        for src, dd, ds in ((k, kd, ks), (v.reshape(t, -1, d), vd, vs), (ik, ikd, iks)):
            qt = quant.nvfp4_quantize(src)
            dd.view(-1, *dd.shape[2:]).index_copy_(0, slots, qt.data)
            ds.view(torch.uint8).view(-1, *ds.shape[2:]).index_copy_(0, slots, qt.scale.view(torch.uint8))
        return q.bfloat16(), iq.bfloat16()


def check_bytes(cfg, shape, x, w, cos, sin, slots, norms, caches) -> dict:
    """Fused kernel vs the reference quantizer on the same bf16 inputs: differing scale blocks and bytes."""
    q, _ = qf.launch_fused(x, qf.prepack_weight(w, shape), cos, sin, slots, norms, *caches, shape, cfg.rms_norm_eps,
                            q_dtype=torch.float32)
    t, d = x.shape[0], cfg.head_dim
    y = x.float() @ w.float().t()
    sizes = [shape.num_q_heads * d, shape.num_kv_heads * d, shape.num_kv_heads * d, shape.num_index_heads * d, d]
    qr, kr, vr, _, ikr = torch.split(y, sizes, -1)
    eps = cfg.rms_norm_eps
    qr = apply_rope(rms_norm(qr.view(t, -1, d), norms[0], eps), cos, sin)
    refs = {"k": apply_rope(rms_norm(kr.view(t, -1, d), norms[1], eps), cos, sin), "v": vr.reshape(t, -1, d),
            "ik": apply_rope(rms_norm(ikr.view(t, -1, d), norms[3], eps), cos, sin)}
    out = {"q_rel_err": float((q - qr).norm() / qr.norm())}
    for (name, ref), c in zip(refs.items(), caches):
        r = quant.nvfp4_quantize(ref)
        data, scale = c.data.flatten(0, 1)[slots], c.scale.flatten(0, 1)[slots].view(torch.uint8)
        out[f"{name}_scale_blocks_differ"] = int((scale != r.scale.view(torch.uint8)).sum())
        out[f"{name}_bytes_differ"] = int((data != r.data).sum())
        out[f"{name}_bytes"] = data.numel()
    return out


def check_cubin(cubin_dir: Path, shape, x, w, cos, sin, slots, norms, caches, eps) -> dict:
    """Launch the offline-compiled cubin through the CUDA driver; compare with the JIT kernel's bytes."""
    from m3c.runtime.cuda_launcher import CubinKernel

    meta = json.loads((cubin_dir / "qkv.json").read_text())
    kern = CubinKernel((cubin_dir / "qkv.cubin").read_bytes(), meta["name"], meta["shared_bytes"],
                       meta["num_warps"], meta["arg_types"])
    t = x.shape[0]
    fresh = [quant.NVFP4Tensor(c.data.clone().fill_(0xFF), c.scale.clone(), None) for c in caches]
    q = torch.empty((t, shape.num_q_heads, shape.head_dim), dtype=torch.bfloat16, device=x.device)
    iq = torch.empty((t, shape.num_index_heads, shape.head_dim), dtype=torch.bfloat16, device=x.device)
    wp = qf.prepack_weight(w, shape)
    grid, args = qf.fused_launch(x, wp, cos, sin, slots, norms, *fresh, shape, eps, tuple(meta["tiles"]), q, iq)
    kern(grid, *args)
    jit_caches = [quant.NVFP4Tensor(c.data.clone().fill_(0xFF), c.scale.clone(), None) for c in caches]
    qj, _ = qf.launch_fused(x, wp, cos, sin, slots, norms, *jit_caches, shape, eps,
                              tiles=tuple(meta["tiles"]))
    torch.cuda.synchronize()
    same = all(bool(torch.equal(a.data, b.data)) and bool(torch.equal(a.scale.view(torch.uint8),
                                                                         b.scale.view(torch.uint8)))
               for a, b in zip(fresh, jit_caches))
    return {"cubin_equals_jit_cache_bytes": same, "cubin_q_max_abs_diff": float((q.float() - qj.float()).abs().max()),
            "cubin_timing_ms": bench(lambda: kern(grid, *args))}


def measure(cfg, t: int, copies: int, cubins: Path | None) -> dict:
    """Check and time every variant at one token count."""
    device = "cuda"
    shape, x, ws, cos, sin, slots, norms, caches = make_inputs(cfg, t, copies, device)
    eps = cfg.rms_norm_eps
    k, n = x.shape[1], ws[0].shape[0]
    flops = 2.0 * t * n * k
    bytes_min = n * k * 2 + t * k * 2 + t * shape.num_q_heads * cfg.head_dim * 2 * 2  # W, x, q + iq-ish
    floor_ms = max(flops / PEAK_BF16, bytes_min / READ_BW) * 1e3
    row: dict = {"T": t, "N": n, "K": k, "flops": flops, "floor_ms": floor_ms}
    row.update(check_bytes(cfg, shape, x, ws[0], cos, sin, slots, norms, caches))
    it = iter(range(1 << 30))
    packed = [qf.prepack_weight(w, shape) for w in ws]

    def w_next() -> torch.Tensor:
        return ws[next(it) % copies]

    def wp_next() -> torch.Tensor:
        return packed[next(it) % copies]

    fused_tiles = PREFILL_TILES + (DECODE_TILES if t <= 64 else [])
    for name, launch, wfn, cands in (("fused", qf.launch_fused, wp_next, fused_tiles),
                                     ("unfused", qf.launch_unfused, w_next, PREFILL_TILES)):
        times = {}
        for tiles in cands:
            try:
                times[tiles] = bench(lambda tiles=tiles, launch=launch, wfn=wfn: launch(
                    x, wfn(), cos, sin, slots, norms, *caches, shape, eps, tiles=tiles))
            except Exception as e:  # a tile choice that does not fit shared memory
                times[tiles] = float("inf")
                row.setdefault("tile_errors", []).append(f"{name}{tiles}: {type(e).__name__}")
        tiles = min(times, key=times.get)
        row[f"{name}_ms"], row[f"{name}_tiles"] = times[tiles], list(tiles)
    out = torch.empty((t, n), dtype=torch.bfloat16, device=device)
    row["gemm_ours_ms"] = min(bench(lambda tl_=tl_: qf.launch_gemm(x, w_next(), out, shape, tl_))
                              for tl_ in PREFILL_TILES)
    row["gemm_cublas_ms"] = bench(lambda: torch.matmul(x, w_next().t()))
    ref = RefQKV(shape, eps)
    cargs = [a for c in caches for a in (c.data, c.scale)]
    row["ref_eager_ms"] = bench(lambda: ref(x, w_next(), cos, sin, slots, *norms, *cargs))
    compiled = torch.compile(ref, dynamic=False)
    compiled(x, ws[0], cos, sin, slots, *norms, *cargs)
    row["ref_compile_ms"] = bench(lambda: compiled(x, w_next(), cos, sin, slots, *norms, *cargs))
    row["fused_tflops"] = flops / row["fused_ms"] / 1e9
    row["speedup_vs_unfused"] = row["unfused_ms"] / row["fused_ms"]
    row["speedup_vs_compile"] = row["ref_compile_ms"] / row["fused_ms"]
    row["fused_over_gemm"] = row["fused_ms"] / row["gemm_ours_ms"]
    row["fused_over_floor"] = row["fused_ms"] / floor_ms
    if cubins is not None and t == 2048:
        row.update(check_cubin(cubins, shape, x, ws[0], cos, sin, slots, norms, caches, eps))
    return row

def run(tokens: list[int], cubins: Path | None, copies: int = 4) -> list[dict]:
    """Time every variant at every token count; returns one row per token count."""
    cfg = get_preset("m3.1-small")
    rows = []
    for t in tokens:
        rows.append(measure(cfg, t, copies, cubins))
        print(json.dumps(rows[-1]), flush=True)
    return rows

def main() -> None:
    """Run, write JSON, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,64,512,2048,8192")
    ap.add_argument("--cubins", type=Path, default=None, help="directory with qkv.cubin + qkv.json (AOT, T=2048)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = ap.parse_args()
    t0 = time.time()
    rows = run([int(t) for t in args.tokens.split(",")], args.cubins)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"bench": "qkv_fused", "commit": commit, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__, "rows": rows,
              "wall_s": time.time() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qkv_fused.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'T':>6} {'fused':>9} {'unfused':>9} {'compile':>9} {'eager':>9} {'gemm':>9} {'cublas':>9} "
          f"{'floor':>8} {'xUnf':>5} {'xComp':>6} {'f/gemm':>6} {'TF/s':>6} {'kdiff':>5}")
    for r in rows:
        print(f"{r['T']:>6} {r['fused_ms'] * 1e3:>8.1f}u {r['unfused_ms'] * 1e3:>8.1f}u "
              f"{r['ref_compile_ms'] * 1e3:>8.1f}u {r['ref_eager_ms'] * 1e3:>8.1f}u {r['gemm_ours_ms'] * 1e3:>8.1f}u "
              f"{r['gemm_cublas_ms'] * 1e3:>8.1f}u {r['floor_ms'] * 1e3:>7.1f}u {r['speedup_vs_unfused']:>5.2f} "
              f"{r['speedup_vs_compile']:>6.2f} {r['fused_over_gemm']:>6.2f} {r['fused_tflops']:>6.0f} "
              f"{r['k_scale_blocks_differ']:>5}")


if __name__ == "__main__":
    main()
