"""FP8 in checkpoints: their quantization_config, their scale tensors, and the conversions the
loader makes while tensors stream (a slab of one tensor at a time on the device, never more):

    e4m3 codes + scales  -> FP8 parameter     codes copied, the scales of this part sliced
    bf16 / fp16 / fp32   -> FP8 parameter     quantized (load_model(quantization="fp8"))
    e4m3 codes + scales  -> parameter in the model dtype   dequantized (kept unquantized: models/quant.py)

Formats read (config.json `quantization_config`):
  quant_method "fp8" (DeepSeek-V3, Qwen FP8): `weight_block_size` [bn, bk], fmt e4m3, dynamic
      activations; scale `<weight>_scale_inv` fp32 [ceil(N/bn), ceil(K/bk)]; `modules_to_not_convert`.
  quant_method "compressed-tensors", format "float-quantized" (llm-compressor FP8_DYNAMIC / FP8_BLOCK):
      8-bit float weights of strategy "channel" (scale `<weight>_scale` [N, 1]) or "block"
      (`block_structure`), activations dynamic or none; `ignore` (names, "re:" regexes).
Which weights are FP8 is read from the tensors (e4m3, with their scale); a listed (ignored) module
stored as FP8 is an error, as is a missing, mis-shaped or non-finite scale (one line naming it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import KernelgateError
from ..ops.quant.fp8_weights import block_dims, scale_shape
from .quant import FP8, quantize, slab


@dataclass(frozen=True)
class Format:
    method: str                 # "fp8" | "compressed-tensors"
    block: tuple | None         # (bn, bk); None: per output channel
    suffix: str                 # a weight's scale tensor: its name + suffix
    ignore: tuple = ()

    def scale_of(self, src: str) -> str:
        return src + self.suffix

    def ignored_by(self, names) -> str | None:
        """The pattern of the ignore list that matches one of a module's `names`, if any."""
        for pat in self.ignore:
            for name in names:
                if self.method == "compressed-tensors":
                    hit = re.match(pat[3:], name) if pat.startswith("re:") else pat == name
                else:   # transformers' modules_to_not_convert: a prefix or regex up to a module boundary, or a suffix
                    hit = re.match(rf"(?:{pat})(?:(?<=\.)|(?=\.|$))", name) or name.endswith(pat)
                if hit:
                    return pat
        return None


def _bad(where, what) -> KernelgateError:
    return KernelgateError(f"load_model: {where}: quantization_config {what}")


def _block(where, key, v) -> tuple:
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(type(b) is int and b > 0 for b in v)):
        raise _bad(where, f"{key} must be two ints > 0, got {v!r}")
    return tuple(v)


def _names(where, key, v) -> tuple:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _bad(where, f"{key} must be a list of module names, got {v!r:.80}")
    return tuple(v)


