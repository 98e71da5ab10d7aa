"""End to end: prefill and decode tokens/s of a preset through m3c (compiled for this machine's target)
vs the reference model in eager and under torch.compile, same weights, one run.

Usage (on the H200): PYTHONPATH=. python benchmarks/bench_e2e.py --preset m3.1-small [--out DIR]
On a CPU machine it runs the cpu target on m3.1-tiny (plumbing check).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import m3c
from m3c.backends.target import auto_target
from m3c.model_defs.checkpoint import build_model, random_hf_weights
from m3c.model_defs.presets import get_preset
from m3c.runtime.bench import random_prompts, timed_generation


def main() -> None:
    """Build one set of weights, run every variant, write JSON, print a table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--no-torch-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")))
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    target = auto_target().name
    cfg = get_preset(args.preset or ("m3.1-small" if cuda else "m3.1-tiny"))
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.time()
    tensors = random_hf_weights(cfg, seed=0, device=device)
    cpu_tensors = {k: v.cpu() for k, v in tensors.items()}
    eager = build_model(cfg, tensors, device=device, dtype=dtype)
    t_build = time.time() - t0
    t0 = time.time()
    compiled = m3c.compile(build_model(cfg, cpu_tensors, dtype=dtype), target=target)
    t_compile = time.time() - t0
    prompts = random_prompts(cfg, args.batch, args.prompt_tokens)
    rows = {"m3c_" + target: timed_generation(compiled, cfg, prompts, args.decode_steps, device)}
    print("m3c", {k: v for k, v in rows["m3c_" + target].items() if k != "tokens"}, flush=True)
    if cuda:
        from m3c.runtime.cuda_graphs import GraphedStep

        graphed = GraphedStep(compiled.executor)
        rows[f"m3c_{target}_cuda_graphs"] = timed_generation(graphed, cfg, prompts, args.decode_steps, device)
        rows[f"m3c_{target}_cuda_graphs"]["graphs"] = graphed.eager_reason or f"{graphed.replays} replays"
        print("m3c graphs", {k: v for k, v in rows[f"m3c_{target}_cuda_graphs"].items() if k != "tokens"}, flush=True)
    rows["reference_eager"] = timed_generation(eager, cfg, prompts, args.decode_steps, device)
    print("eager", {k: v for k, v in rows["reference_eager"].items() if k != "tokens"}, flush=True)
    if not args.no_torch_compile:
        try:
            t0 = time.time()
            tc = torch.compile(eager)
            rows["reference_torch_compile"] = timed_generation(tc, cfg, prompts, args.decode_steps, device)
            rows["reference_torch_compile"]["compile_and_run_s"] = time.time() - t0
        except Exception as e:  # record, don't hide: the table says it failed
            rows["reference_torch_compile"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    agree = [sum(a == b for a, b in zip(x, y)) for x, y in zip(rows["m3c_" + target]["tokens"],
                                                              rows["reference_eager"]["tokens"])]
    result = {"bench": "e2e", "preset": cfg.name, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "target": target, "dtype": str(dtype), "batch": args.batch,
              "prompt_tokens": args.prompt_tokens, "decode_steps": args.decode_steps, "build_s": t_build,
              "m3c_compile_s": t_compile, "greedy_tokens_agreeing_with_eager": agree,
              "reference_ops_in_program": next((e["reference_ops"] for e in compiled.program.launch_plan
                                                if "reference_ops" in e), None), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"e2e_{cfg.name}.json").write_text(json.dumps(result, indent=2))
    print(f"\n{cfg.name} on {result['device']}, {args.batch}×{args.prompt_tokens} prompt tokens, "
          f"{args.decode_steps} decode steps, {dtype}; build {t_build:.1f}s, m3c compile {t_compile:.1f}s")
    print(f"{'variant':<26} {'prefill tok/s':>14} {'decode ms/step':>15} {'decode tok/s':>13}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<26} {r['error']}")
        else:
            print(f"{name:<26} {r['prefill_tok_s']:>14,.0f} {r['decode_ms_per_step']:>15.2f} {r['decode_tok_s']:>13,.1f}")
    print(f"greedy tokens equal to eager per request: {agree} of {args.decode_steps + 1}")


if __name__ == "__main__":
    main()
