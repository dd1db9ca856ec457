"""Independent GDN references for the tests: transformers' Qwen3-Next torch fallbacks (the
undecorated functions, so no fla kernel is routed in) and fla-core's naive gated delta rule."""
import functools

import pytest


@functools.cache
def hf():
    mod = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

    def raw(f):
        return getattr(f, "__wrapped__", f)
    return dict(chunk=raw(mod.torch_chunk_gated_delta_rule), recurrent=raw(mod.torch_recurrent_gated_delta_rule),
                l2norm=mod.l2norm)


def fla_naive():
    return pytest.importorskip("fla.ops.gated_delta_rule.naive")


def fla_gate():
    return pytest.importorskip("fla.ops.gated_delta_rule.gate")


def hf_sequence(q, k, v, g, beta, S0, form="chunk"):
    """transformers on one sequence (q, k [L, HK, K], v [L, HV, V], g, beta [L, HV], S0 [HV, K, V]),
    inputs read in fp32, q / k L2-normalised in the function -> (o [L, HV, V] fp32, final S)."""
    o, S = hf()[form](q.float()[None], k.float()[None], v.float()[None], g.float()[None], beta.float()[None],
                      initial_state=S0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o[0], S[0]


def fla_sequence(q, k, v, g, beta, S0):
    """fla's naive_recurrent_gated_delta_rule (no grouped heads, no L2 norm in it) on one sequence,
    with the q/k heads repeated per value head and HF's l2norm first."""
    G = v.shape[1] // q.shape[1]
    q, k = (hf()["l2norm"](x.float()).repeat_interleave(G, dim=1) for x in (q, k))
    o, S = fla_naive().naive_recurrent_gated_delta_rule(q[None], k[None], v.float()[None], beta.float()[None],
                                                        g.float()[None], initial_state=S0[None].clone(),
                                                        output_final_state=True)
    return o[0], S[0]
