"""short_conv / short_conv_update vs HF transformers' causal_conv1d torch fallbacks."""
import pytest
import torch

from kernelgate import KernelgateError
from kernelgate.tools.testing import rel_err

from helpers.kda_refs import call, hf, runnable

W = 4


def _inputs(lens, D, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), D, generator=g).to(dtype)
    w = (0.5 * torch.randn(D, W, generator=g)).to(dtype)
    b = torch.randn(D, generator=g).to(dtype)
    state = torch.randn(S, D, W - 1, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return x, w, b, state, cu


def _hf_reference(x, w, b, state, cu, slots):
    """Per sequence: HF causal_conv1d_update on a copy of the slot's context (it takes any
    number of new tokens), or causal_conv1d_fn (zero context) for a skipped slot."""
    ref = hf()
    y = torch.empty_like(x)
    new_state = state.clone()
    for n, slot in enumerate(slots):
        s, e = int(cu[n]), int(cu[n + 1])
        xs = x[s:e].t()[None].float()                                      # [1, D, L]
        if slot < 0:
            out = ref["conv_fn"](xs, w.float(), b.float(), activation="silu")
        else:
            ctx = state[slot][None].float().clone()
            out = ref["conv_update"](xs, ctx, w.float(), b.float(), activation="silu")
            new_state[slot] = ctx[0].to(state.dtype)
        y[s:e] = out[0].t().to(x.dtype)
    return y, new_state


@pytest.mark.parametrize("impl", runnable("short_conv"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,slots", [([1], [0]), ([63, 2, 65], [2, -1, 0]), ([130, 1, 17], [1, 3, 0])],
                         ids=["L1", "L63_2_65-skip", "L130_1_17"])
def test_short_conv_vs_hf(impl, dtype, lens, slots):
    x, w, b, state, cu = _inputs(lens, 60, 5, dtype)
    ref_y, ref_state = _hf_reference(x, w, b, state, cu, slots)
    before = state.clone()
    y = call("short_conv", impl, x, w, b, state, cu, torch.tensor(slots, dtype=torch.int32))
    assert rel_err(y, ref_y) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(state, ref_state)          # context values are copied, never recomputed
    for s in set(range(5)) - set(slots):
        assert torch.equal(state[s], before[s]), f"slot {s} not in the batch was modified"


@pytest.mark.parametrize("impl", runnable("short_conv"))
def test_split_parts_are_the_columns_of_the_whole(impl):
    """split=(q, k, v) hands back contiguous parts equal to the whole output's column ranges (a
    part boundary inside a channel tile, a skipped slot, rows no sequence covers), and the same
    context written to the slots."""
    x, w, b, state, cu = _inputs([40, 3, 9], 100, 4, torch.float32, seed=3)
    cu = torch.tensor([0, 40, 43, 50], dtype=torch.int32)        # rows 50..51 uncovered
    slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    s1, s2 = state.clone(), state.clone()
    whole = call("short_conv", impl, x, w, b, s1, cu, slots)
    parts = call("short_conv", impl, x, w, b, s2, cu, slots, split=(20, 16, 64))
    assert [tuple(p.shape) for p in parts] == [(52, 20), (52, 16), (52, 64)]
    assert all(p.is_contiguous() for p in parts)
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=0, atol=0)
    assert torch.equal(s1, s2)
    assert (whole[50:] == 0).all()


@pytest.mark.parametrize("impl", runnable("short_conv_update"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_update_vs_hf_and_continuity(impl, dtype):
    """prefix through short_conv, then 3 single-token updates == short_conv of the whole."""
    lens, slots = [5, 64, 2], [2, 0, 4]
    x, w, b, state, _ = _inputs([l + 3 for l in lens], 96, 6, dtype, seed=1)
    whole_state, prefix_state = state.clone(), state.clone()
    starts = torch.tensor([0] + torch.tensor([l + 3 for l in lens]).cumsum(0).tolist())
    cu_whole = starts.to(torch.int32)
    sl = torch.tensor(slots, dtype=torch.int32)
    y_whole = call("short_conv", "native", x, w, b, whole_state, cu_whole, sl)
    pre = torch.cat([torch.arange(int(starts[n]), int(starts[n]) + lens[n]) for n in range(3)])
    cu_pre = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    call("short_conv", "native", x[pre], w, b, prefix_state, cu_pre, sl)
    for step in range(3):
        rows = torch.tensor([int(starts[n]) + lens[n] + step for n in range(3)])
        hf_state = prefix_state.clone()
        y = call("short_conv_update", impl, x[rows], w, b, prefix_state, sl)
        ref = torch.stack([hf()["conv_update"](x[rows][n][None, :, None].float(), hf_state[slots[n]][None].float(),
                                               w.float(), b.float(), activation="silu")[0, :, 0] for n in range(3)])
        assert rel_err(y, ref) < (1e-5 if dtype == torch.float32 else 1e-2)
        assert rel_err(y, y_whole[rows]) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(prefix_state, whole_state)


@pytest.mark.parametrize("impl", runnable("short_conv_update"))
def test_update_skips_negative_slot(impl):
    x, w, b, state, _ = _inputs([3], 60, 3, torch.float32, seed=2)
    before = state.clone()
    y = call("short_conv_update", impl, x, w, b, state, torch.tensor([-1, 2, -1], dtype=torch.int32))
    # skipped rows see zero context: y = silu(b + w[:, -1] * x)
    assert rel_err(y[0], torch.nn.functional.silu(b + w[:, -1] * x[0])) < 1e-6
    assert torch.equal(state[0], before[0]) and torch.equal(state[1], before[1])
    assert torch.equal(state[2, :, -1], x[1]) and torch.equal(state[2, :, :2], before[2, :, 1:])


def test_short_conv_rejects_bad_input():
    from kernelgate import ops
    x, w, b, state, cu = _inputs([4], 60, 2, torch.float32)
    with pytest.raises(KernelgateError, match=r"short_conv: conv_state shape \(2, 60, 2\) != \(\*, 60, 3\)"):
        ops.short_conv(x, w, b, state[..., :2], cu, torch.tensor([0], dtype=torch.int32))
    for bad in [(30, 20), (60, 0), (10, 10, 10, 30), [20, 20, 20]]:
        with pytest.raises(KernelgateError, match=r"short_conv: split .* must be a tuple of 1 to 3 positive "
                                                  r"channel counts summing to D = 60"):
            ops.short_conv(x, w, b, state, cu, torch.tensor([0], dtype=torch.int32), split=bad)
    with pytest.raises(KernelgateError, match=r"short_conv_update: slots shape \(2,\) != \(4,\)"):
        ops.short_conv_update(x, w, b, state, torch.tensor([0, 1], dtype=torch.int32))
