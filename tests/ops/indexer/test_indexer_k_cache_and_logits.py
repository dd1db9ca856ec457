"""indexer_k_quant_and_cache and fp8_paged_mqa_logits: hand-computed logits, -inf masking,
block-table indirection, cache round trip, and a DeepGEMM-style per-block loop reference.

The cache is packed and read here with the test's own byte arithmetic (layout: per block,
block_size x 128 fp8 codes, then block_size fp32 scales), independent of the op module."""
import pytest
import torch

from kernelgate import KernelgateError, registry
from helpers.impls import poisoned_impl

STORE, LOGITS = "indexer_k_quant_and_cache", "fp8_paged_mqa_logits"
E4M3 = torch.float8_e4m3fn


_impl = poisoned_impl


@pytest.fixture(params=["native", "triton_kq", "triton"])
def logits(request):
    return _impl(LOGITS, request.param)


@pytest.fixture(params=["native", "triton"])
def store(request):
    return _impl(STORE, request.param)


def pack(keys, scales, bs):
    """keys fp8 [nb, bs, 128], scales fp32 [nb, bs] -> cache uint8 [nb, bs * 132]."""
    nb = keys.shape[0]
    code_bytes = keys.view(torch.uint8).reshape(nb, bs * 128)
    scale_bytes = scales.float().contiguous().view(torch.uint8).reshape(nb, bs * 4)
    return torch.cat([code_bytes, scale_bytes], 1)


def unpack(kv, bs, dtype=E4M3):
    nb = kv.shape[0]
    return (kv[:, :bs * 128].reshape(nb, bs, 128).view(dtype),
            kv[:, bs * 128:].contiguous().view(torch.float32).reshape(nb, bs))


def test_hand_computed_logits(logits):
    # H=2 heads, q_h = c_h e0 with c = (2, -1); key t = a_t e0 with a = (1, -2, 4), scales (0.5, 1, 0.25);
    # weights (1, 3): logits[t] = s_t * sum_h w_h relu(c_h a_t) = (1.0, 6.0, 2.0), then -inf.
    bs = 2
    keys = torch.zeros(4, bs, 128)
    scales = torch.zeros(4, bs)
    # logical block 0 -> physical 3, logical block 1 -> physical 0
    keys[3, 0, 0], keys[3, 1, 0], keys[0, 0, 0] = 1.0, -2.0, 4.0
    scales[3, 0], scales[3, 1], scales[0, 0] = 0.5, 1.0, 0.25
    kv = pack(keys.to(E4M3), scales, bs)
    q = torch.zeros(1, 1, 2, 128)
    q[0, 0, 0, 0], q[0, 0, 1, 0] = 2.0, -1.0
    out = logits(q.to(E4M3), kv, torch.tensor([[1.0, 3.0]]), torch.tensor([3], dtype=torch.int32),
                 torch.tensor([[3, 0, 1]], dtype=torch.int32), 5)
    inf = float("inf")
    assert torch.equal(out, torch.tensor([[1.0, 6.0, 2.0, -inf, -inf]]))


