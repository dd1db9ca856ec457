"""Tensor / expert parallel end to end: TP=1 vs TP=2 (expert parallel on), through kernelgate.generate.

    PYTHONPATH=. python bench/e2e/tp_e2e.py [--layers 4] [--ckpt /tmp/kg-tp-ckpt] [--profile]
    KERNELGATE_GRAPHS=0 PYTHONPATH=. python bench/e2e/tp_e2e.py ...     # the same, decoding eagerly

Needs two devices (nvidia-h200-x2: NCCL, NVLink multicast off: NCCL_NVLS_ENABLE=0 is set for
every process). Writes a random bf16 checkpoint at Kimi-Linear-48B-A3B widths once, then runs
each configuration in a fresh process (clean memory counters, one process group per job):
  - correctness: TP=2 logits of a 2 x 48 token forward vs TP=1 (bf16: rel err printed; random
    weights put MoE routing near ties, so bf16 flips a few experts; > 0.1 is flagged);
  - decode tok/s at B=64 and the decode step at B=1 (ms), captured decode graphs, cache pinned;
  - per rank: decode graph shapes captured (every rank replays the same graphs, NCCL
    all-reduces inside), or why that rank decodes eagerly;
  - per-device peak memory (torch's max_memory_allocated on every rank);
  - the byte floor of the B=1 step per device (weights a B=1 step reads / 4245 GB/s copy bw);
  - --profile: the all-reduce share of TP=2 decode steps at B=1 and B=64 on rank 0, as they run
    (captured graphs unless KERNELGATE_GRAPHS=0): NCCL kernel time / all kernel time, and NCCL
    microseconds per step.
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
    from kernelgate.serving.drive import Timing
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
        stats = model.rank_stats()
        out["peak_gib"] = [s["peak_bytes"] / 2**30 for s in stats]
        out["graphs"] = [s["graphs"] if s["graphs_off"] is None else f"off: {s['graphs_off']}" for s in stats]
        if args.profile:
            out["allreduce"] = {f"B{b}": profile_share(model, b) for b in (1, 64)}
    torch.save(logits, args.out + ".logits.pt")
    Path(args.out).write_text(json.dumps(out))
    if tp > 1:
        model.close()


def profile_share(model, batch: int, steps: int = 16) -> dict:
    """All-reduce share of `steps` decode steps of `batch` sequences on rank 0, as the engine runs
    them (graphs captured before the profile starts): NCCL kernels' time over all kernels' time."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kernelgate.engine import Engine, SamplingParams
    warm = 4
    eng = Engine(model, max_num_seqs=batch, max_model_len=PROMPT + warm + steps + 8,
                 num_cache_blocks=batch * -(-(PROMPT + warm + steps + 8) // 64))
    g = torch.Generator().manual_seed(2)
    for i in range(batch):
        eng.add_request(str(i), torch.randint(0, 160000, (PROMPT,), generator=g).tolist(),
                        SamplingParams(max_new_tokens=warm + steps + 4, stop_token_ids=()))
    while eng.last_step is None or eng.last_step.kind != "decode":
        eng.step()
    for _ in range(warm):                      # any capture happens here, not in the profile
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    total = sum(e.time_range.elapsed_us() for e in kernels)
    nccl = sum(e.time_range.elapsed_us() for e in kernels if "nccl" in e.name.lower())
    n_nccl = sum(1 for e in kernels if "nccl" in e.name.lower())
    eng.close()
    return {"share": nccl / total if total else 0.0, "nccl_us_per_step": nccl / steps,
            "nccl_kernels_per_step": n_nccl / steps, "kernel_us_per_step": total / steps}


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
    for b, a in res[2].get("allreduce", {}).items():
        print(f"| all-reduce share of a {b} decode step (rank 0) | | {100 * a['share']:.1f}% "
              f"({a['nccl_us_per_step']:.0f} of {a['kernel_us_per_step']:.0f} us kernel time, "
              f"{a['nccl_kernels_per_step']:.0f} NCCL kernels) | | |")
    print(f"\ndecode graphs per rank at TP=2 (shapes captured, or why eager): {res[2].get('graphs')}")


if __name__ == "__main__":
    main()
