"""paged_cache_write against hand-placed rows (untouched rows stay as they were), with padding
tokens, a value row that is a slice of a wider projection, one cache or two; the argument checks;
and the device kernel skipping a slot past the cache (it cannot raise) without writing out of
bounds. Every test runs each implementation that can run here (Triton under TRITON_INTERPRET=1)."""
import re

import pytest
import torch

from kernelgate import KernelgateError, forcing, platform, registry

OP = "paged_cache_write"
DEV = platform.default_device()   # GPU tensors on a GPU machine; CPU (Triton interpreted) here


def _impls():
    return [pytest.param(name, id=name) for name in registry.get(OP).impls]


def route(impl, *args, **kwargs):
    op = registry.get(OP)
    why = op.impls[impl].unavailable(platform.current())
    if why:
        pytest.skip(why)
    with forcing({OP: impl}):
        return op(*args, **kwargs)


@pytest.mark.parametrize("impl", _impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_land_at_their_slots(impl, dtype):
    # 2 blocks of 4 rows, 2 heads of 3: tokens to rows 6 (block 1, offset 2), 1, padding, 4
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(2, 4, 2, 3, generator=g).to(dtype)
    vc = torch.randn(2, 4, 2, 3, generator=g).to(dtype)
    k = torch.randn(4, 2, 3, generator=g).to(dtype)
    wide = torch.randn(4, 18, generator=g).to(dtype)              # [q | k | v] of a fused projection
    v = wide[:, 12:]                                              # [4, 6], row stride 18
    slots = torch.tensor([6, 1, -1, 4], dtype=torch.int32)
    ek, ev = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            ek[s // 4, s % 4] = k[t]
            ev[s // 4, s % 4] = v[t].view(2, 3)
    kc, vc = kc.to(DEV), vc.to(DEV)
    assert route(impl, slots.to(DEV), k.to(DEV), kc, v.to(DEV), vc) is None
    assert torch.equal(kc.cpu(), ek) and torch.equal(vc.cpu(), ev)


@pytest.mark.parametrize("impl", _impls())
def test_one_cache_and_no_tokens(impl):
    kc = torch.zeros(3, 2, 5)
    k = torch.arange(10.0).view(2, 5)
    route(impl, torch.tensor([5, 0], device=DEV), k.to(DEV), kc := kc.to(DEV))   # int64 slots
    want = torch.zeros(3, 2, 5)
    want[2, 1], want[0, 0] = k[0], k[1]
    assert torch.equal(kc.cpu(), want)
    route(impl, torch.zeros(0, dtype=torch.int32, device=DEV), torch.zeros(0, 5, device=DEV), kc)
    assert torch.equal(kc.cpu(), want)


@pytest.mark.parametrize("impl", _impls())
def test_two_column_ranges_of_one_cache(impl):
    """MLA's latent: the normed part and the rope key into the two column ranges of one cache, in one
    call -- the rows torch.cat then one write would give, every other value as it was."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 4, 7, generator=g)
    c, proj = torch.randn(3, 5, generator=g), torch.randn(3, 9, generator=g)
    k_r = proj[:, 7:]                                             # [3, 2], row stride 9
    slots = torch.tensor([5, -1, 0], dtype=torch.int32)
    want = cache.clone()
    want[1, 1], want[0, 0] = torch.cat([c[0], k_r[0]]), torch.cat([c[2], k_r[2]])
    cache = cache.to(DEV)
    route(impl, slots.to(DEV), c.to(DEV), cache[..., :5], k_r.to(DEV), cache[..., 5:])
    assert torch.equal(cache.cpu(), want)


def test_device_kernel_skips_a_slot_past_the_cache():
    # the kernel cannot raise (no host sync in a captured graph): a slot past the cache writes
    # nothing -- and nothing outside the cache, which is a view of a larger buffer here
    pytest.importorskip("triton")
    if not platform.interpreting() and platform.current().device == "cpu":
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from kernelgate.ops.cache.paged_cache_write_triton import paged_cache_write_triton
    buf = torch.zeros(3, 2, 4, device=DEV)
    cache = buf[:2]                                               # rows 0..3; rows 4, 5 lie past it
    k = torch.ones(2, 4, device=DEV)
    paged_cache_write_triton(torch.tensor([4, 3], dtype=torch.int32, device=DEV), k, cache)
    assert torch.equal(buf[1, 1].cpu(), torch.ones(4))           # slot 3 written
    assert int((buf != 0).sum()) == 4                            # slot 4 (buf[2, 0]) not


def _args():
    return [torch.tensor([0, 3], dtype=torch.int32), torch.randn(2, 2, 4), torch.randn(3, 2, 2, 4),
            torch.randn(2, 8), torch.randn(3, 2, 2, 4)]


BAD = {
    "v-without-cache": (lambda a: a.__setitem__(4, None), "v and v_cache go together"),
    "slots-dtype": (lambda a: a.__setitem__(0, a[0].float()), "slot_mapping dtype float32"),
    "slots-rows": (lambda a: a.__setitem__(0, torch.tensor([0], dtype=torch.int32)), "slot_mapping shape (1,)"),
    "cache-dtype": (lambda a: a.__setitem__(2, a[2].double()), "k_cache dtype float64"),
    "row-size": (lambda a: a.__setitem__(3, torch.randn(2, 6)), "v shape (2, 6): 6 values a token != 8 a row"),
    "cache-2d": (lambda a: a.__setitem__(2, torch.randn(6, 8)), "k_cache must have 3 or more dims"),
    "cache-rows-strided": (lambda a: a.__setitem__(2, torch.randn(3, 2, 4, 2).transpose(2, 3)),
                           "k_cache rows (dims after the first two) must be contiguous"),
    "cache-rows-overlap": (lambda a: a.__setitem__(2, torch.randn(40).as_strided((3, 2, 2, 4), (8, 4, 4, 1))),
                           "k_cache rows (dims after the first two) must be contiguous and apart"),
    "slot-past-cache": (lambda a: a[0].__setitem__(1, 6), "slot_mapping[1] = 6 outside [0, 6)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise(case):
    args = _args()
    BAD[case][0](args)
    with pytest.raises(KernelgateError, match=f"^{OP}: .*{re.escape(BAD[case][1])}"):
        registry.get(OP)(*args)
