"""A stand-in for cuDNN's attention in mla_prefill_sdpa's lse kernels (also paged_attention_prefill's):
it takes only pieces whose query and key counts are multiples of `multiple` -- as cuDNN gets only
lengths that are multiples of CUDNN_MULTIPLE, which is set to the same -- records each call as
(queries, keys, causal) and computes in fp32. The CPU's kernel order becomes (stand-in, cpu_flash)."""
import torch


def planned_stand_in(monkeypatch, multiple: int = 4):
    """-> (calls, stand_in), installed for this test; stand_in.masked lists the calls that came
    with a bias (padded keys of an unmasked piece) as (queries, keys, keys hidden by the bias)."""
    from kernelgate.ops.mla import mla_prefill_sdpa as M
    calls = []

    def stand_in(q, k, v, scale, causal, bias=None):
        assert q.shape[2] % multiple == 0 and k.shape[2] % multiple == 0, (q.shape, k.shape)
        calls.append((q.shape[2], k.shape[2], causal))
        if bias is not None:
            stand_in.masked.append((q.shape[2], k.shape[2], int(torch.isinf(bias[0, 0, 0]).sum())))
        return M._math_lse(q, k, v, scale, causal, bias)
    stand_in.masked = []
    monkeypatch.setattr(M, "CUDNN_MULTIPLE", multiple)
    monkeypatch.setitem(M.LSE_KERNELS, "cudnn", stand_in)
    monkeypatch.setitem(M.LSE_DTYPES, "cudnn", (torch.float32, torch.float16, torch.bfloat16))   # (any: fp32 math)
    monkeypatch.setitem(M.LSE_ORDER, "cpu", ("cudnn", "cpu_flash"))
    return calls, stand_in
