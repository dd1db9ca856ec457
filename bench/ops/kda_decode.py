"""KDA decode / prefill benchmark (issue 4). `PYTHONPATH=. python bench/ops/kda_decode.py [--cpu]`

CUDA: checks correctness first, then times at H=32, K=V=128, fp32 state, bf16 activations:
  decode, N = 1, 32, 256:
    (a) short_conv_update (triton) + kda_packed_decode (triton, one fused launch)
    (b) short_conv_update (triton) + kda_gate + fla fused_recurrent_kda (the unfused chain)
    plus the packed kernel alone against the state floor (state read + written once)
  prefill, T = 8192: kda_prefill through the registry (fla impl) vs fla chunk_kda called directly.
CPU (or --cpu): native chunked prefill at T=2048 vs a per-token recurrent loop (in place, vectorised
over heads; the out-of-place loop that earlier versions used is shown beside it). Medians of 5 / 3 / 1
runs after one warm-up run.
"""
from __future__ import annotations

import argparse

import torch

from kernelgate.tools.benchmark import graph_us, time_ms

H, K, V, W = 32, 128, 128, 4


def _decode_inputs(N, device, gen):
    D = 2 * H * K + H * V
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, generator=gen).to(device=device, dtype=dt)  # noqa: E731
    return dict(x=r(N, D), w=0.5 * r(D, W), conv_state=r(N, D, W - 1), f=r(N, H * K), b=r(N, H),
                A_log=r(H, dt=torch.float32) - 1, dt_bias=r(H * K, dt=torch.float32),
                state=0.3 * r(N, H, K, V, dt=torch.float32), slots=torch.arange(N, dtype=torch.int32, device=device))


