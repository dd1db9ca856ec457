"""Pure prefill, mixed and decode steps side by side (issue 35): B prompts of --context tokens
through `kernelgate.generate(timing=...)` on one reused engine, with the engine's own step kinds
(`Timing.steps`): each kind's median step time (host interval between reads, and device time from
CUDA events around the model step: device_spans.py), its tokens, and a mixed step's time against
a pure prefill step of the same chunk. The budget (max_num_batched_tokens) sets the chunk.

    PYTHONPATH=. python bench/e2e/step_kinds.py --layers 27 --context 32768,131072 --batch 4
    PYTHONPATH=. python bench/e2e/step_kinds.py --tiny --device cpu --context 300 --budget 64   # smoke run
    PYTHONPATH=. python bench/e2e/step_kinds.py --layers 27 --context 131072 --batch 4 --kernels   # + kernel parts

Also printed: the prompt tokens' rate over the whole batch, and the model FLOPs per prompt token
at the mean context (MoE's active experts, the dense layers, KDA's chunked form, MLA over the
prefix, the LM head) with the fraction of --peak TFLOP/s it reaches.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from device_spans import DeviceSpans


def flops_per_token(c, ctx: float) -> float:
    """Forward FLOPs of one prompt token at mean context `ctx` (2 per multiply-add)."""
    D, f = c.hidden_size, 0.0
    H, K = c.linear_num_heads, c.linear_head_dim
    for kind, mlp in zip(c.layer_types, c.mlp_types):
        if kind == "kda":
            f += 2 * D * (3 * H * K + 2 * K + H) + 2 * 2 * K * H * K + 2 * H * K * D   # projections
            f += 2 * H * (4 * K * K + 64 * K)                                          # chunked delta rule (chunk 64)
        else:
            R, Dr, Dn, Dv, Hm = c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim, c.num_attention_heads
            f += 2 * D * (Hm * (Dn + Dr) + R + Dr) + 2 * R * Hm * (Dn + Dv) + 2 * Hm * Dv * D
            f += 2 * Hm * ctx * (Dn + Dr + Dv)                                          # attention over the prefix
        if mlp == "moe":
            f += 2 * D * c.num_experts + 3 * 2 * D * c.moe_intermediate_size * (c.num_experts_per_token + c.num_shared_experts)
        else:
            f += 3 * 2 * D * c.intermediate_size
    return f                  # (the LM head runs once per sequence, not per prompt token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", default="32768,131072", help="prompt lengths, comma-separated")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new", type=int, default=65)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--peak", type=float, default=790.0, help="bf16 TFLOP/s of the device (measured)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="then one prompt of the last context alone under torch.profiler: its prefill's GPU kernel "
                         "time by part (attention, experts, dense GEMMs, KDA, ...), the top kernels and the "
                         "torch ops that launched them")
    a = ap.parse_args()
    import kernelgate
    from kernelgate.models import build, real_width, tiny
    from kernelgate.platform import default_device
    from kernelgate.serving.drive import Timing
    from kernelgate.serving.warmup import warm_up
    dev = torch.device(a.device) if a.device else default_device()
    cfg = tiny(num_hidden_layers=a.layers) if a.tiny else real_width(a.layers)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    t0 = time.perf_counter()
    model = build(cfg, device=dev, dtype=dtype, seed=0)
    print(f"built {a.layers} layers in {time.perf_counter() - t0:.1f} s", flush=True)
    ctxs = [int(x) for x in a.context.split(",")]
    eng = kernelgate.Engine(model, max_num_seqs=a.batch, max_model_len=max(ctxs) + a.new,
                            max_num_batched_tokens=a.budget, enable_prefix_caching=False)
    warm_up(eng, log=lambda m: print(m, flush=True), every_shape=dev.type != "cpu")
    spans = DeviceSpans(eng) if dev.type == "cuda" else None
    print(f"| context | B | kind | steps | median s | median device s | median tokens | mixed / prefill (device) | "
          f"prompt tok/s | GFLOP/token | of {a.peak:.0f} TFLOP/s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ctx in ctxs:
        g = torch.Generator().manual_seed(ctx)
        prompts = [torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist() for _ in range(a.batch)]
        t = Timing()
        if spans is not None:
            spans.steps.clear()
        kernelgate.generate(model, prompts, max_new_tokens=a.new, stop_token_ids=(), timing=t, engine=eng)
        by, dev_by = {}, {}
        for kind, tokens, secs in t.steps:
            by.setdefault(kind, []).append((secs, tokens))
        for kind, _, ms in (spans.table() if spans is not None else []):
            dev_by.setdefault(kind, []).append(ms / 1e3)
        med = {k: statistics.median(s for s, _ in v) for k, v in by.items()}
        dmed = {k: statistics.median(v) for k, v in dev_by.items()}
        fpt = flops_per_token(cfg, ctx / 2)
        rate = t.prefill_tokens / t.prefill_s if t.prefill_s else float("nan")
        for kind in ("prefill", "mixed", "decode"):
            if kind not in by:
                continue
            ratio = f"{med['mixed'] / med['prefill']:.2f}" if kind == "mixed" and "prefill" in med else ""
            if ratio and "mixed" in dmed and "prefill" in dmed:
                ratio += f" ({dmed['mixed'] / dmed['prefill']:.2f})"
            tail = f"{rate:.0f} | {fpt / 1e9:.2f} | {rate * fpt / 1e12 / a.peak:.2f}" if kind == "prefill" else " | | "
            d = f"{dmed[kind]:.4f}" if kind in dmed else ""
            print(f"| {ctx} | {a.batch} | {kind} | {len(by[kind])} | {med[kind]:.4f} | {d} | "
                  f"{statistics.median(n for _, n in by[kind])} | {ratio} | {tail} |", flush=True)
    if a.kernels and dev.type == "cuda":
        kernels(model, eng, cfg, ctxs[-1])
    eng.close()


# a kernel's part of a prefill step, by name (first match; torch / cuBLAS / cuDNN / fla / kernelgate names)
PARTS = [("attention (cuDNN / FA2 / mem-efficient)", r"sdpa|flash_fwd|fmha|attention|cudnn"),
         ("experts grouped GEMMs", r"_gate_up_kernel|_down_kernel"),
         ("experts routing / sums", r"moe_align|_count_kernel|_scan_kernel|_scatter|_sum_k|topk|grouped"),
         ("KDA (fla chunk kernels, conv)", r"chunk|kda|solve_tril|recompute|delta|_conv|wy_|_fwd_kernel"),
         ("dense GEMMs (cuBLAS)", r"nvjet|gemm|xmma|cutlass|sm90_|sm80_"),
         ("norms", r"norm"),
         ("elementwise, copies, gathers", r"elementwise|copy|Memcpy|Memset|Cat|fill|index|gather|scatter|reduce")]


def part_of(name: str) -> str:
    import re
    for part, pat in PARTS:
        if re.search(pat, name, re.IGNORECASE):
            return part
    return "other"


def kernels(model, eng, cfg, ctx: int) -> None:
    """One prompt of ctx tokens (its prefill steps) under torch.profiler: GPU time by part."""
    import kernelgate
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
    torch.cuda.synchronize()
    stacks = torch._C._profiler._ExperimentalConfig(verbose=True)   # (without it the stacks come back empty)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True,
                 experimental_config=stacks) as prof:
        kernelgate.generate(model, [prompt], max_new_tokens=1, stop_token_ids=(), engine=eng)
        torch.cuda.synchronize()
    by_name: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = by_name.get(e.name, (0.0, 0))
            by_name[e.name] = (t + e.time_range.elapsed_us() / 1e3, n + 1)
    total = sum(t for t, _ in by_name.values())
    parts: dict = {}
    for name, (t, _) in by_name.items():
        parts[part_of(name)] = parts.get(part_of(name), 0.0) + t
    fpt = flops_per_token(cfg, ctx / 2)
    print(f"\none prompt of {ctx} tokens: GPU kernels {total:.0f} ms ({ctx / total * 1e3:,.0f} tok/s of kernel time, "
          f"{ctx * fpt / (total * 1e-3) / 1e12:.0f} TFLOP/s at {fpt / 1e9:.2f} GFLOP/token)")
    print("| part | ms | share |\n|---|---:|---:|")
    for part, t in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {part} | {t:.1f} | {t / total:.1%} |")
    print("| kernel | part | ms | launches |\n|---|---|---:|---:|")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:20]:
        print(f"| {name[:80]} | {part_of(name)} | {t:.1f} | {n} |")
    # the same GPU time by the torch op that launched it (which copy, which elementwise op)
    ops = [e for e in prof.key_averages() if e.self_device_time_total > 0 and e.key != "Command Buffer Full"
           and e.device_type == torch.autograd.DeviceType.CPU]
    print("| torch op (launching) | GPU ms | calls |\n|---|---:|---:|")
    for e in sorted(ops, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"| {e.key[:60]} | {e.self_device_time_total / 1e3:.1f} | {e.count} |")
    # where the copies and elementwise ops come from: the package's frames of each call site
    print("| torch op | GPU ms | calls | call site (kernelgate frames, innermost first) |\n|---|---:|---:|---|")
    sites = [e for e in prof.key_averages(group_by_stack_n=12) if e.self_device_time_total > 0
             and e.key in ("aten::copy_", "aten::mul", "aten::mul_", "aten::add", "aten::index", "aten::fill_")]
    merged = {}   # (stacks differing only outside the shown frames -- one per layer -- are one row)
    for e in sites:
        frames = [f.split("kernelgate/", 1)[1] for f in e.stack if "kernelgate/" in f and "/bench/" not in f][:3]
        key = (e.key, " < ".join(frames) or "?")
        t, n = merged.get(key, (0.0, 0))
        merged[key] = (t + e.self_device_time_total, n + e.count)
    for (op, where), (t, n) in sorted(merged.items(), key=lambda kv: -kv[1][0])[:15]:
        print(f"| {op} | {t / 1e3:.1f} | {n} | {where} |")


if __name__ == "__main__":
    main()
