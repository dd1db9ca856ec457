"""The Gated DeltaNet family end to end (issue 38): Qwen3.5-MoE at real width (the 35B-A3B widths:
transformers' Qwen3_5MoeTextConfig defaults) through `kernelgate.generate` on a reused engine,
beside the byte floor and HF transformers (+ fla where installed) on the same checkpoint.

    PYTHONPATH=. python bench/e2e/qwen_e2e.py                      # both parts (an H200: ~70 GB at 40 layers)
    PYTHONPATH=. python bench/e2e/qwen_e2e.py --parts hf --ckpt /tmp/kernelgate-ckpt/qwen35-4l
    PYTHONPATH=. python bench/e2e/qwen_e2e.py --tiny --device cpu  # smoke run anywhere

Parts:
  hf    --hf-layers (4) layers (3 GDN : 1 attention), a checkpoint written by transformers'
        save_pretrained (at --ckpt; reused when it is there) and loaded by kernelgate.load_model.
        Check first, on 2 prompts x 48 tokens: kernelgate fp32 against HF fp32 (rel err of the
        logits), kernelgate bf16 and HF bf16 against HF fp32, argmax agreement. Then decode tok/s
        at --batches: kernelgate (median of the steps that decode every sequence, second call on
        the engine) and HF (its own cached forward, one token per step), the ratio, the byte floor.
  full  --layers (40) layers, seeded random weights built on the device (bf16): decode tok/s at B1
        and B64 against the byte floor, a --prefill (32,768) token prompt's prefill rate (the
        engine's prefill steps, second call), peak device memory.
Byte floor (kimi_e2e.decode_floor): every weight but the routed experts and the embedding, the
expected distinct experts of a uniform top-k of the batch, the shared expert, each sequence's GDN
and conv states read and written and its K/V cache, read once at --hbm-gbps. Beside it the same
floor with the experts as the run routes them (kimi_e2e.routed_distinct: a few eager steps' top-k
ids counted): random weights may route a batch to fewer experts than a uniform top-k.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from fp8_decode import _gb, _peak, _prompts, _reset_peak, _sync, _table, decode_rate, forms  # noqa: E402
from kimi_e2e import decode_floor, routed_distinct  # noqa: E402

TINY = {"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def hf_config(layers: int, tiny: bool):
    """transformers' Qwen3.5-MoE text config (its defaults are the 35B-A3B widths), `layers` deep,
    full attention every 4th layer."""
    from transformers import Qwen3_5MoeTextConfig
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return Qwen3_5MoeTextConfig(num_hidden_layers=layers, layer_types=kinds, **(TINY if tiny else {}))


def write_checkpoint(folder: Path, layers: int, tiny: bool, device) -> None:
    """A Qwen3.5-MoE checkpoint written by transformers (random init, bf16)."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3_5MoeForCausalLM(hf_config(layers, tiny)).to(torch.bfloat16)
    with torch.no_grad():          # norms off HF's init (zeros / ones), so that every weight matters
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(folder)
    del hf


