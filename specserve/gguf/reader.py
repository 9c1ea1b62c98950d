"""Open a GGUF file through the `gguf` package, with clear errors for bad files.

Tensors stay memory-mapped until `load_tensor` dequantizes one to torch (or, with mmap=False, are read
into memory when the file is opened).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from specserve.errors import SpecserveError
from specserve.gguf.repack import REPACKABLE, QuantInts, dequantize_blocks, repack

GGUF_MAGIC = b"GGUF"

# Float types, and the block formats that can also stay quantized (tested against gguf's decoder).
SUPPORTED_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16} | REPACKABLE


def _field_value(field: Any) -> Any:
    """Plain Python value of a metadata field (str, int, float, bool or list of those).

    Not gguf's `ReaderField.contents()`: that decodes strings strictly, and some vocabularies hold
    token strings that are not valid UTF-8; here they decode with replacement characters."""
    types = field.types
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        if types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if types[0] == GGUFValueType.BOOL else value


class _Reader(GGUFReader):
    """gguf's reader, reading its fields through a plain ndarray view of the mapped file instead of the
    numpy.memmap itself: every field part is a slice, and a memmap slice costs several times more (smollm2's
    49k tokens and merges: 1.8 s to parse, 0.5 s so). The same slicing as gguf 0.19's `_get`."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


class ModelFile(Protocol):
    """What the tokenizer and the chat template read of a model's file: a GGUFFile, or what a remote runner
    knows of the host's, or the HTTP front of the engine core's (MetadataFile)."""

    @property
    def path(self) -> Path: ...

    @property
    def metadata(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class MetadataFile:
    """A model file's path and metadata without its tensors, e.g. a remote host's file, or the engine core's
    file as its front sees it."""

    path: Path
    metadata: dict[str, Any]


class GGUFFile:
    """Metadata as a dict and lazily dequantized tensors of one GGUF file."""

    def __init__(self, path: str | Path, mmap: bool = True):
        """mmap=False: every tensor's bytes are read into process memory now (one pass over the file), so
        loading never pages the file in later (llama-server's --no-mmap)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise SpecserveError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise SpecserveError(f"{self.path} is not a GGUF file (bad magic {magic!r})")
        try:
            self._reader = _Reader(self.path, "r")
        except Exception as exc:  # the gguf package raises assorted errors on damage
            raise SpecserveError(f"{self.path} is a damaged or truncated GGUF file: {exc}") from None
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            try:
                self.metadata[key] = _field_value(field)
            except Exception as exc:
                raise SpecserveError(f"{self.path}: cannot read metadata key {key}: {exc}") from None
        self._tensors = {t.name: t for t in self._reader.tensors}
        file_size = self.path.stat().st_size
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > file_size:
                raise SpecserveError(f"{self.path} is truncated: tensor {t.name} runs past the end of the file")
        if not mmap:
            self._tensors = {name: t._replace(data=np.array(t.data)) for name, t in self._tensors.items()}

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape in torch order (GGUF lists dimensions fastest-first; we reverse them)."""
        return tuple(int(d) for d in reversed(self._tensor(name).shape))

    def load_tensor(self, name: str, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Dequantize one tensor to `dtype` on `device`, in torch dimension order. rows = (start, stop): only
        those rows of the first dimension, read and decoded alone (a row is whole blocks in every format), so
        a tensor-parallel rank never decodes the rows of the others."""
        t = self._tensor(name)
        if t.tensor_type not in SUPPORTED_TYPES:
            raise SpecserveError(f"{self.path}: tensor {name} has unsupported type {t.tensor_type.name}")
        shape = self.tensor_shape(name)
        data = t.data
        if rows is not None:
            start, stop = rows
            if not 0 <= start <= stop <= shape[0]:
                raise SpecserveError(f"{self.path}: rows {start}..{stop} of tensor {name} with {shape[0]} rows")
            data = data[start:stop]  # (the memory map's rows: torch order's first dimension)
            shape = (stop - start, *shape[1:])
        try:
            if t.tensor_type == GGMLQuantizationType.F32:
                array = np.asarray(data, dtype=np.float32)
            elif t.tensor_type == GGMLQuantizationType.F16:
                array = np.asarray(data, dtype=np.float16)
            elif t.tensor_type == GGMLQuantizationType.BF16:
                raw = torch.from_numpy(np.array(data, copy=True).view(np.int16))
                return raw.view(torch.bfloat16).reshape(shape).to(device=device, dtype=dtype)
            else:
                array = dequantize_blocks(data, t.tensor_type)
        except Exception as exc:
            raise SpecserveError(f"{self.path}: cannot decode tensor {name}: {exc}") from None
        array = np.ascontiguousarray(array)
        if not array.flags.writeable or np.may_share_memory(array, data):  # the file's bytes (mapped, or read
            array = array.copy()  # in with mmap=False): the tensor gets its own copy
        tensor = torch.from_numpy(array).reshape(shape)
        return tensor.to(device=device, dtype=dtype)

    def load_quant(self, name: str, device: torch.device | str = "cpu") -> QuantInts | None:
        """A block-quantized tensor as its exact integers and fp32 scales and mins per group (see
        repack.py), as a matrix [N, K]: the leading dimensions of a stacked tensor (a mixture of experts'
        [n_expert, N, K]) are flattened into N. None for other types."""
        t = self._tensor(name)
        shape = self.tensor_shape(name)
        if t.tensor_type not in REPACKABLE or len(shape) < 2:
            return None
        rows = int(np.prod(shape[:-1]))
        try:
            q, scale, mins = repack(t.data, t.tensor_type, (rows, shape[-1]))
        except Exception as exc:
            raise SpecserveError(f"{self.path}: cannot decode tensor {name}: {exc}") from None
        group = shape[-1] // scale.shape[1]
        return QuantInts(torch.from_numpy(q).to(device), torch.from_numpy(scale).to(device),
                         None if mins is None else torch.from_numpy(mins).to(device), group)

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise SpecserveError(f"{self.path}: missing tensor {name}") from None
