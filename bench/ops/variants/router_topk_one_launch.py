"""Probe (issues 37 / 38, not dispatched): a one-token MoE layer's router logits and top-k routing in one
Triton launch instead of two.

At one token a MoE layer runs `router_logits` (a fp32 GEMV over the E router rows, one row a program) and
then `biased_grouped_topk` (one program) -- two dependent launches of ~3 µs each in Session 31's profile
(PDL off), in each of Kimi's 26 and Qwen3.5-MoE's 40 MoE layers. Here the router's programs write the
logits to a scratch row and count themselves out on an acq_rel atomic counter; the last one to finish runs
the routing (moe_routing_triton.route_block: the dispatched kernel's code, so the selection, weights and
ids are the op's) on the scratch row and resets the counter for the next call. Each program also loads its
router row before the PDL wait (the router is a weight: nothing of the step writes it), so only the
activation load and the sum are left after the predecessor. In its sm_90 code (compiled here, Triton 3.9):
the router row's four LDG.E.128 before ACQBULK (the PDL wait), the counter as MEMBAR.ALL.GPU / ATOMG /
CCTL.IVALL; 39 registers for Kimi's 256 x 2,304 router, 32 for Qwen3.5's 257 x 2,048, at 8 warps.

    sys.path.insert(0, "bench/ops/variants"); import router_topk_one_launch; router_topk_one_launch.install()
    bench/e2e/fp8_decode.py --forms "none;router_topk_one_launch"     (Kimi's Router)
    bench/e2e/qwen_e2e.py --forms "none;router_topk_one_launch"       (Qwen's stacked SparseMoE)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, platform
from kernelgate.models.layers import Router, run_experts
from kernelgate.models.qwen_moe import SparseMoE
from kernelgate.ops.common.pdl import inputs_ready, pdl_args
from kernelgate.ops.moe.moe_routing_triton import SCORINGS, route_block

_ORIGINAL = {"router": Router.forward, "sparse": SparseMoE.forward}
_COUNTERS: dict = {}                  # device -> one int32 counter, zero between calls
_SETTINGS = dict(num_warps=8, rows=1)


@triton.jit
def _router_topk_kernel(x_ptr, w_ptr, logits_ptr, count_ptr, bias_ptr, wout_ptr, ids_ptr, E_ALL, D, sxd, swe, swd,
                        rsf, NPROG, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                        E: tl.constexpr, N_GROUP: tl.constexpr, GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOPK: tl.constexpr, SHARED: tl.constexpr, SHARED_GATE: tl.constexpr, SCORING: tl.constexpr,
                        RENORM: tl.constexpr, HAS_BIAS: tl.constexpr, NG_PAD: tl.constexpr, GS_PAD: tl.constexpr,
                        K_PAD: tl.constexpr, PDL: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    d = tl.arange(0, BLOCK_D)
    e_ok, d_ok = e < E_ALL, d < D
    w = tl.load(w_ptr + e[:, None].to(tl.int64) * swe + d[None, :] * swd, mask=e_ok[:, None] & d_ok[None, :],
                other=0.0)                                          # the router rows: before the wait
    inputs_ready(PDL)
    x = tl.load(x_ptr + d * sxd, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(logits_ptr + e, tl.sum(w.to(tl.float32) * x[None, :], 1), mask=e_ok)
    done = tl.atomic_add(count_ptr, 1)                              # acq_rel: the logits above first
    if done == NPROG - 1:                                           # the last program routes the token
        route_block(0, logits_ptr, bias_ptr, wout_ptr, ids_ptr, 1, E_ALL, 0, rsf,       # row 0 of one
                    E, N_GROUP, GROUP, TOPK_GROUP, TOPK, SHARED, SHARED_GATE, SCORING, RENORM, HAS_BIAS, 1, NG_PAD,
                    GS_PAD, K_PAD)
        tl.store(count_ptr, 0)


def route_one(x, weight, bias, topk, n_group, topk_group, renormalize, rsf, scoring, shared=0, shared_gate=None):
    """x [1, D], weight [E_ALL, D] fp32 -> (weights fp32 [1, topk + shared], ids int32 [1, topk + shared]):
    biased_grouped_topk(router_logits(x, weight), bias, ...) in one launch."""
    E_ALL, D = weight.shape
    E = E_ALL - (shared if shared_gate else 0)
    dev = x.device
    counter = _COUNTERS.get(dev)
    if counter is None:
        counter = _COUNTERS[dev] = torch.zeros(1, dtype=torch.int32, device=dev)
    K = topk + shared
    w_out = alloc.empty((1, K), torch.float32, dev)
    ids = alloc.empty((1, K), torch.int32, dev)
    logits = alloc.empty((1, E_ALL), torch.float32, dev)
    rows = 16 if platform.interpreting() else _SETTINGS["rows"]
    nprog = triton.cdiv(E_ALL, rows)
    _router_topk_kernel[(nprog,)](
        x, weight, logits, counter, bias if bias is not None else logits, w_out, ids, E_ALL, D, x.stride(1),
        *weight.stride(), float(rsf), nprog, BLOCK_E=rows, BLOCK_D=triton.next_power_of_2(D),
        E=E, N_GROUP=n_group, GROUP=E // n_group, TOPK_GROUP=topk_group, TOPK=topk, SHARED=shared,
        SHARED_GATE=shared_gate is not None, SCORING=SCORINGS.index(scoring), RENORM=bool(renormalize),
        HAS_BIAS=bias is not None, NG_PAD=triton.next_power_of_2(n_group),
        GS_PAD=triton.next_power_of_2(E // n_group), K_PAD=max(2, triton.next_power_of_2(K)),
        num_warps=_SETTINGS["num_warps"], **pdl_args())
    return w_out, ids


def router_forward(self, x, shared: int = 0):
    """Router.forward (Kimi) with one token through route_one."""
    c = self.c
    if x.shape[0] != 1:
        return _ORIGINAL["router"](self, x, shared)
    return route_one(x, self.weight, self.e_score_correction_bias, c.num_experts_per_token, c.n_group, c.topk_group,
                     c.moe_renormalize, c.routed_scaling_factor, c.scoring, shared)


def sparse_forward(self, x):
    """SparseMoE.forward (Qwen) with one token and the shared expert stacked through route_one."""
    if not self.stacked or x.shape[0] != 1:
        return _ORIGINAL["sparse"](self, x)
    weights, ids = route_one(x, self.router, None, self.k, 1, 1, self.renormalize, 1.0, "softmax", 1, "sigmoid")
    return self.par.all_reduce(run_experts(x, weights, ids, self, "gate_up", "down", self.experts))


def install(num_warps: int = 8, rows: int = 1) -> str:
    _SETTINGS.update(num_warps=num_warps, rows=rows)
    Router.forward, SparseMoE.forward = router_forward, sparse_forward
    return f"router_topk_one_launch: router logits and top-k at one token in one launch ({rows} rows, {num_warps} warps)"


def uninstall() -> None:
    Router.forward, SparseMoE.forward = _ORIGINAL["router"], _ORIGINAL["sparse"]

