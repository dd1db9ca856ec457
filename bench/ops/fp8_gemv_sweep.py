"""Launch sweep of the one-token FP8 GEMVs (kernelgate/ops/quant/fp8_gemv_triton.py: weight rows read
as 4-code words, decoded in inline PTX on sm_89+, loads one K step ahead) at Kimi's and Qwen3.5-MoE's
decode shapes: fp8_linear's GEMV (R rows a program, C codes a K step, warps) and the experts GEMV
(gate/up and down launches), beside the launch dispatch makes.

    PYTHONPATH=. python bench/ops/fp8_gemv_sweep.py [--linear] [--experts] [--quick] [--dot] [--masked] [--bf16]
        [--shapes "KDA in_proj,MLA q_proj"] [--forms "ahead=2;ahead=3;ahead=2,pf_bytes=4096"]
        [--decode int]

--bf16: the experts sweep on bf16 weights instead (the bf16 experts' one-token form,
moe/fused_experts_words_triton.py: the FP8 GEMV's kernels on int64 words of 4 values). --masked: K steps of C
codes where they do not tile K (last step masked), C up to 2,048 (Session 31: no gain for the experts).
--decode int: the codes decoded with integer ops on every device instead of the PTX conversions (Session 35:
slower on the H200, Kimi experts 22.3 -> 29.5 µs).
--forms: the projections also with
bench/ops/variants/gemv_inflight.py's forms (weight tiles 2-3 steps ahead, an L2 prefetch of the rows). The
linear table says for each launch whether its step keeps the activations in registers on sm_90 (exchange-free:
C / 4 < 32 x warps; else a shared-memory exchange every step).

Each launch is checked against the native reference first (bf16, and fp32 activations to 1e-6: the
decode is exact), then timed in a CUDA graph, each call reading weights that are not in the L2 cache (the
projections cycle copies of the weight, >= 256 MB; the experts cycle 16 routings of the token), as a
decode step reads them; floors are the weight bytes (codes + scales) at the measured copy bandwidth.
(Until Session 31 the projections were timed on one weight, which stays in the L2 between calls: those
figures read 0.8-1.0 of the floor where a step's GEMVs read ~0.6.)
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fused_experts_gemv_sweep import with_shared  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "variants"))
import gemv_inflight as gi  # noqa: E402

from kernelgate import platform  # noqa: E402
from kernelgate.ops.moe import fused_experts as fe  # noqa: E402
from kernelgate.ops.moe import fused_experts_fp8 as fe8  # noqa: E402
from kernelgate.ops.moe import fused_experts_words_triton as gv8  # noqa: E402
from kernelgate.ops.moe import fused_experts_fp8_triton as ft8  # noqa: E402
from kernelgate.ops.moe import fused_experts_gemv_triton as ge  # noqa: E402
from kernelgate.ops.moe import fused_experts_triton as ft  # noqa: E402
from kernelgate.ops.quant import fp8_linear as fl  # noqa: E402
from kernelgate.ops.quant import fp8_gemv_triton as gt  # noqa: E402
from kernelgate.ops.quant import fp8_linear_triton as flt  # noqa: E402
from kernelgate.ops.quant.fp8_triton import MODES, SCALE, mode_for  # noqa: E402
from kernelgate.tools import benchmark  # noqa: E402
from kernelgate.tools.testing import rel_err  # noqa: E402

SHAPES = {"KDA in_proj": (12576, 2304), "KDA o_proj": (2304, 4096), "MLA q_proj": (6144, 2304),
          "MLA kv_b": (8192, 512), "GDN in_proj": (12352, 2048), "GDN out_proj": (2048, 4096)}


CODES = (128, 256, 512)          # codes a K step (C) the launches try


def cold_us(fn, variants, dev, **kw):
    """µs per call of fn(*v, **kw), v cycling over `variants` (weight copies or routings that together pass the
    L2 cache, so each call reads its weights from HBM, as a decode step does), 20 calls in one CUDA graph."""
    it = itertools.cycle(variants)
    return benchmark.graph_us(lambda: fn(*next(it), **kw), dev)


def exchange_free(W: int, warps: int) -> bool:
    """Whether a step of W words (4 codes each) keeps its activation vectors in the tile's column layout on
    sm_90: Triton rematerialises their loads there only while they have fewer elements than the program has
    threads; from there on each step moves them through shared memory (Session 32, from the TTGIR)."""
    return W < 32 * warps


def linear_grid(quick):
    if quick:
        return [(32, 256, 4), (16, 512, 4), (16, 512, 8), (8, 512, 2), (32, 512, 8), (16, 1024, 16)]
    return [c for c in itertools.product((8, 16, 32, 64), CODES, (2, 4, 8, 16))
            if 16 <= c[0] * c[1] // (32 * c[2]) <= 256]


def cold_shape(dev, bw, N: int, K: int):
    """(x, w, s, kw, floor µs, copies): one token and a block-FP8 weight of N x K, its floor at the copy rate,
    and copies of the weight that together pass the L2 (>= 256 MB) for cold_us."""
    gen = torch.Generator(device=dev).manual_seed(0)
    (x, w, s), kw = fl.make_inputs(1, N, K, (128, 128), torch.bfloat16, dev, gen)
    floor_us = (w.numel() + s.numel() * 4) / (bw * 1e9) * 1e6
    copies = [(x, w, s)] + [(x, w.clone(), s.clone()) for _ in range(max(1, -(-(256 << 20) // w.numel()) - 1))]
    return x, w, s, kw, floor_us, copies


def linear(dev, bw, quick, shapes=None, forms=(None,)):
    """forms: None (dispatch's kernel) or gemv_inflight.install arguments (prefetch, tiles ahead)."""
    print("| shape | form | launch (R, C, warps) | codes a step | exchange-free | µs | of floor | bf16 err | fp32 err |")
    print("|---|---|---|---:|---|---:|---:|---:|---:|")
    for name, (N, K) in SHAPES.items():
        if shapes and name not in shapes:
            continue
        x, w, s, kw, floor_us, copies = cold_shape(dev, bw, N, K)
        ref = fl.fp8_linear_native(x, w, s, **kw)
        ref32 = fl.fp8_linear_native(x.float(), w, s, **kw)
        us = cold_us(flt.fp8_linear_triton, copies, dev)
        print(f"| {name} | dispatched | {gt.launch(platform.current())} | | | {us:.1f} | {floor_us / us:.2f} | "
              f"{rel_err(flt.fp8_linear_triton(x, w, s), ref):.1e} | |", flush=True)
        for form in forms:
            label = "kernel as dispatched" if form is None else ", ".join(f"{k} {v}" for k, v in form.items())
            if form is not None:
                gi.install(bf16=False, **form)
            try:
                for R, C, wp in linear_grid(quick):
                    cfg = dict(form="gemv", R=R, C=C, num_warps=wp)
                    W = gt.step(K, C)[0]
                    row = f"| {name} | {label} | {R}, {C}, {wp} | {4 * W} | {'yes' if exchange_free(W, wp) else 'no'} |"
                    try:
                        err = rel_err(flt.fp8_linear_triton(x, w, s, **cfg), ref)
                        err32 = rel_err(flt.fp8_linear_triton(x.float(), w, s, **cfg), ref32)
                    except Exception as e:  # noqa: BLE001 - out of resources: the next launch
                        print(f"{row} ({type(e).__name__}: {str(e)[:60]}) | | | |")
                        continue
                    if err > 2e-2 or err32 > 1e-6:
                        print(f"{row} wrong | | {err:.1e} | {err32:.1e} |")
                        continue
                    us = cold_us(flt.fp8_linear_triton, copies, dev, **cfg)
                    print(f"{row} {us:.1f} | {floor_us / us:.2f} | {err:.1e} | {err32:.1e} |", flush=True)
            finally:
                gi.uninstall()


def experts(dev, bw, quick, qwen, bf16=False, forms=(None,)):
    """FP8 experts (fused_experts_fp8's GEMV), or with bf16 the bf16 experts' one-token word form
    (fused_experts_words_triton: the FP8 GEMV's kernels on int64 words of 4 values); forms as for linear()."""
    D, I = (2048, 512) if qwen else (2304, 1024)
    gen = torch.Generator(device=dev).manual_seed(0)
    if bf16:
        args, kw = fe.make_inputs(1, D, I, 256, 8, torch.bfloat16, dev, gen)
        native, gemv, cfg, nbytes = fe.fused_experts_native, ge.fused_experts_gemv, lambda plat: gv8.launch_config(plat, fp8=False), fe._bytes
    else:
        args, kw = fe8.make_inputs(1, D, I, 256, 8, torch.bfloat16, dev, gen)
        native, gemv, cfg, nbytes = fe8.fused_experts_fp8_native, gv8.fused_experts_fp8_gemv, gv8.launch_config, fe8._bytes
    args = with_shared(args)
    routings = [args]                     # + 15 more routings of the token to 8 of the 256 experts (+ the shared one)
    for _ in range(15):
        ids = torch.randperm(256, generator=gen, device=dev)[None, :8].to(args[4].dtype)
        routings.append((*args[:4], torch.cat([ids, args[4][:, -1:]], 1), *args[5:]))
    ref = native(*args, **kw)
    args32 = (args[0].float(), *args[1:])
    ref32 = native(*args32, **kw)
    floor_us = nbytes(args, kw) / (bw * 1e9) * 1e6
    for form in forms:
        if form is not None:
            print(f"\n{gi.install(bf16=False, **form)}")
        try:
            _experts_launches(gemv, cfg, args, args32, ref, ref32, routings, kw, floor_us, dev, quick, qwen, bf16)
        finally:
            gi.uninstall()


def _experts_launches(gemv, cfg, args, args32, ref, ref32, routings, kw, floor_us, dev, quick, qwen, bf16):
    us = cold_us(gemv, routings, dev, **kw)
    print(f"\n{'bf16' if bf16 else 'FP8'} experts at one token ({'Qwen3.5-MoE' if qwen else 'Kimi'} + shared): floor "
          f"{floor_us:.1f} µs; dispatched GEMV {us:.1f} µs ({floor_us / us:.2f}) at {cfg(platform.current())}")
    print("| gate/up (R, C, warps) | down (R, C, warps) | µs | of floor | bf16 err | fp32 err |")
    print("|---|---|---:|---:|---:|---:|")

    def trial(gu, dn):
        kw2 = dict(kw, launch=dict(gate_up=gu, down=dn))
        try:
            err = rel_err(gemv(*args, **kw2), ref)
            err32 = rel_err(gemv(*args32, **kw2), ref32)
        except Exception as e:  # noqa: BLE001
            print(f"| {gu} | {dn} | ({type(e).__name__}: {str(e)[:60]}) | | | |")
            return None
        if err > 2e-2 or err32 > 1e-6:
            print(f"| {gu} | {dn} | wrong | | {err:.1e} | {err32:.1e} |")
            return None
        us = cold_us(gemv, routings, dev, **kw2)
        print(f"| {gu} | {dn} | {us:.1f} | {floor_us / us:.2f} | {err:.1e} | {err32:.1e} |", flush=True)
        return us

    launches = ([(8, 256, 8), (16, 256, 8), (8, 512, 8), (16, 512, 8), (8, 256, 4), (16, 256, 4)] if bf16 else
                [(16, 256, 8), (16, 512, 8), (8, 512, 8), (16, 256, 2)]) if quick else \
        [c for c in itertools.product((8, 16, 32), CODES, (2, 4, 8)) if 16 <= c[0] * c[1] // (32 * c[2]) <= 128]
    down0 = (16, 512, 4)
    best = min(((trial(gu, down0) or 1e9), gu) for gu in launches)[1]
    print(f"(gate/up {best}; now the down launch)")
    for dn in launches:
        trial(best, dn)


# --dot: the matrix units at one token instead (fp8_linear's w8a16 tl.dot kernel with narrow column tiles and
# deep pipelines, the grouped experts kernels on 16-row blocks): Session 30 measured them slower at every shape.
def dot_linear_launches(quick):
    if quick:
        return [(32, 128, 4, 4, 1), (16, 128, 4, 4, 1), (64, 128, 4, 4, 1), (32, 128, 4, 6, 1), (32, 128, 4, 4, 2)]
    return list(itertools.product((16, 32, 64), (128,), (2, 4), (3, 4, 6), (1, 2)))


def dot_expert_launches(quick):
    if quick:
        return [(16, 128, 4, 4), (32, 128, 4, 4), (16, 128, 4, 6), (32, 128, 2, 4), (64, 128, 4, 4)]
    return [c for c in itertools.product((16, 32, 64), (128,), (2, 4, 8), (3, 4, 6)) if not (c[2] == 8 and c[0] < 64)]


def dot_linear(dev, bw, quick):
    print("| shape | launch (BN, BK, warps, stages, split) | µs | of floor | err |")
    print("|---|---|---:|---:|---:|")
    for name, (N, K) in list(SHAPES.items())[:3]:
        gen = torch.Generator(device=dev).manual_seed(0)
        (x, w, s), kw = fl.make_inputs(1, N, K, (128, 128), torch.bfloat16, dev, gen)
        ref = fl.fp8_linear_native(x, w, s, **kw)
        floor_us = (w.numel() + s.numel() * 4) / (bw * 1e9) * 1e6
        copies = [(x, w, s)] + [(x, w.clone(), s.clone()) for _ in range(max(1, -(-(256 << 20) // w.numel()) - 1))]
        us = cold_us(flt.fp8_linear_triton, copies, dev)
        print(f"| {name} | dispatched GEMV | {us:.1f} | {floor_us / us:.2f} | "
              f"{rel_err(flt.fp8_linear_triton(x, w, s), ref):.1e} |", flush=True)
        for bn, bk, wp, st, sp in dot_linear_launches(quick):
            cfg = dict(form="decode", split=sp, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=wp, num_stages=st)
            try:
                out = flt.fp8_linear_triton(x, w, s, **cfg)
            except Exception as e:  # noqa: BLE001 - out of resources: the next launch
                print(f"| {name} | {bn}, {bk}, {wp}, {st}, {sp} | ({type(e).__name__}) | | |")
                continue
            err = rel_err(out, ref)
            if err > 2e-2:
                print(f"| {name} | {bn}, {bk}, {wp}, {st}, {sp} | wrong | | {err:.1e} |")
                continue
            us = benchmark.graph_us(lambda: flt.fp8_linear_triton(x, w, s, **cfg), dev)
            print(f"| {name} | {bn}, {bk}, {wp}, {st}, {sp} | {us:.1f} | {floor_us / us:.2f} | {err:.1e} |", flush=True)


def dot_experts(dev, bw, quick, qwen):
    D, I = (2048, 512) if qwen else (2304, 1024)
    gen = torch.Generator(device=dev).manual_seed(0)
    args, kw = fe8.make_inputs(1, D, I, 256, 8, torch.bfloat16, dev, gen)
    args = with_shared(args)
    x, wgu, wdn, tw, ids, sgu, sdn = args
    ids, tw = ids.contiguous(), tw.contiguous()
    E, k = wdn.shape[0], ids.shape[1]
    floor_us = fe8._bytes(args, kw) / (bw * 1e9) * 1e6
    ref = fe8.fused_experts_fp8_native(*args, **kw)
    us = benchmark.graph_us(lambda: gv8.fused_experts_fp8_gemv(*args, **kw), dev)
    print(f"\nexperts at one token ({'Qwen3.5-MoE' if qwen else 'Kimi'} + shared, {k} slots): floor {floor_us:.1f} µs")
    print(f"dispatched GEMV: {us:.1f} µs ({floor_us / us:.2f}), err {rel_err(gv8.fused_experts_fp8_gemv(*args, **kw), ref):.1e}")
    r = ft.route(ids, E, largest_block_m=16)
    print(f"moe_align for the grouped kernels: {benchmark.graph_us(lambda: ft.route(ids, E, 16), dev):.1f} µs; "
          f"{r.block_expert.numel()} blocks of {r.block_m}")
    mode = MODES[mode_for(platform.current().capability)]
    flags = flt.operand_flags(x.dtype, False)
    P, nb = r.pairs, r.block_expert.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=dev)
    y = torch.empty(P, D, dtype=torch.float32, device=dev)
    out = torch.empty(1, D, dtype=x.dtype, device=dev)
    wgu8, wdn8 = wgu.view(torch.uint8), wdn.view(torch.uint8)

    def call(bn, bk, wp, st):
        ft8._gate_up_kernel[(nb * triton.cdiv(I, bn),)](
            x, wgu8, sgu, h, r.sorted_pairs, r.block_expert, P, I, D, r.bucket, nb, x.stride(0), x.stride(1),
            *wgu8.stride(), *sgu.stride(), 128, 128, 0.0, SCALE[mode], k, HAS_LIMIT=False, MODE=mode,
            ONE_KBLOCK=False, **flags, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=0, num_warps=wp, num_stages=st)
        ft8._down_kernel[(nb * triton.cdiv(D, bn),)](
            h, wdn8, sdn, y, tw, r.sorted_pairs, r.block_expert, P, D, I, r.bucket, nb, *wdn8.stride(),
            *sdn.stride(), 128, 128, SCALE[mode], MODE=mode, ONE_KBLOCK=False, **flags, BLOCK_M=16, BLOCK_N=bn,
            BLOCK_K=bk, GROUP_M=0, num_warps=wp, num_stages=st)
        return ft.sum_slots(y, ids, out, E)

    print("| BN | BK | warps | stages | gate/up + down + sum µs | of floor | err |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for bn, bk, wp, st in dot_expert_launches(quick):
        try:
            got = call(bn, bk, wp, st)
        except Exception as e:  # noqa: BLE001
            print(f"| {bn} | {bk} | {wp} | {st} | ({type(e).__name__}) | | |")
            continue
        err = rel_err(got, ref)
        if err > 2e-2:
            print(f"| {bn} | {bk} | {wp} | {st} | wrong | | {err:.1e} |")
            continue
        us = benchmark.graph_us(lambda: call(bn, bk, wp, st), dev)
        print(f"| {bn} | {bk} | {wp} | {st} | {us:.1f} | {floor_us / us:.2f} | {err:.1e} |", flush=True)


def parse_form(text: str) -> dict:
    """'ahead=2,pf_bytes=4096' -> {'ahead': 2, 'pf_bytes': 4096}."""
    return {k.strip(): int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv.strip())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--linear", action="store_true")
    ap.add_argument("--experts", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dot", action="store_true", help="the tl.dot forms at one token instead (matrix units)")
    ap.add_argument("--shapes", default="", help="--linear: comma-separated names of SHAPES (default: all)")
    ap.add_argument("--bf16", action="store_true", help="experts: the bf16 one-token word GEMV instead of FP8")
    ap.add_argument("--forms", default="",
                    help="also the gemv_inflight forms, ';'-separated install arguments, e.g. "
                         "'ahead=2;ahead=3;ahead=2,pf_bytes=4096' (--linear), 'experts_ahead=2' (--experts)")
    ap.add_argument("--masked", action="store_true",
                    help="K steps of C codes even where they do not tile K (the last step masked), and C up to 2048")
    ap.add_argument("--decode", choices=("dispatch", "int"), default="dispatch",
                    help="int: decode the codes with integer ops on every device (no inline PTX), to see whether "
                         "the conversion instructions bound the loop")
    a = ap.parse_args()
    if a.decode == "int":
        gt.ptx_decode = gv8.ptx_decode = lambda plat: False
    if a.masked:
        global CODES
        CODES = (256, 512, 1024, 2048)
        gt.step = gv8.step = gi._ORIGINAL["step"] = gi._masked_step
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    dev = torch.device("cuda")
    bw = benchmark.copy_bandwidth(dev)
    print(f"copy bandwidth {bw:.0f} GB/s")
    both = not (a.linear or a.experts)
    forms = [None] + [parse_form(f) for f in a.forms.split(";") if f.strip()]
    if a.linear or both:
        if a.dot:
            dot_linear(dev, bw, a.quick)
        else:
            linear(dev, bw, a.quick, [n.strip() for n in a.shapes.split(",") if n.strip()], forms)
    if a.experts or both:
        for qwen in (False, True):
            if a.dot:
                dot_experts(dev, bw, a.quick, qwen)
            else:
                experts(dev, bw, a.quick, qwen, a.bf16, forms)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
