"""bench/ops/variants/mla_absorb_gemv.py's two kernels against the einsums they replace (fp32, to
rounding; bf16 to bf16's): the absorbed query beside its rope part (one and two latent blocks, a rope width
that is not a power of two), the values from the latent output; and install() / uninstall().
Runs on CPU under TRITON_INTERPRET=1. Not part of CI:
    TRITON_INTERPRET=1 python -m pytest -q bench/ops/variants/test_mla_absorb_gemv.py"""
import os
import sys

import pytest
import torch

from kernelgate import platform
from kernelgate.models.mla import MLAttention

sys.path.insert(0, os.path.dirname(__file__))
import mla_absorb_gemv as ma  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("H,Dn,Dr,Dv,R", [(4, 32, 16, 32, 64), (3, 64, 24, 16, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_the_einsums(H, Dn, Dr, Dv, R, dtype):
    g = torch.Generator().manual_seed(H * R)
    w_kv = torch.randn(H, Dn + Dv, R, generator=g).to(dtype)
    q = torch.randn(1, H, Dn + Dr, generator=g).to(dtype)
    o_lat = torch.randn(1, H, R, generator=g).to(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    q_lat = torch.einsum("nhd,hdr->nhr", q[..., :Dn].float(), w_kv[:, :Dn].float())
    want_q = torch.cat([q_lat, q[..., Dn:].float()], dim=-1)
    got_q = ma.q_full(q, w_kv, Dn, Dr, R)
    assert got_q.shape == (1, H, R + Dr) and got_q.dtype == dtype
    torch.testing.assert_close(got_q.float(), want_q, **tol)
    assert torch.equal(got_q[..., R:], q[..., Dn:])                     # the rope part copied as it is
    want_o = torch.einsum("nhr,hvr->nhv", o_lat.float(), w_kv[:, Dn:].float())
    got_o = ma.o_values(o_lat, w_kv, Dn, Dv)
    assert got_o.shape == (1, H, Dv)
    torch.testing.assert_close(got_o.float(), want_o, **tol)


def test_install_and_uninstall():
    before = MLAttention._absorbed
    assert ma.install().startswith("mla_absorb_gemv")
    assert MLAttention._absorbed is ma._absorbed
    ma.uninstall()
    assert MLAttention._absorbed is before
