"""A small interpreter for the PTX subset of the kernels' inline assembly, so the CPU suite checks the PTX text
itself (Triton's interpreter cannot run it): 32-bit registers, outputs $0..$(n_out - 1), inputs after them.

Written from the PTX ISA's definitions: prmt (default mode: a selector nibble with its top bit set replicates
the chosen byte's sign), dp4a (signed bytes), mul.rn.bf16x2 (two bf16 lanes, round to nearest even; subnormals
kept).
"""

from __future__ import annotations

import torch

M32 = 0xFFFFFFFF


def _bf16x2_mul(a: int, b: int) -> int:
    lanes = torch.tensor([a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16], dtype=torch.int32).to(torch.int16)
    v = lanes.view(torch.bfloat16).float()
    prod = (v[:2] * v[2:]).to(torch.bfloat16)  # float32 products of bf16 are exact: one rounding
    bits = prod.view(torch.int16).to(torch.int32) & 0xFFFF
    return int(bits[0]) | (int(bits[1]) << 16)


def run_ptx(asm: str, args: list[int], n_out: int) -> list[int]:
    """The output registers (unsigned 32-bit) of `asm` for input registers `args` ($n_out, $n_out + 1, ...)."""
    reg = {f"${i + n_out}": a & M32 for i, a in enumerate(args)}

    def val(x: str) -> int:
        return reg[x] if x in reg else int(x, 0) & M32

    def sbyte(x: int, i: int) -> int:
        b = (x >> (8 * i)) & 255
        return b - 256 if b & 128 else b

    for ins in asm.strip("{} ").split(";"):
        parts = ins.replace(",", " ").split()
        if not parts or parts[0] == ".reg":
            continue
        op, d, *src = parts
        a = [val(x) for x in src]
        if op == "mov.b32":
            r = a[0]
        elif op in ("and.b32", "or.b32", "xor.b32"):
            r = {"and.b32": a[0] & a[1], "or.b32": a[0] | a[1], "xor.b32": a[0] ^ a[1]}[op]
        elif op in ("shl.b32", "shr.b32"):
            r = (a[0] << a[1]) if op == "shl.b32" else (a[0] >> a[1])
        elif op == "prmt.b32":
            pool = a[0] | (a[1] << 32)
            r = 0
            for i in range(4):
                sel = (a[2] >> (4 * i)) & 15
                byte = (pool >> (8 * (sel & 7))) & 255
                if sel & 8:
                    byte = 255 if byte & 128 else 0
                r |= byte << (8 * i)
        elif op == "dp4a.s32.s32":
            r = a[2] + sum(sbyte(a[0], i) * sbyte(a[1], i) for i in range(4))
        elif op == "sub.s32":
            r = a[0] - a[1]
        elif op == "mad.lo.s32":
            r = a[0] * a[1] + a[2]
        elif op == "mul.rn.bf16x2":
            r = _bf16x2_mul(a[0], a[1])
        else:
            raise AssertionError(f"unexpected PTX op {op!r}")
        reg[d] = r & M32
    return [reg[f"${i}"] for i in range(n_out)]
