"""GGUF loading: every supported tensor type decodes in the right shape; bad files get clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.model.registry import read_config
from tests.gguf_blocks import K_QUANTS, raw_blocks

ROWS, COLS = 6, 512
# Types gguf-py can quantize: the decoded tensor must be close to the original values.
ROUND_TRIP = {Q.F32: 1e-7, Q.F16: 2e-3, Q.BF16: 2e-2, Q.Q8_0: 3e-2, Q.Q4_0: 0.5, Q.Q4_1: 0.4, Q.Q5_0: 0.25,
              Q.Q5_1: 0.2}
# K-quants gguf-py only decodes: raw random blocks, compared with gguf's own decoding.
RAW_ONLY = K_QUANTS


@pytest.fixture(scope="module")
def typed_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    path = tmp_path_factory.mktemp("gguf") / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    raws = {}
    for qtype in ROUND_TRIP:
        if qtype in (Q.F32, Q.F16):  # plain arrays carry their own type
            writer.add_tensor(f"t.{qtype.name}", values.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:  # bytes per row; the writer derives the element shape
            writer.add_tensor(f"t.{qtype.name}", quantize(values, qtype), raw_dtype=qtype)
    for qtype in RAW_ONLY:
        raws[qtype.name] = raw_blocks(qtype, rng, ROWS, COLS)
        writer.add_tensor(f"t.{qtype.name}", raws[qtype.name], raw_dtype=qtype)
    iq = rng.integers(0, 256, size=(ROWS, COLS // 32 * 18), dtype=np.uint8)
    writer.add_tensor("t.IQ4_NL", iq, raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, values, raws


@pytest.mark.parametrize("qtype", list(ROUND_TRIP))
def test_round_trip_types(typed_file, qtype: Q) -> None:
    path, values, _ = typed_file
    got = GGUFFile(path).load_tensor(f"t.{qtype.name}", torch.float32)
    assert got.shape == (ROWS, COLS)
    assert (got - torch.from_numpy(values)).abs().max().item() < ROUND_TRIP[qtype]


@pytest.mark.parametrize("qtype", RAW_ONLY)
def test_k_quant_types(typed_file, qtype: Q) -> None:
    path, _, raws = typed_file
    got = GGUFFile(path).load_tensor(f"t.{qtype.name}", torch.float32)
    expected = dequantize(raws[qtype.name], qtype)
    assert got.shape == (ROWS, COLS)
    assert torch.isfinite(got).all()
    assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected)))


def test_without_mmap_the_tensors_are_read_into_memory(typed_file) -> None:
    """--no-mmap: the same tensors, held in process memory (not views of the file's map), and each loaded
    tensor has its own storage (the weights must not alias the file's bytes)."""
    path, _, _ = typed_file
    mapped, read = GGUFFile(path), GGUFFile(path, mmap=False)
    for qtype in [*ROUND_TRIP, *RAW_ONLY]:
        name = f"t.{qtype.name}"
        assert np.shares_memory(mapped._tensor(name).data, mapped._reader.data)  # a view of the map
        data = read._tensor(name).data
        assert not np.shares_memory(data, read._reader.data)
        got = read.load_tensor(name, torch.float32)
        assert torch.equal(got, mapped.load_tensor(name, torch.float32)), name
        assert not np.may_share_memory(got.numpy(), data)


def test_compute_dtype_conversion(typed_file) -> None:
    path, values, _ = typed_file
    got = GGUFFile(path).load_tensor("t.Q8_0", torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert (got.float() - torch.from_numpy(values)).abs().max().item() < 5e-2


def test_unsupported_tensor_type_is_named(typed_file) -> None:
    path, _, _ = typed_file
    with pytest.raises(SpecserveError, match="unsupported type IQ4_NL"):
        GGUFFile(path).load_tensor("t.IQ4_NL")


def test_missing_tensor_is_named(typed_file) -> None:
    with pytest.raises(SpecserveError, match="missing tensor blk.0.attn_q.weight"):
        GGUFFile(typed_file[0]).load_tensor("blk.0.attn_q.weight")


def test_unsupported_architecture() -> None:
    with pytest.raises(SpecserveError, match="unsupported model architecture 'gpt2'"):
        read_config({"general.architecture": "gpt2"}, set())


def test_missing_metadata_is_named() -> None:
    with pytest.raises(SpecserveError, match="llama.embedding_length"):
        read_config({"general.architecture": "llama"}, set())


def test_metadata_and_tensors_are_ggufs_own(smollm_path: Path) -> None:
    """The reader's faster field parsing gives what gguf's GGUFReader gives: every key's value, every tensor."""
    from gguf import GGUFReader

    from specserve.gguf.reader import _field_value

    ours = GGUFFile(smollm_path)
    theirs = GGUFReader(smollm_path, "r")
    assert ours.metadata == {key: _field_value(field) for key, field in theirs.fields.items()}
    assert ours.tensor_names() == [t.name for t in theirs.tensors]
    for t in theirs.tensors[:3] + theirs.tensors[-3:]:
        mine = ours._tensor(t.name)
        assert (mine.tensor_type, mine.data_offset) == (t.tensor_type, t.data_offset)
        assert np.array_equal(mine.data, t.data)
