"""Probe (issue 37, not dispatched): an MLA layer's absorbed projections at one token as two Triton GEMVs
written for PDL, instead of two cuBLAS batched matmuls and a concatenation.

`MLAttention._absorbed` at one new token runs
    q_lat = einsum("nhd,hdr->nhr", q_nope, W_uk)      cuBLAS, 4 MB of kv_b (Kimi: 32 heads x 128 x 512)
    cat([q_lat, q_rope])                              a copy kernel
    o_lat = mla_decode(...)                           Triton (PDL)
    o     = einsum("nhr,hvr->nhv", o_lat, W_uv)       cuBLAS, 4 MB
three launches outside the PDL chain (each waits for the whole kernel before it, and the next cannot
launch early) for 8 MB of bf16 weights (kv_b stays bf16 in an FP8 model). Here:
    _q_kernel  grid (H, R / BR): q_full[h, r0:r0+BR] = q_nope[h] . W_uk[h][:, r0:r0+BR] (a [Dn, BR] tile,
               contiguous along r), and the programs of block 0 copy q_rope[h] beside it: the concatenation
    _o_kernel  grid (H, Dv / BV): o[h, v] = W_uv[h][v, :] . o_lat[h] (rows contiguous along r)
each loading its weight tile before the PDL wait (weights are never written by the step), fp32 sums.

    sys.path.insert(0, "bench/ops/variants"); import mla_absorb_gemv; mla_absorb_gemv.install()
    bench/e2e/fp8_decode.py --forms "none;mla_absorb_gemv"
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernelgate import alloc, ops
from kernelgate.models.mla import MLAttention
from kernelgate.ops.common.pdl import inputs_ready, pdl_args

_ORIGINAL = MLAttention._absorbed
BR, BV = 64, 16                  # latent columns of a _q_kernel program, value rows of an _o_kernel one


@triton.jit
def _q_kernel(q_ptr, w_ptr, out_ptr, sqh, swh, swd, soh, DN: tl.constexpr, DR: tl.constexpr, DRP: tl.constexpr,
              R: tl.constexpr, BR: tl.constexpr, PDL: tl.constexpr):
    h = tl.program_id(0)
    r = tl.program_id(1) * BR + tl.arange(0, BR)
    d = tl.arange(0, DN)
    w = tl.load(w_ptr + h.to(tl.int64) * swh + d[:, None] * swd + r[None, :], mask=(r < R)[None, :], other=0.0)
    inputs_ready(PDL)
    qn = tl.load(q_ptr + h * sqh + d).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * qn[:, None], axis=0)
    tl.store(out_ptr + h * soh + r, y.to(out_ptr.dtype.element_ty), mask=r < R)
    if tl.program_id(1) == 0:
        e = tl.arange(0, DRP)
        qr = tl.load(q_ptr + h * sqh + DN + e, mask=e < DR)
        tl.store(out_ptr + h * soh + R + e, qr, mask=e < DR)


@triton.jit
def _o_kernel(o_ptr, w_ptr, out_ptr, soh, swh, swd, svh, DN: tl.constexpr, DV: tl.constexpr, R: tl.constexpr,
              BV: tl.constexpr, PDL: tl.constexpr):
    h = tl.program_id(0)
    v = tl.program_id(1) * BV + tl.arange(0, BV)
    r = tl.arange(0, R)
    w = tl.load(w_ptr + h.to(tl.int64) * swh + (DN + v)[:, None] * swd + r[None, :], mask=(v < DV)[:, None],
                other=0.0)
    inputs_ready(PDL)
    ol = tl.load(o_ptr + h * soh + r).to(tl.float32)
    y = tl.sum(w.to(tl.float32) * ol[None, :], axis=1)
    tl.store(out_ptr + h * svh + v, y.to(out_ptr.dtype.element_ty), mask=v < DV)


def q_full(q: torch.Tensor, w_kv: torch.Tensor, Dn: int, Dr: int, R: int) -> torch.Tensor:
    """q [1, H, Dn + Dr], w_kv [H, Dn + Dv, R] -> [1, H, R + Dr]: the absorbed query beside its rope part."""
    H = q.shape[1]
    out = alloc.empty((1, H, R + Dr), q.dtype, q.device)
    _q_kernel[(H, triton.cdiv(R, BR))](q, w_kv, out, q.stride(1), w_kv.stride(0), w_kv.stride(1), out.stride(1),
                                       DN=Dn, DR=Dr, DRP=triton.next_power_of_2(Dr), R=R, BR=BR, num_warps=4, **pdl_args())
    return out


def o_values(o_lat: torch.Tensor, w_kv: torch.Tensor, Dn: int, Dv: int) -> torch.Tensor:
    """o_lat [1, H, R], w_kv [H, Dn + Dv, R] -> [1, H, Dv]."""
    H, R = o_lat.shape[1], o_lat.shape[2]
    out = alloc.empty((1, H, Dv), o_lat.dtype, o_lat.device)
    _o_kernel[(H, triton.cdiv(Dv, BV))](o_lat, w_kv, out, o_lat.stride(1), w_kv.stride(0), w_kv.stride(1),
                                        out.stride(1), DN=Dn, DV=Dv, R=R, BV=BV, num_warps=4, **pdl_args())
    return out


def _absorbed(self, q, kv, w_kv, block_table, seq_lens):
    """MLAttention._absorbed with one sequence through the two kernels (more: the original).
    Needs contiguous last dimensions and power-of-two Dn and R (Kimi: 128, 512)."""
    pow2 = all(n & (n - 1) == 0 for n in (self.Dn, self.R))
    if q.shape[0] != 1 or not pow2 or q.stride(-1) != 1 or w_kv.stride(-1) != 1:
        return _ORIGINAL(self, q, kv, w_kv, block_table, seq_lens)
    o_lat = ops.mla_decode(q_full(q, w_kv, self.Dn, self.Dr, self.R), kv, block_table, seq_lens, self.scale, self.R)
    return o_values(o_lat.contiguous(), w_kv, self.Dn, self.Dv)


def install() -> str:
    MLAttention._absorbed = _absorbed
    return "mla_absorb_gemv: an MLA layer's absorbed q and o at one token as two PDL GEMVs (no bmm, no cat)"


def uninstall() -> None:
    MLAttention._absorbed = _ORIGINAL
