"""The indexer q kernels beyond their parity cases: launch options of the token-major (triton_tok)
and row-major (triton) kernels against the op's native reference, the 128-point Hadamard of both
against a hand-built one-hot case (the Sylvester column, known exactly), and each kernel's launch
table (launch_config) on simulated platforms, plus which implementation dispatch picks there.

Runs the Triton kernels on CPU under TRITON_INTERPRET=1 (fp32 dots, integer fp8 encoder), so each
form's index arithmetic (quarters, RoPE pairs, head blocks) is checked here; the GPU-only choices
(bf16 MMAs, hardware cvt, register caps) are checked by bench/ops/indexer_sweep.py before timing."""
import dataclasses
import math

import pytest
import torch

from kernelgate import alloc, platform, registry
from kernelgate.ops.common import fp8 as _fp8
from kernelgate.ops.indexer.indexer_q import OP, _case, compare, indexer_q_native, precompute_freqs_cis

rows = pytest.importorskip("kernelgate.ops.indexer.indexer_q_triton")
import kernelgate.ops.indexer.indexer_q_tok_triton as tok  # noqa: E402

pytestmark = pytest.mark.skipif(not platform.interpreting(), reason="CPU tensors: needs TRITON_INTERPRET=1")

FORMS = {   # id -> (kernel module, launch overrides)
    "tok1": (tok, dict(tok=1)),                                 # the GPU choice: freqs as a [1, n] vector
    "tok2-w2": (tok, dict(tok=2, num_warps=2)),                 # two tokens per program: freqs broadcast
    "rows-R32": (rows, dict(block_r=32)),
    "rows-R64": (rows, dict(block_r=64)),
}
CASES = [   # (tokens, heads, variant, fp8 format, hadamard)
    (3, 64, "v4", "e4m3fn", None),
    (5, 3, "v4", "e4m3fnuz", None),
    (1, 5, "v4", "e4m3fn", False),
    (7, 5, "v32", "e4m3fn", None),
    (3, 6, "v32", "e4m3fnuz", True),
    (2, 130, "v32", "e4m3fn", True),                            # > 128 heads: two head blocks per token
]


def _cid(c):
    return f"B{c[0]}-H{c[1]}-{c[2]}-{c[3]}" + ("" if c[4] is None else f"-hadamard{c[4]}")


# > 128 heads only where head blocks differ (the token-major grid); the row-major grid is flat
PAIRS = [pytest.param(f, c, id=f"{f}-{_cid(c)}") for f in FORMS for c in CASES if c[1] <= 128 or f != "rows-R32"]


@pytest.mark.parametrize("form,case", PAIRS)
def test_form_matches_native(form, case):
    mod, cfg = FORMS[form]
    B, H, variant, fmt, had = case
    args, kw = _case(B, H, variant, fmt, had).make("cpu", torch.bfloat16, torch.Generator().manual_seed(B * H))
    ref = indexer_q_native(*args, **kw)
    with alloc.poisoned():
        out = mod.launch(*args, **kw, **cfg)
    assert out[0].dtype == ref[0].dtype and out[0].shape == ref[0].shape
    compare(out, ref, torch.bfloat16, args)
    # fp32 arithmetic throughout and an exact encoder: nearly every code identical
    assert (_fp8.code_distance(out[0], ref[0]) == 0).float().mean() > 0.99


@pytest.mark.parametrize("form", ["tok1", "rows-R32"])
@pytest.mark.parametrize("j", [3, 77, 126])
def test_hadamard_one_hot(form, j):
    # position 0: RoPE is the identity; H e_j / sqrt(128) = (-1)^popcount(i & j) / sqrt(128) for
    # every i, so every code is +-448 with the sign pattern of column j
    mod, cfg = FORMS[form]
    q = torch.zeros(2, 5, 128)
    q[:, :, j] = 2.0
    q_fp8, w_out = mod.launch(q, torch.ones(2, 5), 1.0, precompute_freqs_cis(4), torch.zeros(2, dtype=torch.int32),
                              variant="v4", **cfg)
    signs = torch.tensor([(-1.0) ** bin(i & j).count("1") for i in range(128)])
    assert torch.equal(q_fp8.float(), (448.0 * signs).expand(2, 5, 128))
    torch.testing.assert_close(w_out, torch.full((2, 5, 1), 2.0 / (math.sqrt(128) * 448.0)), rtol=1e-6, atol=0)


# -- launch tables on simulated platforms --------------------------------------------------
PLATFORMS = {   # id -> (name, capability, Triton mode)
    "cuda-sm_90": ("cuda", "sm_90", "compiled"),
    "cuda-sm_80": ("cuda", "sm_80", "compiled"),
    "rocm-gfx942": ("rocm", "gfx942", "compiled"),
    "rocm-gfx90a": ("rocm", "gfx90a", "compiled"),
    "xpu": ("xpu", None, "compiled"),
    "cuda-interpreter": ("cuda", None, "interpreter"),
}


def plat(pid):
    name, cap, mode = PLATFORMS[pid]
    return dataclasses.replace(platform.current(), name=name, capability=cap, triton=None, triton_mode=mode)


# (hardware e4m3fn cast for e4m3fn / e4m3fnuz, maxnreg v4 / v32)
TOK_TABLE = {
    "cuda-sm_90": ((True, False), (80, None)),
    "cuda-sm_80": ((False, False), (80, None)),      # no fp8 conversion before sm_89
    "rocm-gfx942": ((False, False), (None, None)),   # not NVIDIA: integer encoder, no register cap
    "rocm-gfx90a": ((False, False), (None, None)),
    "xpu": ((False, False), (None, None)),
    "cuda-interpreter": ((False, False), (None, None)),
}
ROWS_TABLE = {   # (fp32 dots for the bf16 parts, rows per program: None = autotuned)
    "cuda-sm_90": (False, None), "cuda-sm_80": (False, None), "rocm-gfx942": (True, None),
    "rocm-gfx90a": (True, None), "xpu": (True, None), "cuda-interpreter": (True, 64),
}


@pytest.mark.parametrize("pid", list(PLATFORMS))
def test_launch_tables(pid):
    p = plat(pid)
    (hw_fn, hw_fnuz), (reg_v4, reg_v32) = TOK_TABLE[pid]
    assert tok.launch_config(p, "v4", "e4m3fn")["hw_encode"] is hw_fn
    assert tok.launch_config(p, "v4", "e4m3fnuz")["hw_encode"] is hw_fnuz
    assert tok.launch_config(p, "v4")["maxnreg"] == reg_v4
    assert tok.launch_config(p, "v32")["maxnreg"] == reg_v32
    assert tok.launch_config(p)["tok"] == (None if pid == "cuda-interpreter" else 1)   # None: ~1024 rows
    cfg = rows.launch_config(p)
    assert (cfg["dot_f32"], cfg["block_r"]) == ROWS_TABLE[pid]


@pytest.mark.parametrize("name,want", [("cuda", "triton_tok"), ("rocm", "triton"), ("xpu", "triton")])
def test_dispatch_picks_and_runs(name, want):
    # KERNELGATE_PLATFORM=<name> takes that platform's choice; the chosen kernel runs (interpreted)
    op = registry.get(OP)
    args, kw = _case(9, 5).make("cpu", torch.bfloat16, torch.Generator().manual_seed(3))
    with platform.simulate(name):
        chosen = [impl.name for impl, why in op.explain(args, kw) if why is None]
        out = op(*args, **kw)
    assert chosen[0] == want
    compare(out, indexer_q_native(*args, **kw), torch.bfloat16, args)