def cuda_main(prefill_only: bool = False):
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    from kernelgate import registry
    from kernelgate.tools.benchmark import copy_bandwidth
    from kernelgate.tools.testing import rel_err
    dev = torch.device("cuda")
    conv = registry.get("short_conv_update").impl("triton").callable()
    packed = registry.get("kda_packed_decode").impl("triton").callable()
    gate = registry.get("kda_gate")
    bw = copy_bandwidth(dev)

    def fused(t):
        qkv = conv(t["x"], t["w"], None, t["conv_state"], t["slots"])
        return packed(qkv, t["f"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["slots"], H, K)

    def chain(t):
        N = t["x"].shape[0]
        qkv = conv(t["x"], t["w"], None, t["conv_state"], t["slots"])
        q, k, v = qkv.split([H * K, H * K, H * V], dim=1)
        g = gate(t["f"], t["A_log"], t["dt_bias"])
        o, _ = fused_recurrent_kda(q.reshape(1, N, H, K), k.reshape(1, N, H, K), v.reshape(1, N, H, V), g[None],
                                   torch.sigmoid(t["b"].float())[None], initial_state=t["state"],
                                   output_final_state=False, use_qk_l2norm_in_kernel=True,
                                   cu_seqlens=torch.arange(N + 1, device=dev))
        return o[0]

    print(f"copy bandwidth {bw:.0f} GB/s\n")
    print("| N | fused (a) µs | chain (b) µs | a vs b | packed kernel µs | state floor µs | of floor |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for N in (() if prefill_only else (1, 32, 256)):
        t = _decode_inputs(N, dev, torch.Generator().manual_seed(N))
        # correctness: one step of each from the same inputs vs the native reference
        ref_t = {k: v.clone() for k, v in t.items()}
        ref_qkv = registry.get("short_conv_update").impl("native").callable()(
            ref_t["x"], ref_t["w"], None, ref_t["conv_state"], ref_t["slots"])
        ref = registry.get("kda_packed_decode").reference(ref_qkv, ref_t["f"], ref_t["b"], ref_t["A_log"],
                                                          ref_t["dt_bias"], ref_t["state"], ref_t["slots"], H, K)
        for name, fn in (("fused", fused), ("chain", chain)):
            c = {k: v.clone() for k, v in t.items()}
            out = fn(c)
            err = rel_err(out, ref)
            assert err < 2e-2, f"{name} N={N}: rel err {err:.2e}"
        a, b = time_ms(lambda: fused(t), dev), time_ms(lambda: chain(t), dev)
        qkv = conv(t["x"], t["w"], None, t["conv_state"], t["slots"])
        p = time_ms(lambda: packed(qkv, t["f"], t["b"], t["A_log"], t["dt_bias"], t["state"], t["slots"], H, K), dev)
        floor = 2 * N * H * K * V * 4 / (bw * 1e9) * 1e6
        print(f"| {N} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {p * 1e3:.1f} | {floor:.1f} | {floor / (p * 1e3):.2f} |")

    from kernelgate.ops.kda.kda_prefill import make_inputs
    print("\n| prefill | registry kda_prefill (fla) ms | same + host hints ms | fla chunk_kda ms | ratio (hints) "
          "| device (graph): ours + hints ms | fla ms | ratio |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for lens in ([8192], [2048] * 4):
        q, k, v, g, beta, state, cu, sl = (a.to(dev) for a in make_inputs(
            lens, list(range(len(lens))), H, K, V, "cpu", torch.bfloat16, torch.Generator().manual_seed(0)))
        impl = registry.get("kda_prefill").impl("fla").callable()
        ref_state = state.clone()
        o1 = impl(q, k, v, g, beta, state, cu, sl)
        o2, _ = chunk_kda(q[None], k[None], v[None], g[None], beta[None], initial_state=ref_state[sl.long()].clone(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
        assert rel_err(o1, o2[0]) < 1e-3
        nat = registry.get("kda_prefill").reference(q, k, v, g, beta, ref_state.clone(), cu, sl)
        assert rel_err(o1, nat) < 3e-2, rel_err(o1, nat)
        cu_l, cu_cpu, init = cu.long(), cu.long().cpu(), state[sl.long()].contiguous()
        hints = dict(cu_seqlens_cpu=cu.cpu(), slots_cpu=sl.cpu())   # what the engine passes
        assert rel_err(impl(q, k, v, g, beta, ref_state.clone(), cu, sl, **hints), o1) < 1e-3
        r = time_ms(lambda: impl(q, k, v, g, beta, state, cu, sl), dev)
        rh = time_ms(lambda: impl(q, k, v, g, beta, state, cu, sl, **hints), dev)
        d = time_ms(lambda: chunk_kda(q[None], k[None], v[None], g[None], beta[None], initial_state=init,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_l,
                                       cu_seqlens_cpu=cu_cpu), dev)
        # device time alone (one graph of 5 calls replayed: no host launch or Python overhead)
        gh = graph_us(lambda: impl(q, k, v, g, beta, state, cu, sl, **hints), dev, calls=5)
        gd = graph_us(lambda: chunk_kda(q[None], k[None], v[None], g[None], beta[None], initial_state=init,
                                        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_l,
                                        cu_seqlens_cpu=cu_cpu), dev, calls=5)
        dev_cols = (f"{gh / 1e3:.3f} | {gd / 1e3:.3f} | {gh / gd:.2f}x" if gh and gd else
                    f"{'not captured' if gh is None else f'{gh / 1e3:.3f}'} | "
                    f"{'not captured' if gd is None else f'{gd / 1e3:.3f}'} | -")
        print(f"| T{sum(lens)} N{len(lens)} | {r:.3f} | {rh:.3f} | {d:.3f} | {rh / d:.2f}x | {dev_cols} |")


def per_token_loop(q, k, v, g, beta, S, scale):
    """The recurrence one token at a time, vectorised over heads (what the chunked form
    replaces): gates precomputed, the state [H, K, V] updated in place (no per-token allocs)."""
    from kernelgate.ops.kda.kda_prefill import l2norm
    q, k = l2norm(q.float()) * scale, l2norm(k.float())
    decay = g.float().exp()[..., None]                                      # [T, H, K, 1]
    bk, bv = beta.float()[..., None] * k, beta.float()[..., None] * v.float()
    o = torch.empty(v.shape, dtype=torch.float32)
    S = S.float().clone()
    for t in range(q.shape[0]):
        S.mul_(decay[t])
        u = torch.baddbmm(bv[t, :, None], bk[t, :, None], S, alpha=-1)    # [H, 1, V] beta (v - S^T k)
        S.baddbmm_(k[t, :, :, None], u)
        torch.bmm(q[t, :, None], S, out=o[t, :, None])
    return o, S


def naive_token_loop(q, k, v, g, beta, S, scale):
    """The same loop written without care (out-of-place, allocates ~3 states per token):
    the baseline earlier versions of this script compared against."""
    from kernelgate.ops.kda.kda_prefill import l2norm
    q, k = l2norm(q.float()) * scale, l2norm(k.float())
    o = torch.empty(v.shape, dtype=torch.float32)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[..., None]
        u = beta[t, :, None].float() * (v[t].float() - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][..., None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", S, q[t])
    return o, S


def cpu_main(T=2048, heads=H):
    from kernelgate.ops.kda.kda_prefill import kda_chunked, make_inputs
    from kernelgate.tools.testing import rel_err
    q, k, v, g, beta, state, _, _ = make_inputs([T], [0], heads, K, V, "cpu", torch.float32,
                                                torch.Generator().manual_seed(0))
    S0, cpu = state[0], torch.device("cpu")
    oc, Sc = kda_chunked(q, k, v, g, beta, S0, K ** -0.5, True)
    ol, Sl = per_token_loop(q, k, v, g, beta, S0, K ** -0.5)
    on, Sn = naive_token_loop(q, k, v, g, beta, S0, K ** -0.5)
    print(f"correctness vs loop: o rel err {rel_err(oc, ol):.2e}, state rel err {rel_err(Sc, Sl):.2e}; "
          f"loops agree to {max(rel_err(on, ol), rel_err(Sn, Sl)):.2e}")
    args = (q, k, v, g, beta, S0, K ** -0.5)
    c = time_ms(lambda: kda_chunked(*args, True), cpu)
    lp = time_ms(lambda: per_token_loop(*args), cpu)
    nv = time_ms(lambda: naive_token_loop(*args), cpu)
    print(f"| CPU ({torch.get_num_threads()} threads) T={T} H={heads} K=V={K} fp32 | chunked {c:.0f} ms | "
          f"per-token loop {lp:.0f} ms | {lp / c:.1f}x | naive out-of-place loop {nv:.0f} ms | {nv / c:.1f}x |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="run the CPU comparison even if CUDA is present")
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--prefill-only", action="store_true", help="CUDA: skip the decode table")
    a = ap.parse_args()
    if torch.cuda.is_available() and not a.cpu:
        cuda_main(prefill_only=a.prefill_only)
    else:
        cpu_main(heads=a.heads)
