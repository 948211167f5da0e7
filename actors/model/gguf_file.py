"""A lean GGUF reader: metadata and memory-mapped tensor data, without decoding the vocabulary.

gguf.GGUFReader decodes every vocabulary string and merge into Python objects (seconds for a
50k vocabulary); the weights need none of them, so large string arrays are skipped and only
counted here. Dequantization itself is left to `gguf.quants.dequantize`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEPT_STRINGS = 1024   # string arrays longer than this (vocabularies, merges) are only counted


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]     # numpy order (rows first), as GGUFReader reports the logical shape reversed
    qtype: int
    offset: int                # absolute byte offset in the file


class SkippedStrings:
    """Stands in for a long string array that was not decoded; only its length is known."""

    def __init__(self, count: int) -> None:
        self.count = count

    def __len__(self) -> int:
        return self.count


class GGUFFile:
    def __init__(self, path: str) -> None:
        self.path = path
        # A plain ndarray view of the map: np.memmap slices pay a Python hook on every view.
        self._mm = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))
        self._buf = memoryview(self._mm)
        self._pos = 0
        magic, version = struct.unpack_from("<4sI", self._buf, 0)
        if magic != b"GGUF":
            raise ValueError(f"not a GGUF file (bad magic {magic!r})")
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        self._pos = 8
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.metadata[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors = {name: GGUFTensorInfo(name, shape, qtype, data_start + off)
                        for name, shape, qtype, off in infos}

    def nbytes(self, name: str) -> int:
        """The tensor's stored size in bytes."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.qtype)]
        rows, cols = info.shape[:-1], info.shape[-1]
        if cols % block:
            raise ValueError(f"GGUF tensor {name}: row of {cols} is not a multiple of the block size {block}")
        return int(np.prod(rows, dtype=np.int64)) * (cols // block * type_size)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored data in the layout gguf.quants.dequantize expects."""
        from gguf.constants import GGMLQuantizationType

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.qtype)
        data = self._mm[info.offset:info.offset + self.nbytes(name)]
        if qtype == GGMLQuantizationType.F32:
            return data.view(np.float32).reshape(info.shape)
        if qtype == GGMLQuantizationType.F16:
            return data.view(np.float16).reshape(info.shape)
        return data.reshape(*info.shape[:-1], -1)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8", errors="replace")
        self._pos += n
        return s

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype == _STRING:
                if count > _MAX_KEPT_STRINGS:
                    for _ in range(count):  # skip without decoding
                        (n,) = struct.unpack_from("<Q", self._buf, self._pos)
                        self._pos += 8 + n
                    return SkippedStrings(count)
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            fmt = _SCALARS[etype]
            size = struct.calcsize(fmt)
            arr = np.frombuffer(self._buf, dtype=np.dtype(fmt), count=count, offset=self._pos)
            self._pos += size * count
            return arr.tolist()
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {vtype}")
        return self._unpack(fmt)[0]