def hf_load(folder: Path, device, dtype):
    import torch
    from transformers import Qwen3_5MoeForCausalLM
    with torch.device(device):
        return Qwen3_5MoeForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_decode(model, batch: int, prompt: int, steps: int, warm: int = 2) -> float:
    """HF's own cached decode: one forward per token, greedy, tokens/s after `warm` steps."""
    import torch
    ids = torch.randint(0, min(1000, model.config.vocab_size), (batch, prompt), device=model.device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for i in range(warm + steps):
            if i == warm:
                _sync(model.device)
                t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        _sync(model.device)
    return batch * steps / (time.perf_counter() - t0)


def engine_for(model, batches, length: int, long: int = 0):
    """One engine for every batch here (and one `long`-token prompt), its cache pinned."""
    from kernelgate.engine import Engine
    bs = 64
    blocks = max(max(batches) * -(-length // bs), -(-(long + 16) // bs)) + 4
    return Engine(model, max_num_seqs=max(batches), max_model_len=max(length, long + 16), block_size=bs,
                  num_cache_blocks=blocks)


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def part_hf(args, device) -> dict:
    import torch

    import kernelgate
    folder = Path(args.ckpt)
    if not (folder / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(folder, args.hf_layers, args.tiny, device)
        print(f"  checkpoint written by transformers at {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    ids = torch.randint(0, 1000 if not args.tiny else 200, (2, 48), generator=torch.Generator().manual_seed(3))
    ids = ids.to(device)
    out = {}
    with torch.no_grad():
        ref = hf_load(folder, device, torch.float32)
        ref_logits = ref(input_ids=ids).logits.float()
        del ref
        ours32 = kernelgate.load_model(folder, device=device, dtype=torch.float32)
        ours32_logits = ours32(ids).float()
        kernelgate.release(ours32)
        del ours32
        hf = hf_load(folder, device, torch.bfloat16)
        hf_logits = hf(input_ids=ids).logits.float()
        ours = kernelgate.load_model(folder, device=device, dtype=torch.bfloat16)
        ours_logits = ours(ids).float()
    agree = lambda x: float((x.argmax(-1) == ref_logits.argmax(-1)).float().mean())  # noqa: E731
    check = [["kernelgate fp32", f"{rel(ours32_logits, ref_logits):.2e}", f"{agree(ours32_logits):.3f}"],
             ["kernelgate bf16", f"{rel(ours_logits, ref_logits):.2e}", f"{agree(ours_logits):.3f}"],
             ["HF bf16", f"{rel(hf_logits, ref_logits):.2e}", f"{agree(hf_logits):.3f}"]]
    _table(f"check: logits against HF fp32 ({args.hf_layers} layers, 2 x 48 tokens)",
           ["model", "rel err", "argmax agreement"], check)
    out["check"] = check
    if rel(ours32_logits, ref_logits) > 1e-3:
        print("qwen_e2e: kernelgate fp32 does not match HF fp32: no speed figures", flush=True)
        out["failed"] = True
        return out
    _gc(device)
    batches = [int(b) for b in args.batches.split(",")]
    length = args.prompt + args.new + 8
    eng = engine_for(ours, batches, length)
    rows = []
    for b in batches:
        decode_rate(ours, eng, b, args.prompt, args.new, seed=100 + b)        # graphs, autotuning
        rate = decode_rate(ours, eng, b, args.prompt, args.new, seed=200 + b)
        theirs = hf_decode(hf, b, args.prompt, steps=args.hf_steps)
        floor = decode_floor(ours, b, length, args.hbm_gbps)
        rows.append([str(b), f"{rate:,.1f}", f"{floor:,.0f}", f"{rate / floor:.3f}", f"{theirs:,.1f}",
                     f"{rate / theirs:.1f}x"])
        print(f"    B{b}: kernelgate {rate:,.1f} tok/s (floor {floor:,.0f}), HF {theirs:,.1f}", flush=True)
    eng.close()
    kernelgate.release(ours)
    _table(f"decode, {args.hf_layers} layers real width (Qwen3.5-MoE 35B-A3B widths), bf16, checkpoint by "
           f"transformers, prompts of {args.prompt}, byte floor at {args.hbm_gbps:,.0f} GB/s",
           ["batch", "kernelgate tok/s", "byte floor tok/s", "of floor", "HF transformers tok/s", "kernelgate / HF"],
           rows)
    out["decode"] = rows
    return out


def _gc(device):
    import gc
    gc.collect()
    _reset_peak(device)


def part_full(args, device) -> dict:
    import torch

    import kernelgate
    from kernelgate.models import Qwen3NextConfig
    from kernelgate.models.qwen3_next import build
    from kernelgate.serving.drive import Timing
    from kernelgate import registry
    cfg = Qwen3NextConfig.from_dict(hf_config(args.layers, args.tiny).to_dict())
    _reset_peak(device)
    t0 = time.perf_counter()
    model = build(cfg, device=device, dtype=torch.bfloat16, seed=0)
    _sync(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"  {args.layers} layers: {weights / 1e9:.2f} GB of weights built in {time.perf_counter() - t0:.1f} s",
          flush=True)
    batches = [int(b) for b in args.full_batches.split(",")]
    length = args.prompt + args.new + 8
    rows, first, kinds = [], None, forms(args.forms)
    for i, (label, probes) in enumerate(kinds):  # each on a new engine (fresh graphs); the prefill on the last
        for mod, kw in probes:
            print(f"    {mod.install(**kw)}", flush=True)
        registry._plan.clear()
        eng = engine_for(model, batches, length, long=args.prefill)
        tokens = []
        try:
            for b in batches:
                decode_rate(model, eng, b, args.prompt, args.new, seed=100 + b)
                rate = decode_rate(model, eng, b, args.prompt, args.new, seed=200 + b, tokens=tokens)
                floor = decode_floor(model, b, length, args.hbm_gbps)
                hit = routed_distinct(model, b, args.prompt)
                routed = decode_floor(model, b, length, args.hbm_gbps, distinct=hit)
                rows.append([f"decode B{b}{label}", f"{rate:,.1f} tok/s", f"{floor:,.0f} tok/s", f"{rate / floor:.3f}",
                             f"{hit:.1f}: {routed:,.0f} tok/s, {rate / routed:.3f}"])
                print(f"    B{b}{label}: {rate:,.1f} tok/s (floor {floor:,.0f}; {hit:.1f} experts hit a layer as "
                      f"routed: floor {routed:,.0f})", flush=True)
        finally:
            for mod, _ in probes:
                mod.uninstall()
        if first is None:
            first = tokens
        else:
            same = sum(a == b for a, b in zip(first, tokens))
            print(f"    greedy tokens{label}: {same} of {len(first)} sequences as the first form's", flush=True)
        if i < len(kinds) - 1:
            eng.close()
    for call in range(2):                        # the first compiles the chunk shapes; another prompt
        t = Timing()                             # each time (the prefix cache would serve a repeat)
        prompt = _prompts(1, args.prefill, cfg.vocab_size, 5 + call)
        t0 = time.perf_counter()
        kernelgate.generate(model, prompt, max_new_tokens=1, stop_token_ids=(), timing=t, engine=eng)
        wall = time.perf_counter() - t0
    rows.append([f"prefill {args.prefill:,} tokens", f"{t.rate('prefill'):,.0f} tok/s (steps), "
                 f"{args.prefill / wall:,.0f} (wall)", "", "", ""])
    rows.append(["peak device memory", f"{_gb(_peak(device))} GB ({weights / 1e9:.2f} GB weights)", "", "", ""])
    eng.close()
    kernelgate.release(model)
    _table(f"full depth: {args.layers} layers real width (Qwen3.5-MoE 35B-A3B), random weights, bf16, "
           f"prompts of {args.prompt}, byte floor at {args.hbm_gbps:,.0f} GB/s",
           ["what", "kernelgate", "byte floor", "of floor", "experts hit a layer as routed: floor, of it"], rows)
    return {"full": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="hf,full", help="hf,full (ckpt: only write the hf part's checkpoint)")
    ap.add_argument("--hf-layers", type=int, default=4)
    ap.add_argument("--ckpt", default="/tmp/kernelgate-ckpt/qwen35-4l", help="the hf part's checkpoint folder")
    ap.add_argument("--layers", type=int, default=40, help="layers of the full part")
    ap.add_argument("--batches", default="1,16,64", help="the hf part's decode batches")
    ap.add_argument("--full-batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--hf-steps", type=int, default=16, help="HF decode steps timed")
    ap.add_argument("--prefill", type=int, default=32768)
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth of the byte floor (H200: 4.8 TB/s)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a smoke run of this script, e.g. on a CPU)")
    ap.add_argument("--json", help="also write the tables here")
    ap.add_argument("--forms", default="none", help="full: ';'-separated decode forms, as fp8_decode.py's --forms "
                    "(e.g. 'none;force:greedy_tokens=native'); the prefill runs with the last")
    args = ap.parse_args(argv)
    import torch

    from kernelgate import platform
    device = torch.device(args.device) if args.device else platform.default_device()
    if not args.tiny and device.type == "cpu":
        print("qwen_e2e: real width needs an accelerator (or --tiny); nothing measured")
        return 1
    if args.tiny:
        args.layers, args.batches, args.full_batches = 4, "1,4", "1,4"
        args.new, args.hf_steps, args.prefill = 8, 4, 300
    t0 = time.perf_counter()
    print(f"qwen_e2e on {platform.current().device_name or device} ({platform.current().name})", flush=True)
    result = {}
    folder = Path(args.ckpt)
    if "ckpt" in args.parts.split(",") and not (folder / "config.json").exists():
        write_checkpoint(folder, args.hf_layers, args.tiny, device)
        print(f"checkpoint written by transformers at {folder} ({time.perf_counter() - t0:.0f} s in)", flush=True)
    for part, fn in (("hf", part_hf), ("full", part_full)):
        if part in args.parts.split(","):
            result[part] = fn(args, device)
            print(f"({time.perf_counter() - t0:.0f} s in)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 1 if result.get("hf", {}).get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
