"""Tensor / expert parallel end to end: TP=1 vs TP=2 (expert parallel on), through kernelgate.generate.

    PYTHONPATH=. python bench/tp_e2e.py [--layers 4] [--ckpt /tmp/kg-tp-ckpt] [--steps 64] [--profile]

Needs two devices (nvidia-h200-x2: NCCL, NVLink multicast off: NCCL_NVLS_ENABLE=0 is set for
every process). Writes a random bf16 checkpoint at Kimi-Linear-48B-A3B widths once, then runs
each configuration in a fresh process (clean memory counters, one process group per job):
  - correctness: TP=2 logits of a 2 x 48 token forward vs TP=1 (bf16: rel err printed; random
    weights put MoE routing near ties, so bf16 flips a few experts; > 0.1 is flagged);
  - decode tok/s at B=64 and the decode step at B=1 (ms), captured decode graphs, cache pinned;
  - per-device peak memory (torch's max_memory_allocated on every rank);
  - the byte floor of the B=1 step per device (weights a B=1 step reads / 4245 GB/s copy bw);
  - --profile: the all-reduce (NCCL kernel) share of an eager TP=2 decode step (rank 0).
Targets (issue 17): B=64 tok/s at TP=2 >= 1.6x TP=1; B=1 step at TP=2 <= 0.7x TP=1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
COPY_BW = 4245e9          # measured device copy bandwidth on one H200 (read + write), bytes / s
PROMPT, NEW = 16, 64


def write_checkpoint(folder: Path, layers: int) -> None:
    import torch

    from kernelgate.models import build, real_width
    from kernelgate.models.loader import save_checkpoint
    if (folder / "model.safetensors").exists():
        return
    model = build(real_width(layers), device="cuda", dtype=torch.bfloat16, seed=0)
    save_checkpoint(model, folder)
    del model
    torch.cuda.empty_cache()


def floor_bytes(config, tp: int, batch: int) -> float:
    """Weight bytes one decode step reads per device (bf16): everything but the routed experts,
    split tp ways (router / latent projections replicated: small), plus the experts the batch
    touches (expected distinct of E under batch * k uniform picks), split tp ways."""
    c = config
    from kernelgate.models import build
    import torch
    with torch.device("meta"):
        m = build(c, device="meta", dtype=torch.bfloat16, seed=None)
    dense = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if ".experts." not in n)
    dense -= m.model.embed_tokens.weight.numel() * 2          # embedding: one row per token
    per_expert = 3 * c.hidden_size * c.moe_intermediate_size * 2
    moe_layers = sum(t == "moe" for t in c.mlp_types)
    touched = c.num_experts * (1 - (1 - 1 / c.num_experts) ** (batch * c.num_experts_per_token))
    return (dense + moe_layers * touched * per_expert) / tp


def child(args) -> None:
    import torch

    import kernelgate
    from kernelgate.engine import Timing
    tp = args.tp
    if tp == 1:
        model = kernelgate.load_model(args.ckpt, dtype=torch.bfloat16)
    else:
        model = kernelgate.load_model(args.ckpt, dtype=torch.bfloat16, tensor_parallel_size=tp,
                                      enable_expert_parallel=True)
    ids = torch.randint(0, 160000, (2, 48), generator=torch.Generator().manual_seed(0))
    logits = model(ids.to(model.device)).float().cpu()
    out = {"tp": tp}
    g = torch.Generator().manual_seed(1)
    for batch in (64, 1):
        prompts = [torch.randint(0, 160000, (PROMPT,), generator=g).tolist() for _ in range(batch)]
        blocks = batch * -(-(PROMPT + NEW) // 64)
        kw = dict(max_new_tokens=NEW, max_num_seqs=batch, max_model_len=PROMPT + NEW, num_cache_blocks=blocks,
                  stop_token_ids=[])
        kernelgate.generate(model, prompts, **{**kw, "max_new_tokens": 4})          # warm-up: graphs, autotune
        t = Timing()
        kernelgate.generate(model, prompts, timing=t, **kw)
        steps = sum(1 for k, _, _ in t.steps if k == "decode")
        out[f"B{batch}"] = {"tok_s": t.rate("decode"), "step_ms": 1e3 * t.decode_s / max(1, steps)}
    if tp == 1:
        out["peak_gib"] = [torch.cuda.max_memory_allocated() / 2**30]
    else:
        out["peak_gib"] = [s["peak_bytes"] / 2**30 for s in model.rank_stats()]
    if args.profile and tp > 1:
        out["allreduce_share"] = profile_share(model)
    torch.save(logits, args.out + ".logits.pt")
    Path(args.out).write_text(json.dumps(out))
    if tp > 1:
        model.close()


def profile_share(model) -> float:
    """NCCL kernels' share of device time over 16 eager B=8 decode steps on rank 0."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import kernelgate
    prompts = [[i + 1] * PROMPT for i in range(8)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        kernelgate.generate(model, prompts, max_new_tokens=16, graphs=False, stop_token_ids=[],
                            num_cache_blocks=8 * 2)
    total = nccl = 0.0
    for e in prof.key_averages():
        t = e.device_time_total
        total += t
        if "nccl" in e.key.lower():
            nccl += t
    return nccl / total if total else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ckpt", default="/tmp/kg-tp-ckpt")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import torch

    from kernelgate.models import real_width
    folder = Path(args.ckpt)
    t0 = time.time()
    write_checkpoint(folder, args.layers)
    print(f"checkpoint {folder} ({time.time() - t0:.0f} s)", flush=True)
    res = {}
    for tp in (1, 2):
        out = f"/tmp/kg-tp-{tp}.json"
        cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--ckpt", str(folder), "--out", out]
        if args.profile:
            cmd.append("--profile")
        subprocess.run(cmd, check=True, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
        res[tp] = json.loads(Path(out).read_text())
        res[tp]["logits"] = torch.load(out + ".logits.pt")
    a, b = res[1]["logits"], res[2]["logits"]
    err = ((b - a).norm() / a.norm()).item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    cfg = real_width(args.layers)
    print(f"\ncorrectness: TP=2 vs TP=1 logits rel err {err:.3e}, argmax agree {agree:.3f}"
          + ("  <-- CHECK" if err > 0.1 else ""))
    print(f"\n| {args.layers} layers, bf16 | TP=1 | TP=2 (EP) | ratio | target |")
    print("|---|---|---|---|---|")
    r64 = res[2]["B64"]["tok_s"] / res[1]["B64"]["tok_s"]
    r1 = res[2]["B1"]["step_ms"] / res[1]["B1"]["step_ms"]
    print(f"| decode tok/s B=64 | {res[1]['B64']['tok_s']:,.0f} | {res[2]['B64']['tok_s']:,.0f} | {r64:.2f}x | >= 1.6x |")
    print(f"| decode step B=1 (ms) | {res[1]['B1']['step_ms']:.3f} | {res[2]['B1']['step_ms']:.3f} | {r1:.2f}x | <= 0.7x |")
    f1, f2 = (floor_bytes(cfg, tp, 1) / COPY_BW * 1e3 for tp in (1, 2))
    print(f"| B=1 byte floor per device (ms) | {f1:.3f} | {f2:.3f} | {f2 / f1:.2f}x | |")
    f1, f2 = (floor_bytes(cfg, tp, 64) / COPY_BW * 1e3 for tp in (1, 2))
    print(f"| B=64 byte floor per device (ms) | {f1:.3f} | {f2:.3f} | | |")
    print(f"| peak memory per device (GiB) | {', '.join(f'{x:.2f}' for x in res[1]['peak_gib'])} | "
          f"{', '.join(f'{x:.2f}' for x in res[2]['peak_gib'])} | | |")
    if "allreduce_share" in res[2]:
        print(f"| all-reduce share of an eager B=8 step (rank 0) | | {100 * res[2]['allreduce_share']:.1f}% | | |")


if __name__ == "__main__":
    main()
