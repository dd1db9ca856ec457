"""Kimi Linear at real width on one device: loading, long prompts, decode against context,
and the full 27-layer model (issue 14). Each part prints a table; cheap correctness checks run
first (a part whose check fails prints why and measures nothing).

    PYTHONPATH=. python bench/e2e/kimi_memory.py [--parts load,prefill,decode] [--load-layers 8]
    PYTHONPATH=. python bench/e2e/kimi_memory.py --parts full          # 27 layers, ~98 GB of weights
    PYTHONPATH=. python bench/e2e/kimi_memory.py --tiny --device cpu   # smoke run anywhere

Parts:
  load     write a real-width checkpoint of --load-layers layers (released layout, shards of
           4 GB) to --dir, then `kernelgate.load_model` it: peak device memory against the
           weights (bound: 1.05 x weights + 1 GiB) and GB/s (page cache warm: just written).
           Check: a few loaded tensors equal the written ones bit for bit.
  prefill  4 layers, a --long-token prompt at max_num_batched_tokens --budget through
           `kernelgate.generate`: peak memory against weights + cache (bound: + 4 GiB) and
           prefill tok/s (of a second prompt: the first one's rate is printed) next to one
           unchunked --budget-token step. Check: the last-token logits
           of a 2 x budget prompt prefilled in 2 chunks vs in one step (bf16, rel err < 2e-2).
  decode   4 layers, decode ms/step through `kernelgate.generate` at 1k and --long context,
           batch 1 and 8.
  full     27 layers built with random weights on the device (build time), cache sized by
           gpu_memory_utilization (capacity printed), a --long prompt, 4 x --long / 4 requests, 4 x --long:
           peak memory, prefill and decode tok/s.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

GiB = 1 << 30


def _mod(device):
    return getattr(torch, device.type, None) if device.type != "cpu" else None


def _sync(device):
    m = _mod(device)
    if m is not None:
        m.synchronize()


def _reset_peak(device):
    m = _mod(device)
    if m is not None:
        m.synchronize()
        m.empty_cache()
        m.reset_peak_memory_stats()


def _peak(device) -> float:
    m = _mod(device)
    return float("nan") if m is None else m.max_memory_allocated()


def _config(layers: int, tiny: bool):
    from kernelgate.models import real_width, tiny as tiny_cfg
    if tiny:
        return tiny_cfg(num_hidden_layers=layers, vocab_size=1024)
    return real_width(layers)


def _weights(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _table(title, head, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


def _checkpoint_tensors(model):
    """(name, tensor) in the released layout: q/k/v and gate/up split again (views)."""
    c = model.config
    for name, p in model.named_parameters():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[: -len("qkv_proj.weight")]
            for x, t in zip("qkv", p.chunk(3, 0)):
                yield base + f"{x}_proj.weight", t
        elif name.endswith("mlp.gate_up_proj.weight") or name.endswith("shared_experts.gate_up_proj.weight"):
            base = name[: -len("gate_up_proj.weight")]
            g, u = p.chunk(2, 0)
            yield base + "gate_proj.weight", g
            yield base + "up_proj.weight", u
        else:
            yield name, p
    del c


def write_checkpoint(model, folder: Path, shard_bytes: int = 4 << 30) -> int:
    """Sharded safetensors + index + config.json; -> bytes written."""
    from dataclasses import asdict

    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, shard, size, n, total = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            fname = f"model-{n:05d}.safetensors"
            save_file({k: v.contiguous().cpu() for k, v in shard.items()}, str(folder / fname))
            weight_map.update({k: fname for k in shard})
            shard, size, n = {}, 0, n + 1
    for name, t in _checkpoint_tensors(model):
        nb = t.numel() * t.element_size()
        if size + nb > shard_bytes:
            flush()
        shard[name], size, total = t, size + nb, total + nb
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    cfg = asdict(model.config)
    cfg["layer_types"] = ["full_attention" if t == "mla" else "linear_attention" for t in cfg["layer_types"]]
    cfg["mlp_layer_types"] = ["sparse" if t == "moe" else "dense" for t in cfg.pop("mlp_types")]
    cfg["moe_router_activation_func"] = cfg.pop("scoring")
    cfg["num_expert_group"] = cfg.pop("n_group")
    cfg["eos_token_id"] = cfg.pop("eos_token_ids")
    cfg["linear_conv_kernel_dim"] = cfg.pop("conv_kernel_size")
    cfg["dtype"] = str(model.dtype).replace("torch.", "")
    (folder / "config.json").write_text(json.dumps(cfg))
    return total


def part_load(args, device):
    import kernelgate
    from kernelgate.models import build
    cfg = _config(args.load_layers, args.tiny)
    folder = Path(args.dir) / f"kimi-{args.load_layers}l"
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    model = build(cfg, device=device, dtype=torch.bfloat16, seed=0)
    _sync(device)
    t_build = time.perf_counter() - t0
    probe = {n: p[:2].clone() for n, p in list(model.named_parameters())[:: max(1, len(list(model.parameters())) // 6)]}
    t0 = time.perf_counter()
    nbytes = write_checkpoint(model, folder)
    t_write = time.perf_counter() - t0
    weights = _weights(model)
    del model
    _reset_peak(device)
    t0 = time.perf_counter()
    loaded = kernelgate.load_model(folder, device=device, dtype=torch.bfloat16)
    _sync(device)
    dt = time.perf_counter() - t0
    peak = _peak(device)
    params = dict(loaded.named_parameters())
    bad = [n for n, v in probe.items() if not torch.equal(params[n][:2], v)]
    if bad:
        print(f"load: loaded tensors differ from the written ones: {bad}; numbers not reported")
        return
    bound = 1.05 * weights + GiB
    _table(f"load_model, {args.load_layers} layers real width, bf16 ({nbytes / 1e9:.2f} GB on disk)",
           ["weights GB", "peak device GB", "peak / weights", "bound GB", "within", "load s", "GB/s",
            "build (random, on device) s", "write s"],
           [[f"{weights / 1e9:.2f}", f"{peak / 1e9:.2f}", f"{peak / weights:.3f}", f"{bound / 1e9:.2f}",
             "yes" if peak <= bound else "NO", f"{dt:.1f}", f"{nbytes / 1e9 / dt:.2f}", f"{t_build:.1f}",
             f"{t_write:.1f}"]])
    del loaded
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


def _prompt(n, seed=0, vocab=1000):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _chunk_check(model, budget, device) -> float:
    """Last-token logits of a 2 x budget prompt: two chunked steps vs one step (rel err)."""
    from kernelgate.models.batch import StepBatch
    from kernelgate.tools.testing import rel_err
    n, bs = 2 * budget, 64
    nb = -(-n // bs)
    ids = torch.tensor(_prompt(n, 5), device=device)
    table = [list(range(nb))]
    one = model.new_cache(1, nb, bs)
    whole = model.step(ids, StepBatch.build([n], [0], [0], device, table, bs), one)
    del one
    two = model.new_cache(1, nb, bs)
    model.step(ids[:budget], StepBatch.build([budget], [0], [0], device, table, bs), two)
    half = model.step(ids[budget:], StepBatch.build([budget], [0], [budget], device, table, bs), two)
    return rel_err(half.float(), whole.float())


def part_prefill(args, model, device):
    import kernelgate
    from kernelgate.engine import Engine
    from kernelgate.serving.drive import Timing
    sys.path.insert(0, str(Path(__file__).parent))
    from kimi_e2e import ours_prefill
    err = _chunk_check(model, args.budget, device)
    print(f"prefill check: 2 chunks of {args.budget} vs one step, last-token logits rel err {err:.2e}")
    if not err < 2e-2:
        print("prefill: chunked prefill disagrees with the unchunked step; numbers not reported")
        return
    unchunked = ours_prefill(model, args.budget, reps=2)
    L, bs = args.long, 64
    blocks = -(-(L + 8) // bs)
    _reset_peak(device)
    eng = Engine(model, max_num_seqs=1, max_model_len=L + 8, max_num_batched_tokens=args.budget, block_size=bs,
                 num_cache_blocks=blocks)
    cache_bytes = eng.runner.cache.nbytes()
    cold = Timing()   # the first long prompt: attention kernels meet their piece shapes (cuDNN plans them)
    kernelgate.generate(model, [_prompt(L, 2)], max_new_tokens=4, stop_token_ids=(), timing=cold, engine=eng)
    _sync(device)
    print(f"first {L}-token prompt: prefill {cold.rate('prefill'):,.0f} tok/s", flush=True)
    t = Timing()
    t0 = time.perf_counter()
    out = kernelgate.generate(model, [_prompt(L, 1)], max_new_tokens=4, stop_token_ids=(), timing=t, engine=eng)
    _sync(device)
    wall = time.perf_counter() - t0
    peak = _peak(device)
    weights = _weights(model)
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 4
    for seed in (3, 4):   # a length that is no multiple of the budget: its last chunk has new shapes
        odd = Timing()
        kernelgate.generate(model, [_prompt(L - L // 43, seed)], max_new_tokens=4, stop_token_ids=(), timing=odd,
                            engine=eng)
        print(f"a {L - L // 43}-token prompt after them: prefill {odd.rate('prefill'):,.0f} tok/s", flush=True)
    _table(f"{L}-token prompt, max_num_batched_tokens {args.budget}, {model.config.num_hidden_layers} layers",
           ["weights GB", "cache GB", "peak GB", "peak - weights - cache GB", "bound (+4 GiB)", "prefill tok/s",
            f"unchunked {args.budget} tok/s", "ratio", "wall s"],
           [[f"{weights / 1e9:.2f}", f"{cache_bytes / 1e9:.2f}", f"{peak / 1e9:.2f}",
             f"{(peak - weights - cache_bytes) / 1e9:.2f}",
             "yes" if peak <= weights + cache_bytes + 4 * GiB else "NO",
             f"{t.rate('prefill'):,.0f}", f"{unchunked:,.0f}", f"{t.rate('prefill') / unchunked:.2f}", f"{wall:.1f}"]])
    del eng


def part_decode(args, model, device):
    import kernelgate
    from kernelgate.tools.benchmark import copy_bandwidth
    from kernelgate.serving.drive import Timing
    sys.path.insert(0, str(Path(__file__).parent))
    from kimi_e2e import decode_floor
    gbps = copy_bandwidth(device) if device.type == "cuda" else 100.0
    rows = []
    for ctx in (min(1024, args.long), args.long):
        for B in (1, 8):
            t = Timing()
            prompts = [_prompt(ctx, 10 + i) for i in range(B)]
            # the prompts prefill one after another (a chunk a step, decodes first); each sequence
            # decodes from its own prefill on, so it must still be running when the last one starts:
            # only steps that decode all B are timed (a long prompt's first sequences would
            # otherwise finish before the last one joined, and B8 would time B1-B2 steps)
            chunks = -(-ctx // max(1, args.budget - B)) + 1
            new = args.decode_steps + 4 + (B - 1) * chunks
            kernelgate.generate(model, prompts, max_new_tokens=new, stop_token_ids=(), timing=t,
                                max_num_batched_tokens=args.budget, num_cache_blocks=B * -(-(ctx + new + 16) // 64),
                                max_model_len=ctx + new + 16)
            steps = [s for s in t.steps if s[0] == "decode" and s[1] == B]
            warm = steps[3:3 + args.decode_steps] or steps
            ms = 1e3 * sum(s[2] for s in warm) / max(1, len(warm))
            floor = decode_floor(model, B, ctx, gbps)
            rows.append([f"{ctx:,}", str(B), f"{ms:.2f}", f"{B * 1e3 / ms:,.0f}", f"{floor:,.0f}: {B * 1e3 / ms / floor:.2f}",
                         str(len(warm))])
            print(f"  decode ctx {ctx} B{B}: {ms:.2f} ms/step (byte floor {B * 1e3 / floor:.2f})", flush=True)
    _table(f"decode step vs context, {model.config.num_hidden_layers} layers, through kernelgate.generate "
           f"(byte floor at {gbps:,.0f} GB/s)", ["context", "batch", "ms/step", "tok/s", "floor tok/s: of it", "steps timed"],
           rows)


def part_full(args, device):
    import kernelgate
    from kernelgate.engine import Engine
    from kernelgate.serving.drive import Timing
    from kernelgate.models import build
    cfg = _config(4 if args.tiny else 27, args.tiny)
    _reset_peak(device)
    t0 = time.perf_counter()
    model = build(cfg, device=device, dtype=torch.bfloat16, seed=0)
    _sync(device)
    t_build = time.perf_counter() - t0
    weights = _weights(model)
    print(f"full model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, {weights / 1e9:.1f} GB, "
          f"built with random weights on {device} in {t_build:.1f} s", flush=True)
    L, short = args.long, args.long // 4
    most_new = 32 + 3 * (-(-L // args.budget) + 1)    # what a 4 x L run below asks for
    eng = Engine(model, max_num_seqs=4, max_model_len=L + most_new + 16, max_num_batched_tokens=args.budget,
                 gpu_memory_utilization=args.util)
    print(eng.capacity.report(), flush=True)
    sys.path.insert(0, str(Path(__file__).parent))
    from kimi_e2e import decode_floor, ours_decode

    from kernelgate.tools.benchmark import copy_bandwidth
    gbps = copy_bandwidth(device) if device.type == "cuda" else 100.0
    rows = []
    long_runs = ((f"1 x {L}", [_prompt(L, 1)]), (f"4 x {short}", [_prompt(short, 2 + i) for i in range(4)]),
                 (f"4 x {L}", [_prompt(L, 6 + i) for i in range(4)]))
    for name, prompts in (() if args.decode_only else long_runs):
        t = Timing()
        B = len(prompts)
        # as in part_decode: every sequence asks for enough tokens to outlast the others' chunked
        # prefills, and decode tok/s counts only steps that decode all B (median: graph captures of
        # batch buckets land in some steps)
        new = 32 + (B - 1) * (-(-len(prompts[0]) // args.budget) + 1)
        t0 = time.perf_counter()
        out = kernelgate.generate(model, prompts, max_new_tokens=new, stop_token_ids=(), timing=t, engine=eng)
        _sync(device)
        wall = time.perf_counter() - t0
        assert all(r.finish_reason == "length" and len(r.token_ids) == new for r in out)
        dec = sorted(s[2] for s in t.steps if s[0] == "decode" and s[1] == B)
        med = B / dec[len(dec) // 2] if dec else 0.0
        floor = decode_floor(model, B, len(prompts[0]) + new, gbps)
        rows.append([name, f"{t.rate('prefill'):,.0f}", f"{med:,.1f} ({len(dec)} steps of {B}; byte floor "
                     f"{floor:,.0f}: {med / floor:.2f})", f"{wall:.1f}", f"{_peak(device) / 1e9:.1f}"])
        print(f"  {name}: prefill {t.rate('prefill'):,.0f} tok/s, decode {med:,.1f} tok/s "
              f"(median of {len(dec)} steps that decode all {B}; byte floor {floor:,.0f})", flush=True)
    cap = eng.capacity
    eng.close()
    del eng
    # single-stream and batch-64 decode against the byte floor (issue 16), engine steps as in kimi_e2e
    for b in (1, 64):
        for flag in (True, False):
            rate = ours_decode(model, b, 64, args.decode_steps, async_scheduling=flag)
            floor = decode_floor(model, b, 64 + args.decode_steps, gbps)
            name = f"decode b{b} ({'async' if flag else 'sync'} steps)"
            rows.append([name, "", f"{rate:,.1f}", f"floor {floor:,.0f}: {rate / floor:.2f}", ""])
            print(f"  {name}: {rate:,.1f} tok/s, byte floor {floor:,.0f} ({rate / floor:.2f})", flush=True)
    _table(f"full model ({cfg.num_hidden_layers} layers, {weights / 1e9:.1f} GB bf16), cache "
           f"{cap.cache_bytes / 1e9:.1f} GB = {cap.cache_tokens:,} tokens, max_num_batched_tokens {args.budget}",
           ["requests", "prefill tok/s", "decode tok/s", "wall s", "peak GB (since build)"], rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="load,prefill,decode")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--load-layers", type=int, default=8, help="layers of the checkpoint written for 'load'")
    ap.add_argument("--dir", default="/tmp/kernelgate-ckpt")
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    ap.add_argument("--long", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--decode-steps", type=int, default=24)
    ap.add_argument("--util", type=float, default=0.9, help="gpu_memory_utilization for 'full'")
    ap.add_argument("--tiny", action="store_true", help="tiny widths, short prompts (smoke run)")
    ap.add_argument("--decode-only", action="store_true", help="'full': only the batch-1 / 64 decode figures")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.tiny:
        args.long, args.budget = min(args.long, 300), min(args.budget, 64)
        args.load_layers = min(args.load_layers, 4)
    parts = args.parts.split(",")
    if "load" in parts:
        part_load(args, device)
    if "prefill" in parts or "decode" in parts:
        from kernelgate.models import build
        model = build(_config(4, args.tiny), device=device, dtype=torch.bfloat16, seed=0)
        if "prefill" in parts:
            part_prefill(args, model, device)
        if "decode" in parts:
            part_decode(args, model, device)
        del model
    if "full" in parts:
        part_full(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
