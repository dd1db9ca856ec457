"""Load a checkpoint: config.json + safetensors (one file, or shards with an index). The model
family comes from config.json's `model_type` (FAMILIES): Kimi Linear, or the Gated DeltaNet
hybrids Qwen3-Next / Qwen3.5-MoE (text part; the multimodal checkpoint's
`model.language_model.*` names are read as `model.*`). Checkpoint-only tensors a family does
not use (multi-token-prediction `mtp.*`, the vision tower `model.visual.*`) are skipped and
named once in a warning.

Kimi Linear's layouts:

Two layouts are read, by name:
  released (moonshotai; also HF `save_pretrained`'s default "original format"):
      self_attn.{q,k,v}_proj / {q,k,v}_conv1d [C, 1, W] / f_a_proj / f_b_proj / A_log [1,1,H,1] /
      dt_bias, block_sparse_moe.experts.<e>.w1|w2|w3, block_sparse_moe.gate, ...
  HF transformers internal (`save_pretrained(save_original_format=False)`):
      self_attn.conv1d [3C, 1, W], self_attn.forget_gate.*, mlp.experts.gate_up_proj [E, 2I, D], ...
Both are mapped onto this package's parameters (fused q|k|v, gate|up; A_log [H]; conv [3C, W]).
Anything missing, unexpected or mis-shaped is reported in one error.
FP8 checkpoints (e4m3 weights + scales; quantization_config) load as published, and
quantization="fp8" quantizes a bf16 one as it streams: models/quant.py, models/quant_load.py.
"""
from __future__ import annotations

import json
import os
import re
import sys
import warnings
from pathlib import Path

import torch

from ..errors import KernelgateError
from ..platform import default_device
from . import qwen3_next
from .config import KimiLinearConfig, config_json
from . import quant, quant_load
from .causal_lm import CausalLM, shared_recipes
from .kimi_linear import FP32_PARAMS, KimiLinearForCausalLM, build
from .parallel import SINGLE, Parallel, shard_specs
from .qwen3_next_config import Qwen3NextConfig
from .safetensors_file import SafetensorsFile, Stager, TensorInfo, read_into, read_slice_into

_RENAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp."),
            (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
            (re.compile(r"^model\.language_model\."), "model.")]
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.num_batches_tracked)$")
_EXTRAS = re.compile(r"^(mtp\.|model\.visual\.)")   # checkpoint-only: skipped, named once
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model")


def _normalise(key: str) -> str:
    for pat, rep in _RENAMES:
        key = pat.sub(rep, key)
    return key


class _Tensors:
    """In-memory tensors (e.g. an HF model's state_dict), names normalised like a checkpoint's."""

    def __init__(self, tensors: dict):
        self.where = {_normalise(k): v for k, v in tensors.items()}
        self.raw = {_normalise(k): k for k in tensors}

    def raw_name(self, name) -> str:
        return self.raw.get(name, name)

    def __contains__(self, name):
        return name in self.where

    def shape(self, name) -> tuple:
        return tuple(self.where[name].shape)

    def dtype(self, name) -> torch.dtype:
        return self.where[name].dtype

    def nbytes(self, name) -> int:
        t = self.where[name]
        return t.numel() * t.element_size()

    def copy(self, name, dest: torch.Tensor, stager) -> None:
        dest.copy_(self.where[name].reshape(dest.shape))

    def copy_slice(self, name, dest: torch.Tensor, dim: int, a: int, b: int, stager, lead=None) -> None:
        t = self.where[name] if lead is None else self.where[name][lead[0]:lead[1]]
        dest.copy_(t.narrow(dim, a, b - a).reshape(dest.shape))

    def close(self) -> None:
        pass