def read_config(qc, where) -> Format | None:
    """config.json's quantization_config -> Format (None: none); unsupported ones are one-line errors."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise _bad(where, f"must be an object, got {qc!r:.80}")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _bad(where, f"fmt {qc.get('fmt')!r} is not supported (e4m3)")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise _bad(where, f"activation_scheme {qc.get('activation_scheme')!r} is not supported (dynamic: "
                              "activations are quantized per token group at run time)")
        if qc.get("weight_block_size") is None:
            raise _bad(where, "has no weight_block_size (per-tensor fp8 is not supported; block fp8 is)")
        return Format("fp8", _block(where, "weight_block_size", qc["weight_block_size"]), "_scale_inv",
                      _names(where, "modules_to_not_convert", qc.get("modules_to_not_convert")))
    if method == "compressed-tensors":
        if qc.get("format") != "float-quantized":
            raise _bad(where, f"format {qc.get('format')!r} is not supported (float-quantized: fp8)")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _bad(where, "has no config_groups")
        layouts = set()
        for gname, g in groups.items():
            w = g.get("weights") if isinstance(g, dict) else None
            if not isinstance(w, dict) or w.get("num_bits") != 8 or w.get("type") != "float" \
                    or w.get("dynamic") or not w.get("symmetric", True):
                raise _bad(where, f"group {gname}: weights must be static symmetric 8-bit float, got {w!r:.120}")
            if w.get("strategy") == "channel":
                layouts.add(None)
            elif w.get("strategy") == "block":
                layouts.add(_block(where, f"group {gname} block_structure", w.get("block_structure")))
            else:
                raise _bad(where, f"group {gname}: weight strategy {w.get('strategy')!r} is not supported "
                                  "(channel, block)")
            a = g.get("input_activations")
            if a is not None and not a.get("dynamic"):
                raise _bad(where, f"group {gname}: static input activation scales are not supported (dynamic: "
                                  "activations are quantized at run time)")
        if len(layouts) != 1:
            raise _bad(where, f"mixes weight layouts {sorted(map(str, layouts))} (one per checkpoint)")
        return Format("compressed-tensors", layouts.pop(), "_scale", _names(where, "ignore", qc.get("ignore")))
    raise _bad(where, f"quant_method {method!r} is not supported (fp8, compressed-tensors)")


def check_source(ckpt, fmt: Format | None, src: str) -> str:
    """An e4m3 checkpoint tensor's scale: present, floating point, of its shape -> its name."""
    where = f"checkpoint {ckpt.folder}"
    if fmt is None:
        raise KernelgateError(f"load_model: {where}: {src} is float8_e4m3fn but config.json has no "
                              "quantization_config (its scale layout is unknown)")
    module = src[:-len(".weight")] if src.endswith(".weight") else src
    pat = fmt.ignored_by([module, ckpt.raw_name(src).removesuffix(".weight")])
    if pat is not None:
        raise KernelgateError(f"load_model: {where}: {src} is float8_e4m3fn but the quantization_config "
                              f"ignore list keeps {module} unquantized ({pat!r})")
    s = fmt.scale_of(src)
    if s not in ckpt:
        raise KernelgateError(f"load_model: {where}: {src} is float8_e4m3fn but its scale {s} is missing")
    want = scale_shape(ckpt.shape(src), fmt.block)
    layout = "per channel" if fmt.block is None else f"block {list(fmt.block)}"
    if tuple(ckpt.shape(s)) != want:
        raise KernelgateError(f"load_model: {where}: {s} shape {tuple(ckpt.shape(s))} != {want} "
                              f"({layout} scales of {src} {tuple(ckpt.shape(src))})")
    if not ckpt.dtype(s).is_floating_point or ckpt.dtype(s) == FP8:
        raise KernelgateError(f"load_model: {where}: {s} dtype {str(ckpt.dtype(s)).replace('torch.', '')} "
                              "is not a float32 / bfloat16 / float16 scale")
    return s


# -- the conversions -----------------------------------------------------------------------
def _bdim(i: int, nd: int, block, K: int) -> int:
    """Elements per scale along dim i of an [.., N, K] tensor."""
    bn, bk = block_dims(block, K)
    return bn if i == nd - 2 else bk if i == nd - 1 else 1


