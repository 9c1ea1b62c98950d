"""Whether two GGUF files share a vocabulary (a draft model must tokenize like its target)."""

from __future__ import annotations

from typing import Any

from specserve.errors import SpecserveError

VOCAB_SIZE_SLACK = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START = 5  # llama.cpp's SPEC_VOCAB_CHECK_START_TOKEN_ID


def check_vocab_compatible(target: dict[str, Any], draft: dict[str, Any]) -> None:
    """Refuse a draft model whose tokenizer differs from the target's (GGUF metadata)."""

    def meta(m: dict[str, Any], key: str) -> Any:
        return m.get(f"tokenizer.ggml.{key}")

    problems = []
    if meta(target, "model") != meta(draft, "model"):
        problems.append(f"tokenizer type {meta(draft, 'model')} != {meta(target, 'model')}")
    for key in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        if meta(target, key) != meta(draft, key):
            problems.append(f"{key} {meta(draft, key)} != {meta(target, key)}")
    t_tokens, d_tokens = meta(target, "tokens") or [], meta(draft, "tokens") or []
    if abs(len(t_tokens) - len(d_tokens)) > VOCAB_SIZE_SLACK:
        problems.append(f"vocabulary sizes {len(d_tokens)} and {len(t_tokens)} differ by more than "
                        f"{VOCAB_SIZE_SLACK}")
    else:
        for i in range(VOCAB_CHECK_START, min(len(t_tokens), len(d_tokens))):
            if t_tokens[i] != d_tokens[i]:
                problems.append(f"token {i} is {d_tokens[i]!r} in the draft but {t_tokens[i]!r} in the target")
                break
    if problems:
        raise SpecserveError("the draft model is not compatible with the target: " + "; ".join(problems))
