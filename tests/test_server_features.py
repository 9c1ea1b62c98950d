"""llama-server features over HTTP: logit_bias, n > 1, batches of prompts and response_fields, /infill,
embeddings and slot save/restore (a real `specserve serve` with --slot-save-path)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def server(slot_dir: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "-np", "2", "-c", "2048",
                        "--slot-save-path", str(slot_dir))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def error(r: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["message"]
    return err["message"]


def tokenize(server: ServerProcess, text: str) -> list[int]:
    return server.post("/tokenize", {"content": text}).json()["tokens"]


# ---- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_bans_and_boosts(server: ServerProcess) -> None:
    plain = server.complete(PROMPT, 8, return_tokens=True)
    first = plain["tokens"][0]
    banned = server.complete(PROMPT, 8, return_tokens=True, logit_bias=[[first, False]])
    assert first not in banned["tokens"] and banned["content"] != plain["content"]
    assert banned["generation_settings"]["logit_bias"] == [{"token": first, "bias": False}]
    text = server.post("/detokenize", {"tokens": [first]}).json()["content"]
    by_text = server.complete(PROMPT, 8, return_tokens=True, logit_bias=[[text, False]])
    assert by_text["tokens"] == banned["tokens"]  # text stands for its tokens
    spec = server.complete(PROMPT, 8, return_tokens=True, logit_bias=[[first, False]],
                           **{"speculative.type": "ngram-simple", "speculative.ngram_size_n": 1})
    assert spec["tokens"] == banned["tokens"]
    zebra = tokenize(server, " zebra")[0]
    r = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                        "logit_bias": {str(zebra): 100}})
    assert r.json()["choices"][0]["text"] == " zebra" * 3
    chat = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                                "temperature": 0, "logit_bias": {str(zebra): 100}})
    assert chat.json()["choices"][0]["message"]["content"] == " zebra" * 4


@pytest.mark.parametrize("bias", [[[5, True]], [[10**9, 1.0]], [[5]], [[1.5, 2]], {"x": "y"}, {"-3": 1}])
def test_bad_logit_bias_is_a_400(server: ServerProcess, bias: object) -> None:
    error(server.post("/completion", {"prompt": "x", "n_predict": 1, "logit_bias": bias}), 400)


# ---- n > 1 ---------------------------------------------------------------------------------------


def test_n_choices_differ_and_repeat_with_a_seed(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "temperature": 1.0,
            "seed": 42, "n": 3}
    a = server.post("/v1/chat/completions", body).json()
    b = server.post("/v1/chat/completions", body).json()
    texts = [c["message"]["content"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # reproducible
    assert len(set(texts)) == 3  # each choice its own seed
    one = server.post("/v1/chat/completions", {**body, "n": 1}).json()
    assert one["choices"][0]["message"]["content"] == texts[0]  # choice 0 keeps the request's seed
    usage = a["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counts once
    assert 12 < usage["completion_tokens"] <= 36  # every choice's tokens


def test_n_choices_stream_with_their_index(server: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    events = list(server.stream("/v1/completions", body))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    texts = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in (0, 1)}
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1] and len({e["id"] for e in events[:-1]}) == 1
    usage = [e for e in events[:-1] if not e["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 12
    whole = server.post("/v1/completions", {**body, "stream": False}).json()
    assert [c["text"] for c in whole["choices"]] == [texts[0], texts[1]]


def test_n_is_bounded(server: ServerProcess) -> None:
    for n in (0, 129):
        error(server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": n}), 400)
    # 3 prompts x 128 choices: more tasks than the slots and the queue (2 + 256) could ever hold
    msg = error(server.post("/v1/completions", {"prompt": ["x", "y", "z"], "max_tokens": 1, "n": 128}), 400)
    assert "at most 258 tasks" in msg


# ---- /completion: batches, mixed prompts, response_fields ----------------------------------------


def test_a_batch_of_prompts_gives_a_list(server: ServerProcess) -> None:
    prompts = [PROMPT, "One, two, three,"]
    batch = server.post("/completion", {"prompt": prompts, "n_predict": 6, "temperature": 0})
    out = batch.json()
    assert isinstance(out, list) and [r["index"] for r in out] == [0, 1]
    assert [r["content"] for r in out] == [server.complete(p, 6)["content"] for p in prompts]
    tokens = [tokenize(server, p) for p in prompts]
    by_ids = server.post("/completion", {"prompt": tokens, "n_predict": 6, "temperature": 0}).json()
    assert [r["content"] for r in by_ids] == [r["content"] for r in out]
    events = list(server.stream("/completion", {"prompt": prompts, "n_predict": 4, "temperature": 0,
                                                "stream": True}))
    assert {e["index"] for e in events} == {0, 1} and sum(e["stop"] for e in events) == 2


def test_mixed_prompt_and_response_fields(server: ServerProcess) -> None:
    ids = tokenize(server, PROMPT)
    mixed = server.post("/completion", {"prompt": [*ids[:2], server.post("/detokenize", {"tokens": ids[2:]})
                                                   .json()["content"]], "n_predict": 5, "temperature": 0,
                                        "response_fields": ["content", "generation_settings/n_predict", "nope/x"]})
    assert mixed.json() == {"content": server.complete(ids, 5)["content"], "generation_settings/n_predict": 5}
    error(server.post("/completion", {"prompt": [1, [2, 3]], "n_predict": 1}), 400)
    error(server.post("/completion", {"prompt": [], "n_predict": 1}), 400)


# ---- /infill -------------------------------------------------------------------------------------


def test_infill_needs_fim_tokens(server: ServerProcess) -> None:
    msg = error(server.post("/infill", {"input_prefix": "def f(", "input_suffix": "):"}), 400, "not_supported_error")
    assert "Infill is not supported by this model" in msg
    error(server.post("/infill", {"input_prefix": "x"}), 400)  # input_suffix is required
    error(server.post("/infill", {"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}),
          400)


# ---- embeddings ----------------------------------------------------------------------------------


def test_embeddings_are_unit_vectors_and_tell_texts_apart(server: ServerProcess) -> None:
    texts = ["The cat sat on the mat.", "The cat sat on the mat.", "Quarterly revenue grew by ten percent."]
    r = server.post("/v1/embeddings", {"input": texts, "model": "smollm2-135m"}).json()
    vectors = [d["embedding"] for d in r["data"]]
    assert [d["index"] for d in r["data"]] == [0, 1, 2] and r["object"] == "list"
    assert all(abs(sum(x * x for x in v) - 1.0) < 1e-4 for v in vectors)
    assert vectors[0] == vectors[1] and vectors[0] != vectors[2]
    assert r["usage"]["prompt_tokens"] == sum(len(tokenize(server, t)) for t in texts)
    native = server.post("/embedding", {"content": texts[0]}).json()
    assert native[0]["index"] == 0 and native[0]["embedding"] == [vectors[0]]
    raw = server.post("/embedding", {"content": texts[0], "embd_normalize": -1}).json()[0]["embedding"][0]
    norm = sum(x * x for x in raw) ** 0.5
    assert norm > 1.5 and all(abs(x / norm - y) < 1e-5 for x, y in zip(raw, vectors[0], strict=True))
    b64 = server.post("/v1/embeddings", {"input": texts[0], "encoding_format": "base64"}).json()
    decoded = struct.unpack(f"<{len(vectors[0])}f", base64.b64decode(b64["data"][0]["embedding"]))
    assert all(abs(x - y) < 1e-6 for x, y in zip(decoded, vectors[0], strict=True))


def test_openai_client_embeddings(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    out = client.embeddings.create(model="smollm2-135m", input=["hello", "world"])
    assert len(out.data) == 2 and len(out.data[0].embedding) == 576 and out.data[0].embedding != out.data[1].embedding


def test_bad_embedding_requests(server: ServerProcess) -> None:
    error(server.post("/v1/embeddings", {}), 400)
    assert "empty" in error(server.post("/v1/embeddings", {"input": ""}), 400)
    error(server.post("/v1/embeddings", {"input": "x", "encoding_format": "int8"}), 400)
    r = server.post("/v1/embeddings", {"input": "x", "model": "text-embedding-3-small"})  # any name: the one model
    assert r.status_code == 200 and len(r.json()["data"]) == 1
    long = server.post("/embedding", {"content": "word " * 2100})  # past -c, which one slot may use whole
    error(long, 400, "exceed_context_size_error")


# ---- slot save / restore ---------------------------------------------------------------------------


def test_slot_save_erase_restore_round_trip(server: ServerProcess, slot_dir: Path) -> None:
    prompt = "In the beginning there was a small village by the sea, and in it lived"
    first = server.complete(prompt, 12)
    slot = first["id_slot"]
    saved = server.post(f"/slots/{slot}?action=save", {"filename": "village.bin"}).json()
    assert saved["id_slot"] == slot and saved["n_saved"] == first["tokens_cached"] - 1
    assert saved["n_written"] == (slot_dir / "village.bin").stat().st_size
    for s in (0, 1):
        assert server.post(f"/slots/{s}?action=erase").json()["id_slot"] == s
    restored = server.post(f"/slots/{1 - slot}?action=restore", {"filename": "village.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = server.complete(prompt, 12)
    assert again["id_slot"] == 1 - slot and again["content"] == first["content"]
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1  # the prompt came from the file


@pytest.mark.parametrize("filename", ["../x.bin", "a/b", "..", "", " x", "x.", "a\\b", "c:d"])
def test_slot_filenames_are_plain_names(server: ServerProcess, filename: str) -> None:
    error(server.post("/slots/0?action=save", {"filename": filename}), 400)


def test_bad_slot_actions(server: ServerProcess) -> None:
    assert "not found" in error(server.post("/slots/0?action=restore", {"filename": "missing.bin"}), 400)
    error(server.post("/slots/9?action=erase"), 400)
    error(server.post("/slots/abc?action=erase"), 400)
    error(server.post("/slots/0?action=explode"), 400)
    error(server.post("/slots/0?action=save", {}), 400)


@pytest.mark.slow
def test_infill_on_a_fim_model() -> None:
    srv = ServerProcess("-m", "qwen2.5-coder-0.5b", "--device", "cpu", "-np", "1", "-c", "1024")
    try:
        srv.wait_ready(600)
        body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n",
                "n_predict": 4, "temperature": 0, "response_fields": ["content", "tokens_evaluated"]}
        r = srv.post("/infill", body)
        assert r.status_code == 200, r.text
        assert r.json()["content"].startswith("a + b") and r.json()["tokens_evaluated"] > 20
    finally:
        srv.stop()