class _Checkpoint:
    """Tensor names (normalised) -> tensors across safetensors files, read on demand from the
    headers' offsets (safetensors_file.py): nothing is held in host memory between tensors."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = _index_files(index)
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise KernelgateError(f"load_model: no *.safetensors in {folder}")
        self.where, self._handles, self.raw = {}, {}, {}
        for fname in files:
            path = folder / fname
            if not path.exists():
                raise KernelgateError(f"load_model: shard {fname} listed in the index is missing from {folder}")
            f = SafetensorsFile(path)
            for key, info in f.tensors.items():
                self.where[_normalise(key)] = (f, info)
                self.raw[_normalise(key)] = key

    def raw_name(self, name) -> str:
        return self.raw.get(name, name)

    def __contains__(self, name):
        return name in self.where

    def shape(self, name) -> tuple:
        return self.where[name][1].shape

    def dtype(self, name) -> torch.dtype:
        return self.where[name][1].dtype

    def nbytes(self, name) -> int:
        return self.where[name][1].nbytes

    def copy(self, name, dest: torch.Tensor, stager) -> None:
        f, info = self.where[name]
        fh = self._handles.get(f.path)
        if fh is None:
            fh = self._handles[f.path] = open(f.path, "rb", buffering=0)
        read_into(f, info, dest, stager, fh)

    def copy_slice(self, name, dest: torch.Tensor, dim: int, a: int, b: int, stager, lead=None) -> None:
        """Rows a..b along `dim`; lead=(r0, r1): of rows r0..r1 along dim 0 only (dim > 0)."""
        f, info = self.where[name]
        if lead is not None:      # rows r0..r1 of dim 0 are one contiguous run of the file
            row = info.nbytes // max(1, info.shape[0])
            info = TensorInfo(info.name, info.dtype, (lead[1] - lead[0], *info.shape[1:]),
                              info.begin + lead[0] * row, info.begin + lead[1] * row)
        fh = self._handles.get(f.path)
        if fh is None:
            fh = self._handles[f.path] = open(f.path, "rb", buffering=0)
        read_slice_into(f, info, dest, dim, a, b, stager, fh)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()


def _index_files(index: Path) -> list:
    try:
        d = json.loads(index.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise KernelgateError(f"load_model: {index} is not JSON ({e})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise KernelgateError(f"load_model: {index} has no weight_map object (tensor name -> file name)")
    return sorted(set(wm.values()))


def _recipes(name: str, shape: tuple, c: KimiLinearConfig):
    """Ways to fill parameter `name` (of `shape`) from checkpoint tensors, first match wins:
    [[(source, destination slice of the parameter), ...], ...]; a slice is an index tuple."""
    if name.endswith("self_attn.qkv_proj.weight"):
        base, C = name[: -len("qkv_proj.weight")], shape[0] // 3
        return [[(name, ())],
                [(base + f"{x}_proj.weight", (slice(i * C, (i + 1) * C),)) for i, x in enumerate("qkv")]]
    if name.endswith("self_attn.conv1d.weight"):
        base, C = name[: -len("conv1d.weight")], shape[0] // 3
        return [[(name, ())],
                [(base + f"{x}_conv1d.weight", (slice(i * C, (i + 1) * C),)) for i, x in enumerate("qkv")]]
    return shared_recipes(name, shape, c, lambda e, w: f"{e}.{_KIMI_EXPERT[w]}.weight")


_KIMI_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}       # the released per-expert names


def _fits(src: tuple, dst: tuple) -> bool:
    """Same shape up to size-1 dims (conv [C, 1, W] -> [C, W], A_log [1, 1, H, 1] -> [H])."""
    return tuple(d for d in src if d != 1) == tuple(d for d in dst if d != 1)


class Family:
    """One model family: its config class, model builder and checkpoint-name recipes."""

    def __init__(self, name: str, config_cls, model_cls, build, recipes):
        self.name, self.config_cls, self.model_cls, self.build, self.recipes = \
            name, config_cls, model_cls, build, recipes


KIMI = Family("Kimi Linear", KimiLinearConfig, KimiLinearForCausalLM, build, _recipes)
QWEN = Family("Qwen3-Next / Qwen3.5-MoE", Qwen3NextConfig, qwen3_next.Qwen3NextForCausalLM, qwen3_next.build,
              qwen3_next.recipes)
FAMILIES = {"kimi_linear": KIMI, "qwen3_next": QWEN, "qwen3_5_moe": QWEN, "qwen3_5_moe_text": QWEN}


def family_of(model) -> Family:
    return next((f for f in (KIMI, QWEN) if isinstance(model, f.model_cls)), KIMI)


def read_config(folder) -> tuple:
    """config.json of a checkpoint folder -> (Family, config); the family from `model_type`
    (a config.json without one is read as Kimi Linear's)."""
    path, d = config_json(folder)
    kind = d.get("model_type", "kimi_linear") if isinstance(d, dict) else "kimi_linear"
    if kind not in FAMILIES:
        raise KernelgateError(f"load_model: model_type {kind!r} in {path} is not supported "
                              f"(supported: {', '.join(sorted(FAMILIES))})")
    fam = FAMILIES[kind]
    return fam, fam.config_cls.from_dict(d)


def _full_shape(p: torch.Tensor, spec, size: int) -> tuple:
    shape = list(p.shape)
    if spec is not None:
        shape[spec[0]] *= size
    return tuple(shape)


def _plan(model, ckpt, warn: bool = True) -> list:
    """Check every parameter against the checkpoint headers (nothing read yet) ->
    [(param, [(source, slice)])]; every mismatch is reported together in one error.
    Shapes and slices are those of the full (unsharded) parameter."""
    plan, used, missing, misshaped, wrong_dtype = [], set(), [], [], []
    specs, size = shard_specs(model), model.par.size
    scales = quant.fp8_tensors(model)[1]
    fam = family_of(model)
    for name, p in model.named_parameters():
        if name in scales:       # filled with their FP8 weights
            continue
        full = torch.empty(_full_shape(p, specs.get(name), size), device="meta")
        recipes = fam.recipes(name, tuple(full.shape), model.config)
        found = next((r for r in recipes if all(s in ckpt for s, *_ in r)), None)
        if found is None:
            # report against the layout the checkpoint is closest to; its present parts are not "unexpected"
            best = max(recipes, key=lambda r: sum(s in ckpt for s, *_ in r))
            absent = list(dict.fromkeys(s for s, *_ in best if s not in ckpt))
            used.update(s for s, *_ in best if s in ckpt)
            missing.append(name if [s for s, *_ in best] == [name] else f"{name} (needs {', '.join(absent[:8])}"
                           + (f" and {len(absent) - 8} more" if len(absent) > 8 else "") + ")")
            continue
        used.update(s for s, *_ in found)
        ok = True
        for src, idx, *rows in found:
            want = tuple(full[idx].shape) if idx else tuple(full.shape)
            have = ckpt.shape(src)
            if rows:       # rows (a, b) of the source's first dim
                (a, b), = rows
                have = (b - a,) + tuple(have[1:]) if have and 0 <= a < b <= have[0] else ()
            if not _fits(have, want):
                where = "model" if src == name else f"model slice {list(idx) if idx else ''}".rstrip()
                label = name if src == name else f"{name} <- {src}"
                misshaped.append(f"{label}: checkpoint {ckpt.shape(src)}{f' rows {rows[0]}' if rows else ''} "
                                 f"!= {where} {want}")
                ok = False
            elif not ckpt.dtype(src).is_floating_point:
                wrong_dtype.append(f"{src}: checkpoint {str(ckpt.dtype(src)).replace('torch.', '')} "
                                   f"for a floating point parameter")
                ok = False
            elif ckpt.dtype(src) == quant.FP8:    # its scale: present and of its shape (one line if not)
                used.add(quant_load.check_source(ckpt, getattr(ckpt, "fp8", None), src))
        if ok:
            plan.append((name, p, found))
    unexpected = sorted(n for n in ckpt.where if n not in used and not _IGNORED.search(n))
    extras = [n for n in unexpected if fam is QWEN and _EXTRAS.match(n)]
    if warn and extras and not missing and not misshaped and not wrong_dtype:
        groups = sorted({_EXTRAS.match(n).group(1) for n in extras})
        warnings.warn(f"kernelgate: load_model skips {len(extras)} checkpoint-only tensors the {fam.name} "
                      f"text model does not use ({', '.join(g + '*' for g in groups)})", stacklevel=3)
    unexpected = [n for n in unexpected if n not in extras]
    if missing or unexpected or misshaped or wrong_dtype:
        def lst(title, items):
            more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
            return f"\n  {title} ({len(items)}): " + "; ".join(items[:20]) + more if items else ""
        raise KernelgateError(f"load_model: checkpoint {getattr(ckpt, 'folder', 'tensors')} does not match the "
                              f"{fam.name} config" + lst("missing", missing) + lst("unexpected", unexpected)
                              + lst("mis-shaped", misshaped) + lst("wrong dtype", wrong_dtype))
    return plan


def _progress(total: int):
    """A rich progress bar over bytes on a terminal; (update(n), close())."""
    if not sys.stderr.isatty():
        return (lambda n: None), (lambda: None)
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:
        return (lambda n: None), (lambda: None)
    bar = Progress("[bold]loading weights", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), transient=True, console=Console(stderr=True))
    task = bar.add_task("bytes", total=total)
    bar.start()
    return (lambda n: bar.update(task, advance=n)), bar.stop