def _random_problem(B, next_n, H, ctx, bs, gen, fmt_dtype=E4M3):
    max_blocks = max(-(-c // bs) for c in ctx) + 1
    nb = B * max_blocks
    fmax = 448.0 if fmt_dtype == E4M3 else 240.0
    keys = (torch.randn(nb, bs, 128, generator=gen) * 100).clamp(-fmax, fmax).to(fmt_dtype)
    scales = torch.rand(nb, bs, generator=gen) + 0.1
    tables = torch.randperm(nb, generator=gen).view(B, max_blocks).to(torch.int32)
    q = (torch.randn(B, next_n, H, 128, generator=gen) * 50).to(fmt_dtype)
    w = torch.randn(B * next_n, H, generator=gen)
    return q, keys, scales, w, torch.tensor(ctx, dtype=torch.int32), tables


def _loop_reference(q, keys, scales, w, ctx, tables, max_len):
    """DeepGEMM's test convention written as plain loops: per sequence, per logical block."""
    B, next_n, H, _ = q.shape
    bs = keys.shape[1]
    out = torch.full((B * next_n, max_len), float("-inf"), dtype=torch.float64)
    for b in range(B):
        c = int(ctx[b])
        for i in range(next_n):
            q_pos = c - next_n + i
            qi = q[b, i].double()                                        # [H, 128]
            for t in range(min(c, max_len)):
                if t > q_pos:
                    continue
                blk = int(tables[b, t // bs])
                k = keys[blk, t % bs].double()
                out[b * next_n + i, t] = scales[blk, t % bs] * (w[b * next_n + i].double() * (qi @ k).relu()).sum()
    return out


@pytest.mark.parametrize("B,next_n,H,ctx,bs,max_len", [
    (2, 1, 64, [63, 130], 64, 140),
    (3, 2, 16, [1, 17, 40], 16, 48),
    (1, 4, 5, [65], 32, 65),
], ids=["B2-N1-H64-BS64", "B3-N2-H16-BS16", "B1-N4-H5-BS32"])
@pytest.mark.parametrize("fmt_dtype", [E4M3, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
def test_matches_loop_reference_and_masks(logits, B, next_n, H, ctx, bs, max_len, fmt_dtype):
    q, keys, scales, w, ctx_t, tables = _random_problem(B, next_n, H, ctx, bs, torch.Generator().manual_seed(3),
                                                        fmt_dtype)
    out = logits(q, pack(keys, scales, bs), w, ctx_t, tables, max_len)
    ref = _loop_reference(q, keys, scales, w, ctx_t, tables, max_len)
    # -inf exactly where t >= context_len or t > the query's own position
    t = torch.arange(max_len)
    for b in range(B):
        for i in range(next_n):
            valid = (t < ctx[b]) & (t <= ctx[b] - next_n + i)
            assert torch.equal(torch.isinf(out[b * next_n + i]), ~valid)
    fin = torch.isfinite(ref)
    assert (out[~fin] == float("-inf")).all()
    err = ((out[fin].double() - ref[fin]).norm() / ref[fin].norm()).item()
    assert err < 1e-5, err


def test_block_table_indirection(logits):
    # the same keys in contiguous blocks (table = arange) or scattered over a shuffled pool
    g = torch.Generator().manual_seed(5)
    B, H, bs, ctx = 2, 16, 16, [45, 31]
    nblk = 3
    keys = (torch.randn(B * nblk, bs, 128, generator=g) * 30).to(E4M3)
    scales = torch.rand(B * nblk, bs, generator=g) + 0.5
    q = (torch.randn(B, 1, H, 128, generator=g) * 30).to(E4M3)
    w = torch.randn(B, H, generator=g)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    contiguous = logits(q, pack(keys, scales, bs), w, ctx_t,
                        torch.arange(B * nblk, dtype=torch.int32).view(B, nblk), 48)
    perm = torch.randperm(B * nblk + 4, generator=g)[:B * nblk]          # 4 unused blocks of garbage
    pool_k = torch.randint(0, 120, (B * nblk + 4, bs, 128), generator=g, dtype=torch.uint8).view(E4M3)
    pool_s = torch.rand(B * nblk + 4, bs, generator=g)
    pool_k[perm], pool_s[perm] = keys, scales
    shuffled = logits(q, pack(pool_k, pool_s, bs), w, ctx_t, perm.to(torch.int32).view(B, nblk), 48)
    assert torch.isfinite(contiguous).sum() == sum(ctx)
    assert torch.equal(contiguous, shuffled)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_store_round_trip(store, fmt):
    g = torch.Generator().manual_seed(7)
    T, bs, nb = 37, 16, 5
    fmax, dtype = (448.0, E4M3) if fmt == "e4m3fn" else (240.0, torch.float8_e4m3fnuz)
    k = torch.randn(T, 128, generator=g) * torch.logspace(-3, 2, T)[:, None]   # scales over 5 decades
    slots = torch.randperm(nb * bs, generator=g)[:T]
    slots[[0, 9]] = -1                                                   # padding: nothing written
    kv = torch.full((nb, bs * 132), 0x5A, dtype=torch.uint8)
    assert store(k, kv, slots, bs, fp8_format=fmt) is None
    codes, scales = unpack(kv, bs, dtype)
    written = torch.zeros(nb, bs, dtype=torch.bool)
    for i in range(T):
        s = int(slots[i])
        if s < 0:
            continue
        blk, off = divmod(s, bs)
        written[blk, off] = True
        amax = k[i].abs().max()
        assert scales[blk, off] == amax / fmax                          # exact fp32 division
        deq = codes[blk, off].double() * scales[blk, off].double()
        bound = torch.maximum(k[i].double().abs() * 2.0 ** -4, scales[blk, off].double() * 2.0 ** -10)
        assert ((deq - k[i].double()).abs() <= bound * (1 + 1e-6)).all()
        assert codes[blk, off].float().abs().max() == fmax
    # untouched slots keep their bytes (codes and scales)
    view = kv.view(nb, -1)
    assert (view[:, :bs * 128].view(nb, bs, 128)[~written] == 0x5A).all()
    assert (view[:, bs * 128:].reshape(nb, bs, 4)[~written] == 0x5A).all()


def test_store_then_logits_approximates_fp32_scores(store, logits):
    # end to end: keys through the cache op, q quantized per head with its scale folded into
    # the weights; compared with fp32 sum_h w_h relu(q_h . k_t): error of fp8 rounding only
    g = torch.Generator().manual_seed(11)
    H, T, bs = 8, 50, 16
    k = torch.randn(T, 128, generator=g)
    q = torch.randn(1, 1, H, 128, generator=g)
    w = torch.rand(1, H, generator=g)
    kv = torch.zeros(4, bs * 132, dtype=torch.uint8)
    store(k, kv, torch.arange(T), bs)
    q_scale = q.abs().amax(-1) / 448                                     # [1, 1, H]
    q_fp8 = (q / q_scale[..., None]).to(E4M3)
    out = logits(q_fp8, kv, w * q_scale.view(1, H), torch.tensor([T], dtype=torch.int32),
                 torch.arange(4, dtype=torch.int32).view(1, 4), T)
    exact = (w.view(H, 1) * (q.view(H, 128) @ k.T).relu()).sum(0)
    err = ((out[0] - exact).norm() / exact.norm()).item()
    assert err < 0.03, err                                               # 2 x 2^-4 per product, averaged


def _logit_args(**over):
    a = dict(q_fp8=torch.zeros(2, 1, 4, 128).to(E4M3), kv_cache=torch.zeros(3, 16 * 132, dtype=torch.uint8),
             weights=torch.ones(2, 4), context_lens=torch.tensor([5, 6], dtype=torch.int32),
             block_tables=torch.zeros(2, 1, dtype=torch.int32), max_context_len=16)
    a.update(over)
    return a


@pytest.mark.parametrize("over,match", [
    (dict(q_fp8=torch.zeros(2, 1, 4, 128)), "q_fp8 dtype float32"),
    (dict(kv_cache=torch.zeros(3, 16 * 132)), "kv_cache dtype"),
    (dict(kv_cache=torch.zeros(3, 16 * 130, dtype=torch.uint8)), "not block_size \\* 132"),
    (dict(weights=torch.ones(2, 3)), "weights shape"),
    (dict(context_lens=torch.tensor([5, 6])), "context_lens dtype int64"),
    (dict(max_context_len=17), "covers 1 blocks of 16 tokens < max_context_len 17"),
], ids=["q-dtype", "cache-dtype", "cache-bytes", "weights-shape", "ctx-dtype", "tables-short"])
def test_logits_bad_input(over, match):
    with pytest.raises(KernelgateError, match=match) as e:
        registry.get(LOGITS)(**_logit_args(**over))
    assert LOGITS in str(e.value)


@pytest.mark.parametrize("over,match", [
    (dict(k=torch.randn(3, 64)), "k shape"),
    (dict(block_size=32), "!= block_size 32"),
    (dict(slot_mapping=torch.zeros(2, dtype=torch.int64)), "slot_mapping shape"),
    (dict(fp8_format="e5m2"), "fp8_format"),
], ids=["k-shape", "block-size", "slots-shape", "format"])
def test_store_bad_input(over, match):
    a = dict(k=torch.randn(3, 128), kv_cache=torch.zeros(2, 16 * 132, dtype=torch.uint8),
             slot_mapping=torch.zeros(3, dtype=torch.int64), block_size=16)
    a.update(over)
    with pytest.raises(KernelgateError, match=match) as e:
        registry.get(STORE)(**a)
    assert STORE in str(e.value)


@pytest.mark.parametrize("name,cap,mode,want", [
    ("cuda", "sm_90", "compiled", (True, True)),      # x * (1 / scale) and the hardware e4m3fn cast
    ("cuda", "sm_80", "compiled", (True, False)),     # no fp8 conversion before sm_89
    ("rocm", "gfx942", "compiled", (False, False)),   # exact division and the integer encoder
    ("xpu", None, "compiled", (False, False)),
    ("cuda", None, "interpreter", (False, False)),
], ids=["cuda-sm_90", "cuda-sm_80", "rocm-gfx942", "xpu", "cuda-interpreter"])
def test_store_launch_table(name, cap, mode, want):
    import dataclasses

    from kernelgate import platform
    kc = pytest.importorskip("kernelgate.ops.indexer.indexer_k_cache_triton")
    plat = dataclasses.replace(platform.current(), name=name, capability=cap, triton=None, triton_mode=mode)
    cfg = kc.launch_config(plat, "e4m3fn")
    assert (cfg["fast_div"], cfg["hw_encode"]) == want
    assert kc.launch_config(plat, "e4m3fnuz")["hw_encode"] is False
