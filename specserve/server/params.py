"""A task's parameters in llama-server's shape (`generation_settings`, `/props`, `/slots`).

llama-server lists every sampler and option it has; clients read some of those fields. specserve has fewer,
so the ones it lacks are shown at the values that mean "off" in llama-server, and the task's own values
(engine/tasks.py `params_json`) override them wherever specserve has the field.
"""

from __future__ import annotations

from typing import Any

# llama-server's fields that specserve does not implement, at their "off" values (its defaults).
LLAMA_ONLY_FIELDS: dict[str, Any] = {
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"], "mirostat": 0,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "n_discard": 0, "logit_bias": [], "min_keep": 0,
    "grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": [], "chat_format": "Content-only",
    "reasoning_format": "none", "reasoning_in_content": False, "thinking_forced_open": False,
    "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],  # our chain (engine/sampling.py)
    "post_sampling_probs": False, "lora": [],
}


def llama_params(params: dict[str, Any], stream: bool | None = None) -> dict[str, Any]:
    """params (a Task's params_json) with llama-server's other fields; `max_tokens` mirrors n_predict as
    there, and `stream` is added where the request's is known."""
    out = {**LLAMA_ONLY_FIELDS, **params, "max_tokens": params.get("n_predict", -1)}
    if stream is not None:
        out["stream"] = stream
    return out