def _pieces(p, spec, par: Parallel, src_shape: tuple, idx: tuple) -> list:
    """What this rank reads of source tensor `src_shape`, destined for `full[idx]` of a parameter
    whose full form is split by `spec` (dim, segments): [(index of the destination in p, source dim,
    a, b)] (source dim None: the whole source tensor)."""
    if spec is None or par.size == 1:
        return [(tuple(idx), None, 0, 0)]
    d, segments = spec
    full = _full_shape(p, spec, par.size)
    idx = tuple(idx) + (slice(None),) * (len(full) - len(idx))
    if isinstance(idx[d], int):           # one expert of an expert-parallel tensor: ours or not
        lo = par.rank * p.shape[d]
        if not lo <= idx[d] < lo + p.shape[d]:
            return []
        return [(idx[:d] + (idx[d] - lo,) + idx[d + 1:], None, 0, 0)]
    a0, a1, _ = idx[d].indices(full[d])
    view = torch.empty(full, device="meta")[idx]
    vd = d - sum(isinstance(i, int) for i in idx[:d])       # the split dim inside full[idx]
    # size-1 dims differ between checkpoint and parameter ([C, 1, W] -> [C, W]): match the others
    k = [i for i, s in enumerate(view.shape) if s != 1].index(vd)
    sd = [i for i, s in enumerate(src_shape) if s != 1][k]
    out = []
    for g0, l0, n in par.part(full[d], segments):
        lo, hi = max(a0, g0), min(a1, g0 + n)
        if lo < hi:
            dst = idx[:d] + (slice(l0 + lo - g0, l0 + hi - g0),) + idx[d + 1:]
            out.append((dst, sd, lo - a0, hi - a0))
    return out


