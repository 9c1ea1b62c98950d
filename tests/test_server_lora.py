"""LoRA adapters through a real `specserve serve` (--lora, --lora-scaled, /lora-adapters, a request's `lora`):
greedy output equals an adapted runner's in-process, with and without adapters side by side, and a prompt
cached without an adapter is never reused with one."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from specserve.engine.local_runner import LocalRunner
from specserve.model.batch import Batch
from tests.helpers import prefill
from tests.lora_files import write_adapter
from tests.server_utils import ServerProcess, served
from tests.test_lora import ALPHA, RANK

PROMPT = [1, 504, 2014, 314, 253, 1127, 28, 29, 30, 1380, 314]
N = 12


@pytest.fixture(scope="module")
def files(smollm_path: Path, tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("lora_server")
    one, two = d / "one.gguf", d / "two.gguf"
    write_adapter(one, smollm_path, rank=RANK, alpha=ALPHA, seed=3)
    write_adapter(two, smollm_path, rank=2, alpha=0.0, seed=4, matrices=("attn_v",), output=False)
    return one, two


@pytest.fixture(scope="module")
def server(files) -> Iterator[ServerProcess]:
    one, two = files
    yield from served("-m", "smollm2-135m", "--device", "cpu", "--weight-format", "float", "-np", "2", "-c", "2048",
                      "--lora-scaled", f"{one}:0.5", "--lora", str(two))


def _greedy(runner: LocalRunner, prompt: list[int], n: int) -> list[int]:
    runner.kv_truncate(0, 0)
    logits = prefill(runner, 0, prompt)
    out = []
    for i in range(n):
        out.append(int(logits.argmax()))
        batch = Batch()
        batch.add_sequence([out[-1]], len(prompt) + i, 0, "last")
        logits = runner.forward(batch)[0]
    return out


@pytest.fixture(scope="module")
def references(smollm_path: Path, files) -> dict[str, list[int]]:
    """Greedy tokens in-process, with the adapter at 1.5 and without (test_lora.py: an adapted runner gives the
    merged weights' logits)."""
    one, _ = files
    runner = LocalRunner(smollm_path, n_seqs=1, n_ctx=256, device="cpu", progress=False, weight_format="float",
                         adapters=[one])
    plain = _greedy(runner, PROMPT, N)
    runner.set_adapter_scales(0, (1.5,))
    return {"plain": plain, "one": _greedy(runner, PROMPT, N)}


def _tokens(server: ServerProcess, **fields) -> list[int]:
    return server.complete(PROMPT, N, return_tokens=True, **fields)["tokens"]


def test_adapters_listed_and_set(server: ServerProcess, files) -> None:
    one, two = files
    assert server.get("/lora-adapters").json() == [{"id": 0, "path": str(one), "scale": 0.5},
                                                   {"id": 1, "path": str(two), "scale": 1.0}]
    r = server.post("/lora-adapters", [{"id": 1, "scale": 0.25}])
    assert r.status_code == 200 and r.json() == {"success": True}
    assert [a["scale"] for a in server.get("/lora-adapters").json()] == [0.0, 0.25]
    for bad in ([{"id": 2, "scale": 1.0}], [{"id": 0}], {"id": 0, "scale": 1}, [{"id": -1, "scale": 1}]):
        r = server.post("/lora-adapters", bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["message"]
    assert [a["scale"] for a in server.get("/lora-adapters").json()] == [0.0, 0.25]  # (unchanged)


def test_request_adapters_follow_the_request(server: ServerProcess, references) -> None:
    assert server.post("/lora-adapters", []).status_code == 200  # every global scale 0
    plain = _tokens(server)
    assert plain == references["plain"]
    # the same prompt again, now with adapter 0: the cached prompt (computed without it) must not be reused
    tuned = server.complete(PROMPT, N, return_tokens=True, lora=[{"id": 0, "scale": 1.5}])
    assert tuned["tokens"] == references["one"] != references["plain"]
    assert tuned["timings"]["cache_n"] == 0
    again = server.complete(PROMPT, N, return_tokens=True, lora=[{"id": 0, "scale": 1.5}])
    assert again["tokens"] == references["one"] and again["timings"]["cache_n"] > 0
    assert _tokens(server) == references["plain"]
    # global scales apply to requests without the field
    assert server.post("/lora-adapters", [{"id": 0, "scale": 1.5}]).status_code == 200
    assert _tokens(server) == references["one"]
    assert _tokens(server, lora=[]) == references["plain"]


def test_with_and_without_adapters_at_once(server: ServerProcess, references) -> None:
    assert server.post("/lora-adapters", []).status_code == 200
    asks = [{}, {"lora": [{"id": 0, "scale": 1.5}]}] * 3
    with ThreadPoolExecutor(len(asks)) as pool:
        got = list(pool.map(lambda fields: _tokens(server, **fields), asks))
    assert got == [references["plain"], references["one"]] * 3


def test_bad_request_adapters(server: ServerProcess) -> None:
    for lora, message in (([{"id": 7, "scale": 1.0}], "no adapter has id 7"), ([{"id": 0}], "scale"),
                          ({"id": 0, "scale": 1}, "lora")):
        r = server.post("/completion", {"prompt": "hi", "n_predict": 2, "lora": lora})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             "lora": [{"id": 0, "scale": 0.5}]})
    assert r.status_code == 200, r.text


def test_lora_flag_errors(tmp_path: Path, capsys) -> None:
    from specserve.cli import main

    assert main(["serve", "-m", "smollm2-135m", "--lora", str(tmp_path / "missing.gguf")]) == 1
    assert "LoRA adapter file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["serve", "-m", "smollm2-135m", "--lora-scaled", "x.gguf"])
    assert exc.value.code == 2 and "is not FNAME:SCALE" in capsys.readouterr().err


def test_generate_takes_adapters(server: ServerProcess, files) -> None:
    """`specserve generate --lora-scaled` writes what the server answers with the same scale."""
    import subprocess
    import sys

    one, _ = files
    prompt = "The three laws of thermodynamics are"
    out = subprocess.run([sys.executable, "-m", "specserve.cli", "generate", "-m", "smollm2-135m", "--device", "cpu",
                          "--weight-format", "float", "--temp", "0", "-n", "12", "-p", prompt,
                          "--lora-scaled", f"{one}:1.5"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    tuned = server.complete(prompt, 12, lora=[{"id": 0, "scale": 1.5}])["content"]
    assert out.stdout.strip() == tuned.strip() != server.complete(prompt, 12, lora=[])["content"].strip()
