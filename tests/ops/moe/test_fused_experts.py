"""fused_experts against independent references: HF transformers' DeepseekV3Experts and
KimiLinearExperts (same weights, same routing), a hand-computed case, and properties of the
token permutation. Every implementation that can run here is checked (the Triton one under
TRITON_INTERPRET=1); the generated parity suite compares them with the native reference."""
import math

import pytest
import torch

from kernelgate import KernelgateError, alloc, platform, registry
from kernelgate.ops.moe.fused_experts import make_inputs
from kernelgate.tools.testing import assert_close
from helpers.impls import on_device

OP = registry.get("fused_experts")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _runnable(args, kwargs=None):
    """(name, fn) of every implementation that can run this call on this machine."""
    kwargs = kwargs or {}
    plat = platform.current()
    out = []
    for impl in OP.impls.values():
        if impl.unavailable(plat) or (impl.dtypes and args[0].dtype not in impl.dtypes):
            continue
        if impl.supports and impl.supports(*args, **kwargs):
            continue
        out.append((impl.name, lambda *a, _fn=impl.callable(), **k: on_device(_fn, *a, **k)))
    return out


def _hf_experts(kind, D, I, E, dtype):
    if kind == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as cls
        cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E)
    else:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearExperts as cls
        cfg = KimiLinearConfig(hidden_size=D, moe_intermediate_size=I, num_experts=E)
    cfg.hidden_act = "silu"
    return cls(cfg).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind,T,D,I,E,k", [
    ("deepseek_v3", 65, 96, 80, 8, 2),
    ("kimi_linear", 7, 64, 48, 16, 8),
    ("kimi_linear", 1, 96, 80, 8, 4),
], ids=["dsv3-T65-D96-I80-E8-k2", "kimi-T7-D64-I48-E16-k8", "kimi-T1-D96-I80-E8-k4"])
def test_matches_hf_experts(kind, T, D, I, E, k, dtype):
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(
        T, D, I, E, k, dtype, "cpu", torch.Generator().manual_seed(7))
    hf = _hf_experts(kind, D, I, E, dtype)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w_gate_up)
        hf.down_proj.copy_(w_down)
        want = hf(x, topk_ids.long(), topk_w)
    impls = _runnable((x, w_gate_up, w_down, topk_w, topk_ids))
    assert "native" in dict(impls)
    for name, fn in impls:
        assert_close(fn(x, w_gate_up, w_down, topk_w, topk_ids), want, TOL[dtype], what=name)


def test_sentinel_id_is_skipped_like_hf():
    # HF's experts skip id == E (its "no expert" slot); any id outside [0, E) must add nothing.
    T, D, I, E, k = 9, 64, 32, 4, 3
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(
        T, D, I, E, k, torch.float32, "cpu", torch.Generator().manual_seed(3))
    topk_ids[::2, 1] = E
    hf = _hf_experts("deepseek_v3", D, I, E, torch.float32)
    with torch.no_grad():
        hf.gate_up_proj.copy_(w_gate_up)
        hf.down_proj.copy_(w_down)
        want = hf(x, topk_ids.long(), topk_w)
    for name, fn in _runnable((x, w_gate_up, w_down, topk_w, topk_ids)):
        assert_close(fn(x, w_gate_up, w_down, topk_w, topk_ids), want, 1e-5, what=name)
        negative = topk_ids.masked_fill(topk_ids == E, -3).long()   # int64 ids are accepted too
        assert_close(fn(x, w_gate_up, w_down, topk_w, negative), want, 1e-5, what=f"{name} (id -3, int64)")


def _silu(z):
    return z / (1 + math.exp(-z))


