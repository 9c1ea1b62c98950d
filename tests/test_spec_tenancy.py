"""ngram-suffix across requests through `specserve serve`: a request drafts from an earlier one of its own API key
and speculative.scope, never from another key's or scope's, and the text stays plain greedy's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_utils import ServerProcess

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("-m", "smollm2-135m", "--device", "cpu", "-np", "1", "-c", "2048", "--metrics",
                         "--api-key", "key-a,key-b", api_key="key-a").wait_ready()
    yield proc
    proc.stop()


def complete(server: ServerProcess, key: str, **fields: Any) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 48, "temperature": 0.0,
            "speculative.type": "ngram-suffix", "cache_prompt": False, **fields}
    r = server.post("/v1/chat/completions", body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    answer = r.json()
    return {"content": answer["choices"][0]["message"]["content"], "timings": answer["timings"]}


def shared(answer: dict[str, Any]) -> dict[str, int]:
    return answer["timings"]["draft_sources"].get("shared_suffix", {"n": 0, "accepted": 0})


def test_each_key_drafts_only_from_its_own_earlier_requests(server: ServerProcess) -> None:
    plain = complete(server, "key-a", **{"speculative.n_max": 0})["content"]
    first_a = complete(server, "key-a")
    assert shared(first_a)["n"] == 0  # (the plain request did not speculate: it left nothing to draft from)
    again_a = complete(server, "key-a")  # the same answer once more: key-a's earlier request drafts all of it
    first_b = complete(server, "key-b")
    other_scope = complete(server, "key-a", **{"speculative.scope": "another-job"})
    assert plain == first_a["content"] == again_a["content"] == first_b["content"] == other_scope["content"]
    assert shared(again_a)["n"] >= 16 and shared(again_a)["accepted"] == shared(again_a)["n"]
    assert shared(first_b)["n"] == 0  # key-a's text is not key-b's to draft from
    assert shared(other_scope)["n"] == 0  # nor another scope's within one key
    text = server.get("/metrics").text
    requests = next(line for line in text.splitlines() if line.startswith("llamacpp:shared_suffix_requests "))
    assert float(requests.split()[1]) == 4  # every speculating request so far, in three scopes


def test_a_wrong_key_is_refused(server: ServerProcess) -> None:
    r = server.post("/completion", {"prompt": "hi", "n_predict": 1}, headers={"Authorization": "Bearer key-c"})
    assert r.status_code == 401


def test_each_key_reuses_only_its_own_prompt_caches(server: ServerProcess) -> None:
    """Prompt caches (the slot's own and blocks cached by content) are reused within an API key and cache_salt only:
    another key's cached prompt is read again (no timing tells one tenant what another asked)."""
    prompt = "List three facts about lighthouses, each in one sentence."  # no request so far had it

    def cached(key: str, **fields: Any) -> int:
        answer = complete(server, key, cache_prompt=True, messages=[{"role": "user", "content": prompt}],
                          **{"speculative.n_max": 0, **fields})
        return answer["timings"]["cache_n"]

    # (salts no earlier request had: the chat template's start is in every key's earlier requests)
    cached("key-a", cache_salt="s1")
    assert cached("key-a", cache_salt="s1") > 16  # its own slot's cache
    assert cached("key-b", cache_salt="s1") == 0  # the same salt, but key-a's prompt is not key-b's to reuse
    assert cached("key-a", cache_salt="s1") >= 16  # from key-a's cached blocks (the slot now holds key-b's)
    assert cached("key-a", cache_salt="s2") == 0  # nor another salt's within one key
