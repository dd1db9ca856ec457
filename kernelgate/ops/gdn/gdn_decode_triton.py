"""GDN decode launchers on KDA's portable Triton step kernel (kda/kda_decode_triton.py): g [N, HV]
selects its one-decay-per-head form, the head counts its grouping (v head h reads q/k head
h // (HV // HK))."""
from __future__ import annotations

from ..kda.kda_decode import unpack
from ..kda.kda_decode_triton import launch_step


def gdn_decode(q, k, v, g, beta, state, slots, scale=None, qk_l2norm=True):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return launch_step(q, k, v, g, beta, None, None, state, slots, scale, None, False, qk_l2norm)


def gdn_packed_decode(qkv, a, b, A_log, dt_bias, state, slots, num_k_heads, num_v_heads, head_k_dim, scale=None):
    q, k, v = unpack(qkv, num_k_heads, head_k_dim, num_v_heads)
    scale = head_k_dim ** -0.5 if scale is None else scale
    return launch_step(q, k, v, a, b, A_log, dt_bias, state, slots, scale, None, True, True)