@pytest.mark.parametrize("limit", [None, 1.5], ids=["nolimit", "limit1.5"])
def test_hand_computed(limit):
    # D=2, I=1, E=2. Expert 0: gate row (1, 1), up row (2, 0), down column (1, -1).
    #                Expert 1: gate row (0, 1), up row (1, 1), down column (3, 0.5).
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    w_gate_up = torch.tensor([[[1.0, 1.0], [2.0, 0.0]], [[0.0, 1.0], [1.0, 1.0]]])
    w_down = torch.tensor([[[1.0], [-1.0]], [[3.0], [0.5]]])
    topk_ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32)
    topk_w = torch.tensor([[0.25, 0.75], [0.5, 0.9]])
    L = math.inf if limit is None else limit
    # token 0: expert 0 has gate 1, up 2; expert 1 has gate 0 (silu(0) = 0). token 1: expert 1
    # has gate 2, up 2; its second id is invalid.
    a0 = _silu(min(1.0, L)) * min(2.0, L)
    a1 = _silu(min(2.0, L)) * min(2.0, L)
    want = torch.tensor([[0.25 * a0 * 1.0, 0.25 * a0 * -1.0], [0.5 * a1 * 3.0, 0.5 * a1 * 0.5]])
    args = (x, w_gate_up, w_down, topk_w, topk_ids)
    kw = {"swiglu_limit": limit}
    impls = _runnable(args, kw)
    assert "native" in dict(impls)
    for name, fn in impls:
        assert_close(fn(*args, **kw), want, 1e-6, what=name)


def test_all_ids_invalid_gives_zeros():
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(
        5, 64, 32, 4, 2, torch.bfloat16, "cpu", torch.Generator().manual_seed(1))
    topk_ids[:, 0], topk_ids[:, 1] = -1, 4
    for name, fn in _runnable((x, w_gate_up, w_down, topk_w, topk_ids)):
        out = fn(x, w_gate_up, w_down, topk_w, topk_ids)
        assert out.shape == (5, 64) and torch.equal(out, torch.zeros_like(out)), name