def scale_index(index: tuple, shape: tuple, block) -> tuple:
    """Index into a weight of `shape` -> the same part of its scales (parts start on blocks: quant.convert)."""
    nd = len(shape)
    index = tuple(index) + (slice(None),) * (nd - len(index))
    out = []
    for i, ix in enumerate(index):
        if isinstance(ix, int):
            out.append(ix)
            continue
        a, b, _ = ix.indices(shape[i])
        bs = _bdim(i, nd, block, shape[-1])
        if a % bs or (b % bs and b != shape[i]):
            raise KernelgateError(f"load_model: internal: part {a}:{b} of dim {i} of a {shape} FP8 weight is not "
                                  f"on {bs}-element scale blocks")
        out.append(slice(a // bs, -(-b // bs)))
    return tuple(out)


def _read(ckpt, name: str, dest: torch.Tensor, ranges: list, stager) -> None:
    """dest <- the box `ranges` [(a, b) per dim] of checkpoint tensor `name` (dim 0 and one other restricted)."""
    full = ckpt.shape(name)
    cut = [i for i, (a, b) in enumerate(ranges) if (a, b) != (0, full[i])]
    if not cut:
        ckpt.copy(name, dest, stager)
    elif len(cut) == 1:
        ckpt.copy_slice(name, dest, cut[0], *ranges[cut[0]], stager)
    elif len(cut) == 2 and cut[0] == 0:
        ckpt.copy_slice(name, dest, cut[1], *ranges[cut[1]], stager, lead=ranges[0])
    else:
        raise KernelgateError(f"load_model: internal: cannot read {name}{ranges}")


def _source_ranges(src_shape: tuple, sd, a: int, b: int, lo: int, hi: int) -> list:
    """Rows lo..hi (dim 0) of the part (sd, a, b) of a source tensor: its box [(a, b) per dim]."""
    r = [(0, n) for n in src_shape]
    if sd is not None:
        r[sd] = (a, b)
    r[0] = (r[0][0] + lo, r[0][0] + hi)
    return r


def _scales(ckpt, fmt: Format, src: str, box: list, device, stager) -> tuple[torch.Tensor, list]:
    """The scales covering box `box` of e4m3 tensor `src` (fp32) and the elements per scale of each dim."""
    shape = ckpt.shape(src)
    per = [_bdim(i, len(shape), fmt.block, shape[-1]) for i in range(len(shape))]
    sbox = [(x // bs, (y - 1) // bs + 1) for (x, y), bs in zip(box, per)]
    sc = torch.empty([y - x for x, y in sbox], dtype=torch.float32, device=device)
    _read(ckpt, fmt.scale_of(src), sc, sbox, stager)
    return sc, per


def fill(ckpt, fmt: Format | None, src: str, dest: torch.Tensor, sd, a: int, b: int, stager,
         scales: torch.Tensor | None, block, checks: list) -> None:
    """Part (sd, a, b) of checkpoint tensor `src` into `dest`, with its scales `scales` where dest is FP8
    (block: the model's layout); scales to check for finite values are added to `checks`."""
    shape = ckpt.shape(src)
    if len(shape) != dest.dim():
        raise KernelgateError(f"load_model: {src}: an FP8 conversion needs the checkpoint's shape {shape} "
                              f"to match the parameter's part {tuple(dest.shape)}")
    src_fp8 = ckpt.dtype(src) == FP8
    if src_fp8 and scales is not None:              # published codes: copied; their scales sliced
        if fmt.block != block:
            raise KernelgateError(f"load_model: {src}: checkpoint FP8 layout {fmt.block} != the model's {block}")
        box = _source_ranges(shape, sd, a, b, 0, dest.shape[0])
        _read(ckpt, src, dest, box, stager)
        sc, _ = _scales(ckpt, fmt, src, box, dest.device, stager)
        if sc.shape != scales.shape:
            raise KernelgateError(f"load_model: internal: scales of {src}{box} {tuple(sc.shape)} != "
                                  f"{tuple(scales.shape)}")
        scales.copy_(sc)
        checks.append((fmt.scale_of(src), scales))
        return
    step = slab(tuple(dest.shape), fmt.block if src_fp8 else block)
    for lo in range(0, dest.shape[0], step):
        hi = min(dest.shape[0], lo + step)
        box = _source_ranges(shape, sd, a, b, lo, hi)
        part = torch.empty((hi - lo, *dest.shape[1:]), dtype=ckpt.dtype(src), device=dest.device)
        _read(ckpt, src, part, box, stager)
        if src_fp8:                                 # dequantized into a model-dtype parameter
            sc, per = _scales(ckpt, fmt, src, box, dest.device, stager)
            checks.append((fmt.scale_of(src), sc))
            for i, ((x, _), bs) in enumerate(zip(box, per)):   # from the part's offset inside its first block
                sc = sc.repeat_interleave(bs, dim=i).narrow(i, x % bs, part.shape[i])
            dest[lo:hi].copy_(part.float() * sc)
        else:                                       # quantized on load
            q, sc = quantize(part, block)
            dest[lo:hi].copy_(q)
            r = lo // block_dims(block, shape[-1])[0] if dest.dim() == 2 else lo
            scales[r:r + sc.shape[0]].copy_(sc)
            checks.append((f"{src} (quantized on load)", sc))


def check_finite(checks: list, where) -> None:
    """One device sync for all scales read or made: the first non-finite one is named."""
    if not checks:
        return
    ok = torch.stack([torch.isfinite(t).all() for _, t in checks]).tolist()
    for (name, t), good in zip(checks, ok):
        if not good:
            bad = ~torch.isfinite(t)
            i = tuple(int(v) for v in bad.nonzero()[0])
            raise KernelgateError(f"load_model: checkpoint {where}: scale {name}{list(i)} = {float(t[i])} is not "
                                  f"finite ({int(bad.sum())} of {t.numel()})")