def _row_pieces(name: str, p, spec, par: Parallel, src_shape: tuple, idx: tuple, a: int, b: int) -> list:
    """_pieces for a recipe entry reading rows [a, b) of its source into `full[idx]` (a fused
    checkpoint tensor de-interleaved, e.g. Qwen3-Next's in_proj_qkvz): this rank's share of
    those rows, as (destination index, 0, first row, end row) of the source."""
    out = []
    for dst, sd, lo, hi in _pieces(p, spec, par, (b - a,) + tuple(src_shape[1:]), idx):
        if sd not in (None, 0):
            raise KernelgateError(f"load_model: {name} is split along dim {spec[0]}, which its checkpoint "
                                  f"rows recipe cannot slice")
        out.append((dst, 0, a, b) if sd is None else (dst, 0, a + lo, a + hi))
    return out


def load_weights(model: CausalLM, source) -> None:
    """Fill the model's parameters from a checkpoint folder, or a dict of tensors in either
    layout, one source tensor at a time straight into its parameter (or slice of one). A
    tensor-parallel shard (model.par) reads only its rows / columns of each tensor. The FP8
    parameters of a model built with quantization= are quantized from a bf16 / fp32 source as
    they fill (models/quant_load.py)."""
    ckpt = _open(source)
    try:
        _fill(model, ckpt)
    finally:
        ckpt.close()