@pytest.mark.parametrize("bad,arg,needle", [
    (lambda a: {**a, "w_down": a["w_down"][:, :, :-1]}, "w_down", "shape"),
    (lambda a: {**a, "w_gate_up": a["w_gate_up"][:, :-1]}, "w_gate_up", "2*I"),
    (lambda a: {**a, "topk_weights": a["topk_weights"].bfloat16()}, "topk_weights", "float32"),
    (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids", "int32"),
    (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, "topk_ids", "T="),
    (lambda a: {**a, "w_gate_up": a["w_gate_up"].bfloat16()}, "w_gate_up", "dtype"),
    (lambda a: {**a, "activation": "gelu"}, "activation", "silu"),
    (lambda a: {**a, "swiglu_limit": -1.0}, "swiglu_limit", "> 0"),
], ids=["w_down-shape", "w_gate_up-odd", "weights-dtype", "ids-dtype", "ids-rows", "w-dtype",
        "activation", "limit"])
def test_bad_input_raises(bad, arg, needle):
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(
        3, 64, 32, 4, 2, torch.float32, "cpu", torch.Generator().manual_seed(0))
    good = dict(x=x, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_w, topk_ids=topk_ids)
    with pytest.raises(KernelgateError) as e:
        OP(**bad(good))
    msg = str(e.value)
    assert msg.startswith("fused_experts:") and arg in msg and needle in msg, msg


triton_here = pytest.mark.skipif(platform.current().triton is not None,
                                 reason="Triton cannot run here (set TRITON_INTERPRET=1 on CPU)")


@triton_here
@pytest.mark.parametrize("T,k,E,block_m", [(1, 8, 256, 16), (33, 4, 6, 16), (70, 2, 3, 64), (5, 8, 384, 32)],
                         ids=["T1-k8-E256-BM16", "T33-k4-E6-BM16", "T70-k2-E3-BM64", "T5-k8-E384-BM32"])
def test_moe_align_is_a_padded_permutation(T, k, E, block_m):
    from kernelgate import alloc
    from kernelgate.ops.moe.moe_align_triton import moe_align
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(-2, E + 2, (T, k), generator=g, dtype=torch.int32)
    with alloc.poisoned():
        pairs, block_expert = on_device(moe_align, ids, E, block_m)
    flat, P = ids.flatten(), T * k
    live = block_expert >= 0
    n_live = int(live.sum())
    assert bool(live[:n_live].all()), "live blocks must come first"
    assert bool((block_expert[:n_live][1:] >= block_expert[:n_live][:-1]).all()), "blocks sorted by expert"
    rows = pairs[:n_live * block_m].view(n_live, block_m).long()
    real = rows < P
    # every row of a block is padding or a pair routed to that block's expert
    assert bool((flat[rows.clamp(max=P - 1)][real] == block_expert[:n_live, None].expand_as(rows)[real]).all())
    valid = ((flat >= 0) & (flat < E)).nonzero().flatten()
    assert torch.equal(rows[real].sort().values, valid), "each valid pair exactly once"
    counts = torch.bincount(flat[valid].long(), minlength=E)
    assert n_live == int(((counts + block_m - 1) // block_m).sum()), "padding is minimal"


@pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
@pytest.mark.parametrize("x_rows,down_x_rows", [(False, False), (True, True), (False, True)],
                         ids=["x-once", "x-rows", "h-rows"])
@pytest.mark.parametrize("T", [1, 3])
def test_gemv_launch_forms_match_hf(monkeypatch, T, x_rows, down_x_rows):
    """The decode GEMV with x (gate/up) and h (down) loaded once per K step or in the weight tile's
    shape (X_ROWS / DOWN_X_ROWS, NVIDIA's down form), 2-row down programs: equal to the reference."""
    from kernelgate.ops.moe import fused_experts_gemv_triton as gemv
    monkeypatch.setattr(gemv, "launch_config", lambda plat, tokens=2: dict(
        BLOCK_I=8, BLOCK_O=16, BLOCK_K=32, num_warps=4, DOWN_O=2, DOWN_K=64, DOWN_WARPS=4, X_ROWS=x_rows,
        DOWN_X_ROWS=down_x_rows))
    for dtype in (torch.float32, torch.bfloat16):
        args, kw = make_inputs(T, 96, 80, 6, 3, dtype, "cpu", torch.Generator().manual_seed(T))
        assert_close(gemv.fused_experts_gemv(*args, **kw), OP.reference(*args, **kw), TOL[dtype], what=f"{dtype}")


@pytest.mark.skipif(not platform.interpreting(), reason="runs under TRITON_INTERPRET=1 only")
@pytest.mark.parametrize("D,I", [(160, 72), (256, 128)], ids=["k-tail", "k-tiled"])
@pytest.mark.parametrize("rows", [8, 16])
def test_one_token_word_gemv_matches_the_reference(rows, D, I):
    """One token on bf16 weights read as 4-value words (K steps that tile K or end in a masked tail), x
    in bf16 (words) and fp32 (element loads), a -1 id, an id past E and a swiglu limit: equal to the
    reference; weight rows that are not whole 8-byte words take the other GEMV, equal too."""
    from kernelgate.ops.moe import fused_experts_gemv_triton as gemv
    from kernelgate.ops.moe import fused_experts_words_triton as words
    launch = dict(gate_up=(rows, 128, 4), down=(rows, 64, 2))
    for x_dtype, limit in ((torch.bfloat16, None), (torch.float32, 0.5)):
        (x, gu, dn, tw, ti), kw = make_inputs(1, D, I, 6, 4, torch.bfloat16, "cpu", torch.Generator().manual_seed(rows),
                                              limit=limit)
        x = x.to(x_dtype)
        ti[0, 1], ti[0, 3] = -1, 6
        assert words.bf16_words(gu) is not None and words.bf16_words(dn) is not None
        want = OP.reference(x.float(), gu.float(), dn.float(), tw, ti, **kw)
        assert_close(gemv.fused_experts_gemv(x, gu, dn, tw, ti, **kw, launch=launch), want.to(x_dtype),
                     TOL[x_dtype] if x_dtype == torch.float32 else 2e-2, what=f"{x_dtype}")
    odd = torch.zeros(6, D, I + 2, dtype=torch.bfloat16)[:, :, :I].copy_(dn)       # rows of I + 2 values
    assert words.bf16_words(odd) is None
    assert_close(gemv.fused_experts_gemv(x, gu, odd, tw, ti, **kw), want.to(x.dtype), TOL[torch.float32], what="odd rows")


@triton_here
@pytest.mark.parametrize("T,impl", [(3, "triton_gemv"), (9, "triton")])
def test_simulated_xpu_dispatches_to_triton(T, impl):
    """Decode batches (T <= 8) take the GEMV kernel, larger ones the grouped GEMM; both portable."""
    with platform.simulate("xpu"):
        args, _ = make_inputs(T, 64, 32, 4, 2, torch.float32, platform.current().device,
                              torch.Generator().manual_seed(0))
        chosen = [i.name for i, why in OP.explain(args, {}) if why is None]
        assert chosen == [impl]
        assert_close(OP(*args), OP.reference(*args), 1e-5)


def test_block_m_grows_with_rows_per_expert():
    from kernelgate.ops.moe.fused_experts_triton import block_m_for
    # (bucket of pairs, experts) -> rows per block: decode 16, then 32, 64, and 128 from ~128 rows per expert
    assert [block_m_for(p, 256) for p in (16, 2048, 4096, 32768, 65536, 131072)] == [16, 16, 32, 64, 128, 128]
    assert block_m_for(131072, 256, largest=64) == 64   # (the FP8 grouped GEMM stays at 64)


@triton_here
def test_grouped_gemm_with_blocks_of_128_rows_matches_native():
    """A prefill-sized bucket (512 pairs over 2 experts) takes BLOCK_M 128: every row block, the
    padded last one of each expert included, against the native reference in fp32."""
    from kernelgate.ops.moe.fused_experts_triton import fused_experts_triton, route
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(
        150, 64, 32, 2, 2, torch.float32, "cpu", torch.Generator().manual_seed(3))
    assert on_device(route, topk_ids, 2).block_m == 128
    want = OP.impls["native"].callable()(x, w_gate_up, w_down, topk_w, topk_ids)
    assert_close(on_device(fused_experts_triton, x, w_gate_up, w_down, topk_w, topk_ids), want, 1e-5,
                 what="BLOCK_M 128")


@triton_here
@pytest.mark.parametrize("group_m", [0, 2, 4])
def test_grouped_tile_order_covers_every_tile(monkeypatch, group_m):
    """GROUP_M row blocks take all their column tiles together (_tile; 0: the 2-D grid's order):
    with a row-block count that GROUP_M does not divide (at 4 the last, partial group holds a
    live block) and several column tiles, every tile is computed exactly once -- the bf16-weight
    and the FP8 grouped GEMMs against their native references (fp32)."""
    from kernelgate.ops.moe import fused_experts_fp8 as fp8
    from kernelgate.ops.moe import fused_experts_triton as ft
    from kernelgate.ops.moe.fused_experts_fp8_triton import fused_experts_fp8_triton
    monkeypatch.setitem(ft._FIXED, "GROUP_M", group_m)
    monkeypatch.setitem(ft._FIXED, "BLOCK_N", 16)            # I 48 -> 3 column tiles, D 64 -> 4
    g = torch.Generator().manual_seed(11)
    (x, w_gate_up, w_down, topk_w, topk_ids), _ = make_inputs(40, 64, 48, 5, 2, torch.float32, "cpu", g)
    with alloc.poisoned():
        got = on_device(ft.fused_experts_triton, x, w_gate_up, w_down, topk_w, topk_ids)
    blocks = on_device(ft.route, topk_ids, 5).block_expert
    nb, live = blocks.numel(), int((blocks >= 0).sum())
    assert group_m == 0 or nb % group_m and (group_m == 2 or live > nb - nb % group_m), (nb, live)   # partial group
    assert_close(got, OP.impls["native"].callable()(x, w_gate_up, w_down, topk_w, topk_ids), 1e-5,
                 what=f"GROUP_M {group_m}")
    (x, gu, dn, tw, ti, gus, dns), kw = fp8.make_inputs(40, 128, 48, 5, 2, torch.float32, "cpu",
                                                        torch.Generator().manual_seed(12), block=(128, 128))
    with alloc.poisoned():
        got = on_device(fused_experts_fp8_triton, x, gu, dn, tw, ti, gus, dns, **kw)
    want = registry.get("fused_experts_fp8").reference(x, gu, dn, tw, ti, gus, dns, **kw)
    assert_close(got, want, 1e-5, what=f"FP8, GROUP_M {group_m}")
