"""Compile the fused QKV kernel offline (no GPU) for sm_90a; the benchmark launches it via the CUDA driver.

Usage: python benchmarks/build_cubins.py [--out .m3c_build]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from m3c.backends.kernels import qkv_fused_launch as qf
from m3c.backends.triton_aot import compile_kernel
from m3c.model_defs.presets import get_preset


def main() -> None:
    """Write qkv.cubin, qkv.json and the PTX for the m3.1-small layout, T=2048 tiles."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(".m3c_build"))
    args = ap.parse_args()
    cfg = get_preset("m3.1-small")
    shape = qf.QKVShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.index_n_heads, cfg.head_dim,
                        cfg.rotary_dim)
    tiles = (128, 64, 8, 3, 1)
    ck = compile_kernel(qf.fused_spec(shape, tiles))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "qkv.cubin").write_bytes(ck.binary)
    (args.out / "qkv.ptx").write_text(ck.stages["ptx"])
    (args.out / "qkv.json").write_text(json.dumps(ck.meta() | {"tiles": list(tiles), "block_m": tiles[0]}))
    print(f"{ck.key}: {len(ck.binary)} B cubin, {ck.shared_bytes} B shared, "
          f"{ck.stages['ptx'].count('wgmma.mma_async')} wgmma in the PTX")


if __name__ == "__main__":
    main()