def _open(source):
    """A checkpoint folder, a dict of tensors, or an object reading tensors as _Tensors does."""
    if hasattr(source, "copy_slice"):
        return source
    ckpt = _Tensors(source) if isinstance(source, dict) else _Checkpoint(Path(source))
    ckpt.folder = "tensors" if isinstance(source, dict) else source
    cfg = None if isinstance(source, dict) else Path(source) / "config.json"
    qc = json.loads(cfg.read_text()).get("quantization_config") if cfg is not None and cfg.exists() else None
    ckpt.fp8 = quant_load.read_config(qc, cfg)
    return ckpt


def _fill(model: CausalLM, ckpt) -> None:
    specs = shard_specs(model)
    plan = _plan(model, ckpt)
    fp8, fmt, checks = quant.fp8_params(model), getattr(ckpt, "fp8", None), []
    jobs = [(name, p, src, piece) for name, p, sources in plan for src, idx, *rows in sources
            for piece in (_row_pieces(name, p, specs.get(name), model.par, ckpt.shape(src), idx, *rows[0]) if rows
                          else _pieces(p, specs.get(name), model.par, ckpt.shape(src), idx))]
    nbytes = [ckpt.nbytes(src) * (1 if sd is None else (b - a) / ckpt.shape(src)[sd])
              for _, _, src, (_, sd, a, b) in jobs]
    update, close = _progress(int(sum(nbytes)))
    stager = Stager(model.device)
    try:
        for (name, p, src, (index, sd, a, b)), nb in zip(jobs, nbytes):
            dest = p[index]
            if name in fp8 or ckpt.dtype(src) == quant.FP8:     # quantized, dequantized, or codes + scales
                s, block = fp8.get(name, (None, None))
                scales = None if s is None else s[quant_load.scale_index(index, tuple(p.shape), block)]
                quant_load.fill(ckpt, fmt, src, dest, sd, a, b, stager, scales, block, checks)
            elif sd is None:
                ckpt.copy(src, dest, stager)
            else:
                ckpt.copy_slice(src, dest, sd, a, b, stager)
            update(int(nb))
        stager.finish()
    finally:
        close()
    quant_load.check_finite(checks, ckpt.folder)


def _fp8_in_checkpoint(model: CausalLM, ckpt) -> set:
    """Parameters of a (meta) model whose checkpoint tensors are all e4m3: a published FP8 one's."""
    specs, out = shard_specs(model), set()
    for name, p in model.named_parameters():
        recipes = family_of(model).recipes(name, _full_shape(p, specs.get(name), model.par.size), model.config)
        found = next((r for r in recipes if all(s in ckpt for s, *_ in r)), None)
        if found and all(ckpt.dtype(s) == quant.FP8 for s, *_ in found):
            out.add(name)
    return out


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_sizes(config, ckpt, par: Parallel = SINGLE, dtype=torch.float32, quantization=None):
    """The config against the checkpoint's tensor headers, before any parameter is allocated:
    its layer count first (from the tensor names: no model is built for a config of 100,000
    layers over a 4-layer checkpoint), then every parameter's shape on a model built on the
    meta device (no memory) -> the FP8 layout to build with: a published FP8 checkpoint's own
    (its e4m3 weights), else `quantization`'s (models/quant.py)."""
    layers = sorted({int(m.group(1)) for n in ckpt.where if (m := _LAYER.match(n))})
    if layers != list(range(config.num_hidden_layers)):
        held = f"layers {layers[0]}..{layers[-1]} ({len(layers)} of them)" if layers else "no layers"
        raise KernelgateError(f"load_model: config.json says num_hidden_layers {config.num_hidden_layers}; "
                              f"the checkpoint {ckpt.folder} holds {held}")
    # the sizes that multiply the work of matching names (a recipe per expert) come first
    want = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    for i, kind in enumerate(config.mlp_types):
        if kind == "moe":
            want[f"model.layers.{i}.mlp.gate.weight"] = (config.num_experts, config.hidden_size)
    bad = [f"{n}: checkpoint {ckpt.shape(n)} != config {s}" for n, s in want.items()
           if n in ckpt and not _fits(ckpt.shape(n), s)]
    if bad:
        raise KernelgateError(f"load_model: checkpoint {ckpt.folder} does not match config.json: " + "; ".join(bad[:4])
                              + (f" ... and {len(bad) - 4} more" if len(bad) > 4 else ""))
    fam = next(f for f in (KIMI, QWEN) if isinstance(config, f.config_cls))
    fp8 = quant.scheme(quantization, "load_model")
    if getattr(ckpt, "fp8", None) is not None:
        fmt = ckpt.fp8
        chosen = _fp8_in_checkpoint(fam.build(config, device="meta", dtype=dtype, seed=None, par=par), ckpt)
        fp8 = quant.Fp8(fmt.block, chosen.__contains__, sliced=True)
    _plan(fam.build(config, device="meta", dtype=dtype, seed=None, par=par, quantization=fp8), ckpt, warn=False)
    return fp8


