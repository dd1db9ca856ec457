"""FP8 weights end to end (issue 37): Kimi Linear at real width, bf16 against 128 x 128 block FP8
quantized on load -- decode tokens/s at batch 1 and 64 through `kernelgate.generate` on a reused
engine beside the byte floor, peak device memory, and the error FP8 adds.

    PYTHONPATH=. python bench/e2e/fp8_decode.py                      # 27 layers, ~98 GB bf16 (an H200)
    PYTHONPATH=. python bench/e2e/fp8_decode.py --layers 4 --parts decode
    PYTHONPATH=. python bench/e2e/fp8_decode.py --error-dir /tmp/kg  # the error part from a checkpoint on disk
    PYTHONPATH=. python bench/e2e/fp8_decode.py --tiny --device cpu  # smoke run anywhere
    PYTHONPATH=. python bench/e2e/fp8_decode.py --parts decode --batches 1 --forms "none;gemv_inflight:ahead=2"
    PYTHONPATH=. python bench/e2e/fp8_decode.py --parts decode --weights fp8 --memory-cap-gib 79.2 --long 32768

Weights: seeded random tensors in the released layout (per-expert w1 / w2 / w3, q / k / v), each made
on the device when the loader reads it (`RandomSource`: a 27-layer checkpoint is ~98 GB, more than
the machine's disk), and loaded through the streaming loader (`load_weights`): bf16 as they are, FP8
quantized as they stream. One model is on the device at a time.

Parts:
  error   --error-layers (4) layers loaded fp32, bf16 and FP8 from the same tensors; over 16 prompts
          of 32 tokens: max (over prompts) relative error of the logits at every position, argmax
          agreement, and 16 greedy tokens through generate (prompts whose tokens all agree), FP8 vs
          bf16 beside bf16 vs fp32. --error-dir DIR writes the checkpoint there (save_checkpoint) and
          loads it with load_model(path, quantization=...) instead.
  decode  --layers (27) layers, bf16 then FP8: load time and peak against the bound (1.05 x loaded
          bytes + 1 GiB); decode tok/s at B1 and B64 (median of the steps that decode every
          sequence, second call on the engine: graphs and autotuning done in the first); the byte
          floor, active bytes per step / --hbm-gbps (weights but embedding and routed experts, the
          expected distinct experts of a uniform top-8 of the batch, one embedding row per token,
          KDA states and MLA cache); peak memory while decoding. --long N: then one N-token prompt
          (and 16 new tokens) on an engine whose cache is sized from device memory (the engine's
          gpu_memory_utilization 0.9, of the cap where one is set): its capacity, prefill tok/s, peak.
  --memory-cap-gib G  an 80 GB card's budget on a larger one (an H100's 79.2 GiB): torch's allocator
          is capped at G GiB (set_per_process_memory_fraction: an allocation beyond it fails as on that
          card) and the engines size their caches from it. The memory figures hold for that card; the
          rates are the larger card's bandwidth.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import zlib
from pathlib import Path

GiB = 1 << 30


def _mod(device):
    import torch
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


def _gb(nbytes: float) -> str:
    return "n/a" if nbytes != nbytes else f"{nbytes / 1e9:.2f}"


class RandomSource:
    """A checkpoint of seeded random tensors in the released layout, each made on `device` when the
    loader reads it (from a seed of its own name: every reader gets the same values). Values as
    kimi_linear.random_weights draws them (norms ~1, decay in range, 0.02 projections)."""

    def __init__(self, config, device, dtype, seed: int = 0):
        import torch

        from kernelgate.models import build
        self.device, self.seed, self.folder, self.fp8 = device, seed, "random (seeded, made on the device)", None
        self.where = {}
        for n, p in build(config, device="meta", dtype=dtype, seed=None).named_parameters():
            shape = tuple(p.shape)
            if n.endswith("qkv_proj.weight"):
                for x in "qkv":
                    self.where[n.replace("qkv_proj", f"{x}_proj")] = ((shape[0] // 3, shape[1]), p.dtype)
            elif n.endswith("gate_up_proj.weight"):
                for x in ("gate_proj", "up_proj"):
                    self.where[n.replace("gate_up_proj", x)] = ((shape[0] // 2, shape[1]), p.dtype)
            elif n.endswith("experts.gate_up_proj"):
                base = n[:-len("gate_up_proj")]
                for e in range(shape[0]):
                    for w in (1, 3):
                        self.where[f"{base}{e}.w{w}.weight"] = ((shape[1] // 2, shape[2]), p.dtype)
            elif n.endswith("experts.down_proj"):
                base = n[:-len("down_proj")]
                for e in range(shape[0]):
                    self.where[f"{base}{e}.w2.weight"] = (shape[1:], p.dtype)
            else:
                self.where[n] = (shape, p.dtype)
        self._torch = torch

    def __contains__(self, name):
        return name in self.where

    def shape(self, name):
        return self.where[name][0]

    def dtype(self, name):
        return self.where[name][1]

    def nbytes(self, name):
        shape, dt = self.where[name]
        n = 1
        for s in shape:
            n *= s
        return n * dt.itemsize

    def raw_name(self, name):
        return name

    def make(self, name):
        torch = self._torch
        shape, dt = self.where[name]
        g = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = torch.empty(shape, dtype=dt, device=self.device)
        if "norm" in name:
            return t.normal_(1.0, 0.1, generator=g)
        if name.endswith("A_log"):
            return t.uniform_(1, 16, generator=g).log_()
        if name.endswith("dt_bias"):
            dt_ = t.uniform_(-6.9, -2.3, generator=g).exp_()
            return dt_ + torch.log(-torch.expm1(-dt_))
        if name.endswith("e_score_correction_bias"):
            return t.normal_(0.0, 0.01, generator=g)
        if "conv1d" in name:
            return t.normal_(0.0, 0.3, generator=g)
        return t.normal_(0.0, 0.02, generator=g)

    def copy(self, name, dest, stager):
        dest.copy_(self.make(name).reshape(dest.shape))

    def copy_slice(self, name, dest, dim, a, b, stager, lead=None):
        t = self.make(name)
        t = t if lead is None else t[lead[0]:lead[1]]
        dest.copy_(t.narrow(dim, a, b - a).reshape(dest.shape))

    def close(self):
        pass


def config_for(layers: int, tiny: bool):
    from kernelgate.models import real_width, tiny as tiny_cfg
    if tiny:   # 128-row parts, so that the tiny model is FP8 where the real one is
        return tiny_cfg(vocab_size=1024, hidden_size=192, intermediate_size=256, moe_intermediate_size=128,
                        num_hidden_layers=layers, linear_num_heads=2, linear_head_dim=128, num_attention_heads=2,
                        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, kv_lora_rank=64)
    return real_width(layers)


def load(config, device, dtype, quantization, source):
    """(model, load seconds, peak device bytes of the load, weight bytes)."""
    import torch

    from kernelgate.models import build
    from kernelgate.models.loader import load_weights
    _reset_peak(device)
    t0 = time.perf_counter()
    model = build(config, device=device, dtype=dtype, seed=None, quantization=quantization)
    with torch.no_grad():
        load_weights(model, source)
    _sync(device)
    dt = time.perf_counter() - t0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, dt, _peak(device), weights


def free(holder: dict, device):
    """Drop holder["model"] (the caller's only reference: a name bound in the caller's loop would keep
    the whole model on the device while the next one loads), its kept engine first."""
    import kernelgate
    kernelgate.release(holder.pop("model"))
    gc.collect()
    _reset_peak(device)


def _prompts(n: int, length: int, vocab: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, min(vocab, 1000), (length,), generator=g).tolist() for _ in range(n)]


PAIRS = (("fp8", "bf16"), ("bf16", "fp32"), ("fp8 weights, fp32 activations", "fp32"))


def _pair_row(out: dict, a: str, b: str) -> list:
    """[pair, max rel err of the logits over the prompts, argmax agreement, prompts with equal greedy tokens]."""
    (la, ga), (lb, gb) = out[a], out[b]
    rel = max(float((x - y).norm() / y.norm()) for x, y in zip(la, lb))
    agree = float((la.argmax(-1) == lb.argmax(-1)).float().mean())
    return [f"{a} vs {b}", f"{rel:.3e}", f"{agree:.3f}", f"{sum(x == y for x, y in zip(ga, gb))} / {len(ga)}"]


def part_error(args, device) -> list:
    import torch

    import kernelgate
    from kernelgate.models.loader import load_model, save_checkpoint
    cfg = config_for(args.error_layers, args.tiny)
    prompts = _prompts(16, 32, cfg.vocab_size, 7)
    ids = torch.tensor(prompts, device=device)
    src = RandomSource(cfg, device, torch.bfloat16, seed=1)
    folder = None
    if args.error_dir:
        held = {"model": load(cfg, device, torch.bfloat16, None, src)[0]}
        folder = save_checkpoint(held["model"], Path(args.error_dir) / f"kimi-{args.error_layers}l")
        free(held, device)
    out = {}
    for name, dtype, q in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                           ("fp8", torch.bfloat16, "fp8"), ("fp8 weights, fp32 activations", torch.float32, "fp8")):
        if folder is not None:
            _reset_peak(device)
            held = {"model": load_model(folder, device=device, dtype=dtype, quantization=q)}
        else:
            held = {"model": load(cfg, device, dtype, q, src)[0]}
        logits = held["model"](ids).float().cpu()                               # [16, 32, V]
        # (eager steps: capturing decode graphs for each of the four models costs more than 16 steps)
        greedy = [r.token_ids for r in kernelgate.generate(held["model"], prompts, max_new_tokens=16,
                                                           stop_token_ids=(), graphs=False)]
        out[name] = (logits, greedy)
        print(f"  error: {name} loaded and run", flush=True)
        free(held, device)
        for a, b in PAIRS:          # each pair as soon as both sides ran (a cut-off run keeps what it had)
            if name in (a, b) and a in out and b in out:
                print(f"  error: {' | '.join(_pair_row(out, a, b))}", flush=True)
    rows = [_pair_row(out, a, b) for a, b in PAIRS]
    _table(f"error FP8 adds: {args.error_layers} layers, 16 prompts x 32 tokens, random weights "
           f"({'checkpoint on disk' if folder else 'streamed from RandomSource'})",
           ["pair", "max rel err of logits", "argmax agreement", "prompts with equal 16 greedy tokens"], rows)
    return rows


def decode_rate(model, engine, batch: int, prompt: int, new: int, seed: int, tokens: list | None = None) -> float:
    """Median decode tok/s of the steps that decode every one of `batch` sequences (generate on `engine`);
    the greedy tokens are appended to `tokens` if given."""
    import kernelgate
    from kernelgate.serving.drive import Timing
    t = Timing()
    out = kernelgate.generate(model, _prompts(batch, prompt, model.config.vocab_size, seed), max_new_tokens=new,
                              stop_token_ids=(), timing=t, engine=engine)
    if tokens is not None:
        tokens.extend(r.token_ids for r in out)
    steps = sorted(s[2] for s in t.steps if s[0] == "decode" and s[1] == batch)
    return batch / steps[len(steps) // 2] if steps else float("nan")


class _Forced:
    """A form that dispatches with registry overrides ('force:greedy_tokens=native': the kernels before a port)."""

    def __init__(self, text: str):
        from kernelgate import registry
        self.overrides = registry.parse_overrides(text)

    def install(self) -> str:
        from kernelgate import registry
        for op, impl in self.overrides.items():
            registry.force(op, impl)
        return f"forced: {', '.join(f'{k}={v}' for k, v in self.overrides.items())}"

    def uninstall(self) -> None:
        from kernelgate import registry
        for op in self.overrides:
            registry.force(op, None)


def forms(spec: str) -> list:
    """--forms 'none;gemv_inflight:ahead=2,pf_bytes=4096;gemv_inflight:ahead=2+kda_up_gemv' -> per form
    (label, [(module, install kwargs)]): probes from bench/ops/variants with install(**kw) / uninstall()
    (e.g. gemv_inflight.py, kda_up_gemv.py), '+' installing several at once; none: dispatch's kernels;
    force:op=impl,op2=impl2: dispatch with those overrides (registry.force)."""
    import importlib
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops" / "variants"))
    out = []
    for f in (f.strip() for f in spec.split(";") if f.strip()):
        probes = []
        for p in ([] if f == "none" else f.split("+")):
            name, _, kv = p.strip().partition(":")
            if name == "force":                     # force:op=impl,op2=impl2 -- dispatch with those overrides
                probes.append((_Forced(kv), {}))
                continue
            kw = {k.strip(): int(v) if v.strip().lstrip("-").isdigit() else v.strip()
                  for k, v in (a.split("=") for a in kv.split(",") if a.strip())}
            probes.append((importlib.import_module(name), kw))
        out.append(("" if f == "none" else f" [{f}]", probes))
    return out


def part_decode(args, device) -> list:
    import torch

    from kernelgate import registry
    from kernelgate.engine import Engine
    sys.path.insert(0, str(Path(__file__).parent))
    from kimi_e2e import decode_floor, routed_distinct
    cfg = config_for(args.layers, args.tiny)
    src = RandomSource(cfg, device, torch.bfloat16, seed=0)
    batches = [int(b) for b in args.batches.split(",")]
    length = args.prompt + args.new + 8
    rows, long_rows = [], []
    kinds = {"bf16": ("bf16", None), "fp8": ("fp8 (block 128x128, quantized on load)", "fp8")}
    for name, q in (kinds[w.strip()] for w in args.weights.split(",")):
        model, t_load, peak_load, weights = load(cfg, device, torch.bfloat16, q, src)
        held = {"model": model}
        bound = 1.05 * weights + GiB
        print(f"  {name}: {weights / 1e9:.2f} GB of weights loaded in {t_load:.1f} s, load peak "
              f"{_gb(peak_load)} GB (bound {bound / 1e9:.2f})", flush=True)
        first = None                                # the first form's greedy tokens: the others must match them
        for label, probes in forms(args.forms):
            for mod, kw in probes:
                print(f"    {mod.install(**kw)}", flush=True)
            registry._plan.clear()
            eng = Engine(model, max_num_seqs=max(batches), max_model_len=length, block_size=64,
                         num_cache_blocks=max(batches) * -(-length // 64))
            _reset_peak(device)
            tokens = []
            try:
                for b in batches:
                    t0 = time.perf_counter()
                    decode_rate(model, eng, b, args.prompt, args.new, seed=100 + b)          # graphs, autotuning
                    rate = decode_rate(model, eng, b, args.prompt, args.new, seed=200 + b, tokens=tokens)
                    floor = decode_floor(model, b, length, args.hbm_gbps)
                    hit = routed_distinct(model, b, args.prompt)
                    routed = decode_floor(model, b, length, args.hbm_gbps, distinct=hit)
                    within = "" if peak_load != peak_load else f" ({'within' if peak_load <= bound else 'OVER'} bound)"
                    rows.append([name + label, str(b), f"{rate:,.1f}", f"{floor:,.0f}", f"{rate / floor:.3f}",
                                 _gb(weights), _gb(peak_load) + within, _gb(_peak(device)), f"{hit:.1f}",
                                 f"{routed:,.0f}", f"{rate / routed:.3f}"])
                    print(f"    B{b}{label}: {rate:,.1f} tok/s (floor {floor:,.0f}), {time.perf_counter() - t0:.1f} s",
                          flush=True)
            finally:
                for mod, _ in probes:
                    mod.uninstall()
                eng.close()
                del eng
            if first is None:
                first = tokens
            else:
                same = sum(a == b for a, b in zip(first, tokens))
                print(f"    greedy tokens{label}: {same} of {len(first)} sequences as the first form's", flush=True)
        print("    plan: " + ", ".join(f"{k}={'/'.join(v)}" for k, v in registry.plan().items()), flush=True)
        if args.long:
            long_rows.append([name, *long_prompt(model, device, args.long, args.memory_cap_gib)])
        del model
        free(held, device)
    _table(f"decode through kernelgate.generate, {args.layers} layers real width"
           f"{' (tiny)' if args.tiny else ''}, prompts of {args.prompt}, byte floor at {args.hbm_gbps:,.0f} GB/s",
           ["weights", "batch", "decode tok/s", "byte floor tok/s", "of floor", "weights GB", "load peak GB",
            "decode peak GB", "experts hit a layer (routed)", "floor as routed", "of it"], rows)
    if long_rows:
        cap = f", allocator capped at {args.memory_cap_gib} GiB" if args.memory_cap_gib else ""
        _table(f"one {args.long:,}-token prompt + 16 new tokens, cache sized from device memory{cap}",
               ["weights", "engine cache", "prefill tok/s", "decode tok/s (B1)", "peak GB"], long_rows)
    return rows + long_rows


def long_prompt(model, device, length: int, cap_gib: float | None) -> list:
    """[capacity, prefill tok/s, decode tok/s, peak GB] of one `length`-token prompt on an engine whose
    cache fills gpu_memory_utilization 0.9 of the device (of the cap: memory_cap)."""
    import kernelgate
    from kernelgate.engine import Engine
    from kernelgate.serving.drive import Timing
    m = _mod(device)
    total = m.get_device_properties(device).total_memory if m is not None else None
    util = 0.9 * min(1.0, cap_gib * GiB / total) if cap_gib and total else 0.9
    _reset_peak(device)
    eng = Engine(model, max_num_seqs=4, max_model_len=length + 64, gpu_memory_utilization=round(util, 4))
    try:
        print(f"    long prompt: {eng.capacity.report()}", flush=True)
        # warm-up: another prompt of the same length, so the timed one sees compiled kernels and planned shapes
        kernelgate.generate(model, _prompts(1, length, model.config.vocab_size, seed=8), max_new_tokens=2,
                            stop_token_ids=(), engine=eng)
        t = Timing()
        kernelgate.generate(model, _prompts(1, length, model.config.vocab_size, seed=7), max_new_tokens=16,
                            stop_token_ids=(), timing=t, engine=eng)
        cap = eng.capacity
        row = [f"{cap.cache_tokens:,} tokens, {cap.cache_bytes / 1e9:.1f} GB (util {util:.3f})",
               f"{t.rate('prefill'):,.0f}", f"{t.rate('decode'):,.1f}", _gb(_peak(device))]
        print(f"    long prompt: {length:,} tokens prefilled at {row[1]} tok/s, peak {row[3]} GB", flush=True)
        return row
    finally:
        eng.close()


def memory_cap(device, gib: float) -> str:
    """Cap torch's allocator on `device` at `gib` GiB (an 80 GB card's budget on a larger one)."""
    m = _mod(device)
    if m is None or not hasattr(m, "set_per_process_memory_fraction"):
        raise SystemExit(f"fp8_decode: --memory-cap-gib needs an accelerator whose torch module caps memory, not {device}")
    total = m.get_device_properties(device).total_memory
    if gib * GiB >= total:
        raise SystemExit(f"fp8_decode: --memory-cap-gib {gib} is not below the device's {total / GiB:.1f} GiB")
    m.set_per_process_memory_fraction(gib * GiB / total, device)
    return f"allocator capped at {gib} GiB of {total / GiB:.1f} (fraction {gib * GiB / total:.4f})"


def _table(title, head, rows):
    print(f"\n### {title}\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="error,decode", help="error,decode")
    ap.add_argument("--layers", type=int, default=27, help="layers of the decode part")
    ap.add_argument("--error-layers", type=int, default=4)
    ap.add_argument("--error-dir", help="write the error part's checkpoint here and load it from disk")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
    ap.add_argument("--new", type=int, default=48, help="new tokens per sequence (decode steps)")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth of the byte floor (H200: 4.8 TB/s)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--tiny", action="store_true", help="tiny widths (smoke run of this script, e.g. on a CPU)")
    ap.add_argument("--json", help="also write the tables here")
    ap.add_argument("--weights", default="bf16,fp8", help="decode: bf16,fp8 (which loads, in this order)")
    ap.add_argument("--memory-cap-gib", type=float, help="cap the allocator at this many GiB (an H100: 79.2)")
    ap.add_argument("--long", type=int, default=0, help="decode: then one prompt of this many tokens (e.g. 32768)")
    ap.add_argument("--forms", default="none",
                    help="decode: ';'-separated forms, each measured on the same loaded model with a new engine: "
                         "none (dispatch's kernels) or a bench/ops/variants probe with its install arguments, e.g. "
                         "'none;gemv_inflight:ahead=2;gemv_inflight:ahead=2,pf_bytes=4096+kda_up_gemv' ('+': together)")
    args = ap.parse_args(argv)
    import torch

    from kernelgate import platform
    device = torch.device(args.device) if args.device else platform.default_device()
    if not args.tiny and device.type == "cpu":
        print("fp8_decode: real width needs an accelerator (or --tiny); nothing measured")
        return 1
    if args.tiny:
        args.layers, args.error_layers = min(args.layers, 4), min(args.error_layers, 4)
        args.batches, args.new = "1,4", 8
    t0 = time.perf_counter()
    print(f"fp8_decode on {platform.current().device_name or device} ({platform.current().name})", flush=True)
    if args.memory_cap_gib:
        print(memory_cap(device, args.memory_cap_gib), flush=True)
    result = {}
    parts = args.parts.split(",")
    if "error" in parts:
        result["error"] = part_error(args, device)
        print(f"({time.perf_counter() - t0:.0f} s in)", flush=True)
    if "decode" in parts:
        result["decode"] = part_decode(args, device)
    print(f"\nfp8_decode: {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
