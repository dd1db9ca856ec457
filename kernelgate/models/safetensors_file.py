"""Read tensors out of a .safetensors file one at a time, straight into their destination.

The format: 8 bytes (little-endian u64) header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
data (offsets relative to byte 8 + N). The header is checked against the file size when the
file is opened, so a truncated or corrupt file is one clear error before anything is read.

Data is read with plain file reads (no mmap: a mapped file's touched pages count in the
process's resident memory until it is closed) through two small staging buffers (pinned
where the device is an accelerator), and copied into the destination tensor chunk by chunk,
casting on the way; host memory stays at the staging size whatever the checkpoint size.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch

from ..errors import KernelgateError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
STAGE_BYTES = 64 << 20
MAX_HEADER = 100 << 20
bytes_read = [0]          # bytes this process has read from checkpoint data (tests count shard reads)


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    def __init__(self, path):
        self.path = str(path)
        size = os.path.getsize(self.path)
        where = f"load_model: {self.path}"
        if size < 8:
            raise KernelgateError(f"{where}: truncated safetensors file ({size} bytes, no header)")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(size - 8, MAX_HEADER):
                raise KernelgateError(f"{where}: corrupt or truncated safetensors header "
                                      f"(header length {n} > {size - 8} bytes after it)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, ValueError) as e:
                raise KernelgateError(f"{where}: corrupt safetensors header (not JSON: {e})") from None
        if not isinstance(header, dict):
            raise KernelgateError(f"{where}: corrupt safetensors header (not a JSON object)")
        self.data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, d in header.items():
            if name == "__metadata__":
                continue
            self.tensors[name] = self._info(where, name, d, size - self.data_start)

    @staticmethod
    def _info(where, name, d, data_size) -> TensorInfo:
        try:
            dtype, shape, (begin, end) = DTYPES.get(d["dtype"]), list(d["shape"]), d["data_offsets"]
            ok = dtype is not None and all(type(s) is int and s >= 0 for s in shape) \
                and type(begin) is int and type(end) is int and 0 <= begin <= end
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise KernelgateError(f"{where}: corrupt safetensors header entry for {name!r}: {d!r:.200}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise KernelgateError(f"{where}: corrupt safetensors header: {name} {d['dtype']}{shape} "
                                  f"needs {math.prod(shape) * dtype.itemsize} bytes, offsets give {end - begin}")
        if end > data_size:
            raise KernelgateError(f"{where}: truncated safetensors file: {name} ends at data byte {end}, "
                                  f"the file holds {data_size}")
        return TensorInfo(name, dtype, tuple(shape), begin, end)


class Stager:
    """Two staging buffers for host -> device copies; a buffer is reused only after the copy
    that read it has finished (an event per buffer)."""

    def __init__(self, device, nbytes: int = STAGE_BYTES):
        self.device = torch.device(device)
        self.accel = self.device.type != "cpu"
        pin = self.accel and self.device.type in ("cuda", "xpu")
        self.bufs = [torch.empty(nbytes if self.accel else 0, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self.events = [None, None]
        self.i = 0
        self.nbytes = nbytes

    def take(self) -> torch.Tensor:
        self.i ^= 1
        if self.events[self.i] is not None:
            self.events[self.i].synchronize()
            self.events[self.i] = None
        return self.bufs[self.i]

    def issued(self) -> None:
        if self.accel:
            ev = torch.Event(device=self.device)
            ev.record()
            self.events[self.i] = ev

    def finish(self) -> None:
        for ev in self.events:
            if ev is not None:
                ev.synchronize()
        self.events = [None, None]


def _readinto(f, view: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(f.fileno(), [view[got:]], offset + got) if hasattr(os, "preadv") else None
        if n is None:
            f.seek(offset + got)
            n = f.readinto(view[got:])
        if not n:
            raise KernelgateError(f"load_model: {path}: file ended while reading (truncated)")
        got += n
    bytes_read[0] += got


def read_into(file: SafetensorsFile, info: TensorInfo, dest: torch.Tensor, stager: Stager, fh) -> None:
    """Copy tensor `info` of `file` into `dest` (same number of elements, any float dtype)."""
    if not dest.is_contiguous():
        raise KernelgateError(f"load_model: internal: destination of {info.name} is not contiguous")
    flat = dest.view(-1)
    start = file.data_start + info.begin
    if not stager.accel and dest.dtype == info.dtype:     # host model: read straight into the weight
        _readinto(fh, memoryview(flat.view(torch.uint8).numpy()), start, file.path)
        return
    step = max(1, stager.nbytes // info.dtype.itemsize) if stager.accel else max(1, STAGE_BYTES // info.dtype.itemsize)
    for a in range(0, flat.numel(), step):
        b = min(a + step, flat.numel())
        nb = (b - a) * info.dtype.itemsize
        if stager.accel:
            buf = stager.take()[:nb]
        else:
            buf = torch.empty(nb, dtype=torch.uint8)
        _readinto(fh, memoryview(buf.numpy()), start + a * info.dtype.itemsize, file.path)
        flat[a:b].copy_(buf.view(info.dtype), non_blocking=stager.accel)
        stager.issued()


def read_slice_into(file: SafetensorsFile, info: TensorInfo, dest: torch.Tensor, dim: int, a: int, b: int,
                    stager: Stager, fh) -> None:
    """Copy `info[..., a:b, ...]` (rows a..b-1 along `dim`) into `dest` (contiguous, same number of
    elements) reading only those bytes: one read per run of contiguous bytes, staged in groups."""
    if not dest.is_contiguous():          # e.g. one of gate|up across all experts: via a temporary
        tmp = torch.empty(dest.shape, dtype=dest.dtype, device=dest.device)
        read_slice_into(file, info, tmp, dim, a, b, stager, fh)
        stager.finish()
        dest.copy_(tmp)
        return
    shape, item = info.shape, info.dtype.itemsize
    outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
    piece = (b - a) * inner                                          # elements per outer index
    rows = dest.view(outer, piece)
    base = file.data_start + info.begin
    per = max(1, STAGE_BYTES // max(1, piece * item))                # outer indices per staged group
    for o0 in range(0, outer, per):
        o1 = min(outer, o0 + per)
        nb = (o1 - o0) * piece * item
        buf = stager.take()[:nb] if stager.accel and nb <= stager.nbytes else torch.empty(nb, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        for o in range(o0, o1):
            off = (o - o0) * piece * item
            _readinto(fh, view[off:off + piece * item], base + (o * shape[dim] + a) * inner * item, file.path)
        rows[o0:o1].copy_(buf.view(info.dtype).view(o1 - o0, piece), non_blocking=stager.accel)
        stager.issued()
