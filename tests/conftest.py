"""Shared fixtures: catalog models, our runner and the HF transformers reference."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads OpenMP (specserve/__init__.py says why)

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from specserve import catalog  # noqa: E402


@pytest.fixture(autouse=True)
def _kernel_settings_follow_the_environment():
    """A test that sets a kernel switch reloads the settings (kernels/settings.py); once monkeypatch has put the
    environment back, they are read again for the next test."""
    yield
    from specserve.kernels import settings

    settings.reload()


def model_path(name: str) -> Path:
    return catalog.pull(name)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_runner(smollm_path: Path):
    from specserve.engine.local_runner import LocalRunner

    return LocalRunner(smollm_path, n_seqs=4, n_ctx=1024, device="cpu", progress=False)


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_runner):
    from specserve.gguf.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm_runner.gguf)


def load_hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm_hf(smollm_path: Path):
    return load_hf_model(smollm_path)


def pytest_collection_finish(session: pytest.Session) -> None:
    """mypy (tests/test_types.py) starts now, in a process beside the tests, when its test is to run."""
    if any(item.nodeid.startswith("tests/test_types.py::test_mypy_is_clean") for item in session.items):
        from tests.test_types import start_mypy

        start_mypy()


@pytest.fixture(scope="module")
def http():
    """The in-process app (tests/app_engine.py), one per test module: the official clients' http_client."""
    from tests import app_engine

    return app_engine.client()