def _dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or config.dtype or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise KernelgateError(f"load_model: dtype {name!r} is not a floating point torch dtype")
    return dt


def _device(device) -> torch.device:
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise KernelgateError(f"load_model: device {device!r} is not a torch device ({e})") from None
    mod = getattr(torch, dev.type, None)
    if dev.type not in ("cpu", "meta") and not (hasattr(mod, "is_available") and mod.is_available()):
        raise KernelgateError(f"load_model: device {device!r} is not available on this machine")
    return dev


def load_tokenizer(folder: Path):
    if not any((folder / f).exists() for f in _TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - text in/out is optional; token ids still work
        warnings.warn(f"kernelgate: tokenizer in {folder} not loaded ({type(e).__name__}: {e}); "
                      "use token ids", stacklevel=3)
        return None


def load_model(path, device=None, dtype=None, par: Parallel = SINGLE, quantization=None):
    """Load a checkpoint folder of a supported family (FAMILIES, by config.json's model_type).
    dtype: None = the checkpoint's (config "dtype").
    par: load only this rank's shard (kernelgate.models.parallel).
    quantization: "fp8" quantizes the projections and experts of a bf16 / fp32 Kimi Linear checkpoint
    to 128 x 128 block FP8 as they stream. An FP8 checkpoint (quantization_config) loads as published
    either way: its FP8 weights stay FP8, the rest in `dtype` (models/quant.py)."""
    quant.scheme(quantization, "load_model")
    if not isinstance(path, (str, os.PathLike)):
        raise KernelgateError(f"load_model: path must be a folder path (str or os.PathLike), got {type(path).__name__}")
    folder = Path(path)
    if not folder.is_dir():
        raise KernelgateError(f"load_model: {path} is not a folder")
    fam, config = read_config(folder)
    dt = _dtype(dtype, config)
    dev = _device(device)
    ckpt = _open(folder)
    try:
        fp8 = check_sizes(config, ckpt, par, dt, quantization)
        model = fam.build(config, device=dev, dtype=dt, seed=None, par=par, quantization=fp8)
        with torch.no_grad():
            _fill(model, ckpt)
    finally:
        ckpt.close()
    model.tokenizer = load_tokenizer(folder)
    return model


def save_checkpoint(model: CausalLM, folder) -> Path:
    """Write a (single-process) model as config.json + model.safetensors in this package's own
    parameter names, which load_model reads back (whole, or one shard per rank)."""
    from safetensors.torch import save_file
    if not hasattr(model.config, "to_checkpoint"):
        raise KernelgateError(f"save_checkpoint: writes Kimi Linear checkpoints only, not model_type "
                              f"{getattr(model.config, 'model_type', '?')!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_checkpoint()
    cfg["dtype"] = str(model.dtype).replace("torch.", "")
    if quant.checkpoint_config(model) is not None:      # FP8 weights: codes + scales, as a published checkpoint
        cfg["quantization_config"] = quant.checkpoint_config(model)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}, str(folder / "model.safetensors"))
    return folder


__all__ = ["load_model", "load_weights", "read_config", "save_checkpoint", "FAMILIES", "FP32_PARAMS"]
