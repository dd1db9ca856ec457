"""Short causal depthwise convolution (KDA / Mamba q|k|v conv), varlen, slot-held context.

    y[t, d] = act(bias[d] + sum_j weight[d, j] * x[t - (W-1) + j, d])

over each sequence of a packed batch (`cu_seqlens` [N+1]); the W-1 inputs before a
sequence's first token come from `conv_state[slots[n]]` [D, W-1] (oldest first) and the
last W-1 inputs (context included when the sequence is shorter) are written back there.
slot < 0 (skip) or >= the pool size: zero initial context and no state read or write.
A sequence whose bounds are not 0 <= cu_seqlens[n] <= cu_seqlens[n+1] <= T is skipped; rows
no (valid) sequence covers are zeros. Math in fp32, y in x's dtype. Checked mode
(KERNELGATE_CHECKS=1) raises instead: slots within the pool and distinct, cu_seqlens from 0,
non-decreasing, ending at T.
`short_conv_update` is the single-token decode form (x [N, D], one token per sequence).
`short_conv` takes an optional keyword `cu_seqlens_cpu`: a CPU copy of `cu_seqlens` from a
caller that knows the layout on the host, so that no implementation needs a device->host
copy (sync). Its dtype, shape and device are checked; its values are the caller's word.
With `split` (1 to 3 channel counts summing to D, e.g. q | k | v) it returns that many
contiguous [T, n] tensors instead of one [T, D]: the parts a chunked delta-rule kernel takes,
without a copy of each strided view (fla's kernels make their inputs contiguous: three copies a
layer and chunk, 87 ms of a 128k-token Kimi prefill on the H200).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ... import checks
from ...registry import GPU_TRITON, Case, declare
from ..common import index_checks
from ..common.varlen import INDEX, seq_range, validate_host_hint

ACTIVATIONS = ("silu", "swish", None)


def _conv(ctx, xs, weight, bias, activation):
    """ctx [D, W-1] and xs [L, D] -> (y [L, D] fp32, new context [D, W-1])."""
    D, W = weight.shape
    full = torch.cat([ctx.float(), xs.float().t()], dim=1)                      # [D, W-1+L]
    y = F.conv1d(full[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                 groups=D)[0].t()                                            # [L, D]
    if activation is not None:
        y = F.silu(y)
    return y, full[:, full.shape[1] - (W - 1):]


def short_conv_native(x, weight, bias, conv_state, cu_seqlens, slots, activation="silu", *, cu_seqlens_cpu=None,
                      split=None):
    """Short causal conv reference over a varlen batch; conv_state updated in place."""
    D, W = weight.shape
    T, pool = x.shape[0], conv_state.shape[0]
    y = torch.zeros_like(x)
    bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    for n, slot in enumerate(slots.tolist()):
        rows = seq_range(bounds, n, T)
        if rows is None or rows[0] == rows[1]:   # skipped, or no tokens: the context stays
            continue
        s, e = rows
        live = 0 <= slot < pool
        ctx = conv_state[slot] if live else x.new_zeros(D, W - 1)
        out, new_ctx = _conv(ctx, x[s:e], weight, bias, activation)
        y[s:e] = out.to(x.dtype)
        if live:
            conv_state[slot] = new_ctx.to(conv_state.dtype)
    return y if split is None else tuple(t.contiguous() for t in y.split(list(split), dim=-1))


def short_conv_update_native(x, weight, bias, conv_state, slots, activation="silu"):
    """Single-token short conv reference (x [N, D]); conv_state updated in place."""
    N, D = x.shape
    pool = conv_state.shape[0]
    valid = (slots >= 0) & (slots < pool)
    if pool:
        ctx = conv_state[torch.where(valid, slots, 0).long()].float() * valid.view(N, 1, 1)  # [N, D, W-1]
    else:
        ctx = x.new_zeros(N, D, weight.shape[1] - 1, dtype=torch.float32)
    full = torch.cat([ctx, x.float()[:, :, None]], dim=2)                             # [N, D, W]
    y = (full * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation is not None:
        y = F.silu(y)
    idx = slots[valid].long()
    conv_state.index_copy_(0, idx, full[valid][:, :, 1:].to(conv_state.dtype))
    return y.to(x.dtype)


def _validate_common(op, x, weight, bias, conv_state, slots, activation, rows):
    checks.tensor(op, "x", x, ndim=2, dtype=checks.FLOATS)
    D = x.shape[1]
    checks.tensor(op, "weight", weight, ndim=2, dtype=checks.FLOATS, device=x.device)
    checks.require(weight.shape[0] == D and weight.shape[1] >= 2, op,
                   f"weight shape {tuple(weight.shape)} != ({D}, W) with W >= 2")
    W = weight.shape[1]
    checks.tensor(op, "bias", bias, shape=(D,), dtype=checks.FLOATS, device=x.device, optional=True)
    checks.tensor(op, "conv_state", conv_state, shape=(None, D, W - 1), dtype=checks.FLOATS, device=x.device)
    checks.tensor(op, "slots", slots, shape=(rows,), dtype=INDEX, device=x.device)
    checks.require(activation in ACTIVATIONS, op, f"activation {activation!r} not in {ACTIVATIONS}")


def validate_short_conv(x, weight, bias, conv_state, cu_seqlens, slots, activation="silu", *, cu_seqlens_cpu=None,
                        split=None):
    checks.tensor("short_conv", "cu_seqlens", cu_seqlens, ndim=1, dtype=INDEX)
    checks.require(cu_seqlens.shape[0] >= 2, "short_conv", "cu_seqlens needs N+1 >= 2 entries")
    _validate_common("short_conv", x, weight, bias, conv_state, slots, activation, cu_seqlens.shape[0] - 1)
    checks.tensor("short_conv", "cu_seqlens", cu_seqlens, device=x.device)
    validate_host_hint("short_conv", "cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    if split is not None:
        D = x.shape[1]
        checks.require(isinstance(split, tuple) and 1 <= len(split) <= 3
                       and all(type(n) is int and n > 0 for n in split) and sum(split) == D, "short_conv",
                       f"split {split!r} must be a tuple of 1 to 3 positive channel counts summing to D = {D}")


def validate_update(x, weight, bias, conv_state, slots, activation="silu"):
    _validate_common("short_conv_update", x, weight, bias, conv_state, slots, activation,
                     x.shape[0] if x.dim() == 2 else None)


def check_short_conv(x, weight, bias, conv_state, cu_seqlens, slots, activation="silu", *, cu_seqlens_cpu=None,
                     split=None):
    index_checks.cu_seqlens("short_conv", cu_seqlens, x.shape[0])
    index_checks.hint("short_conv", "cu_seqlens_cpu", cu_seqlens_cpu, cu_seqlens)
    index_checks.slots("short_conv", "slots", slots, conv_state.shape[0])


def check_update(x, weight, bias, conv_state, slots, activation="silu"):
    index_checks.slots("short_conv_update", "slots", slots, conv_state.shape[0])


# -- cases: varlen with odd lengths, a skipped slot, a slot pool larger than the batch ---
def _inputs(gen, device, dtype, T, D, W, S, bias):
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    x = r(T, D).to(device=device, dtype=dtype)
    weight = (0.5 * r(D, W)).to(device=device, dtype=dtype)
    b = r(D).to(device=device, dtype=dtype) if bias else None
    state = r(S, D, W - 1).to(device=device, dtype=dtype)
    return x, weight, b, state


def _conv_case(lens, slots, D, W=4, bias=True, act="silu", hints=False, split=None):
    def make(device, dtype, gen):
        x, w, b, state = _inputs(gen, device, dtype, sum(lens), D, W, max(slots) + 2, bias)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
        kw = dict(activation=act, **(dict(cu_seqlens_cpu=cu.cpu()) if hints else {}),
                  **(dict(split=split) if split else {}))
        return (x, w, b, state, cu, torch.tensor(slots, dtype=torch.int32, device=device)), kw
    lid = "L" + "_".join(map(str, lens))
    return Case(f"{lid}-D{D}-W{W}-slots{'_'.join(map(str, slots))}{'' if bias else '-nobias'}-{act}"
                + ("-hints" if hints else "") + (f"-split{'_'.join(map(str, split))}" if split else ""), make)


def conv_cases():
    return [_conv_case([1], [0], 64), _conv_case([63, 2, 65], [2, -1, 0], 60),
            _conv_case([3, 17, 1, 40], [1, 4, 3, 0], 96, bias=False, act=None),
            _conv_case([5, 0, 33], [0, 2, -1], 64, hints=True),
            # parts that do not line up with the kernels' channel tiles; rows left uncovered
            _conv_case([40, 3, 9], [1, -1, 0], 100, split=(20, 16, 64)), _conv_case([7], [0], 48, split=(48,))]


def _update_case(N, slots, D, W=4, bias=True, act="silu"):
    def make(device, dtype, gen):
        x, w, b, state = _inputs(gen, device, dtype, N, D, W, max(slots) + 2, bias)
        return (x, w, b, state, torch.tensor(slots, dtype=torch.int32, device=device)), dict(activation=act)
    return Case(f"N{N}-D{D}-W{W}-slots{'_'.join(map(str, slots))}{'' if bias else '-nobias'}-{act}", make)


def update_cases():
    return [_update_case(1, [0], 64), _update_case(3, [2, -1, 0], 60),
            _update_case(5, [4, 1, 6, 0, 3], 200, bias=False, act=None)]


def update_bench_cases():
    def make(N, D):
        def f(device, dtype, gen):
            x, w, b, state = _inputs(gen, device, dtype, N, D, 4, N, False)
            return (x, w, b, state, torch.arange(N, dtype=torch.int32, device=device)), {}
        return f

    def nbytes(args, kwargs):
        x, w, _, state, _ = args
        return 2 * x.numel() * x.element_size() + 2 * x.numel() * 3 * state.element_size()
    # Kimi Linear 48B: q|k|v conv width = 3 * 32 heads * 128
    return [Case(f"N{n}-D12288", make(n, 12288), dtypes=(torch.bfloat16,), bytes=nbytes) for n in (1, 32, 256)]


short_conv = declare("short_conv", short_conv_native, validate=validate_short_conv, cases=conv_cases,
                     check_values=check_short_conv, mutates=("conv_state",))

short_conv.implementation("triton", ".short_conv_triton:short_conv", provider="triton",
                          platforms=GPU_TRITON, requires=("triton",), priority=10,
                          doc="portable Triton varlen conv; context read from / written to the slot pool")

short_conv_update = declare("short_conv_update", short_conv_update_native, validate=validate_update,
                            check_values=check_update, cases=update_cases, bench_cases=update_bench_cases, mutates=("conv_state",))
short_conv_update.implementation("triton", ".short_conv_triton:short_conv_update",
                                 provider="triton", platforms=GPU_TRITON, requires=("triton",), priority=10,
                                 doc="portable Triton single-token conv update in the slot pool")
