"""llama-server's /infill prompt: fill in the middle with the model's FIM tokens (gguf/tokenizer.py finds
them: the GGUF's tokenizer.ggml.fim_*_token_id, else the token texts llama.cpp knows).

The layout is llama-server's (its repo-level pattern, arXiv 2409.12186):

    [FIM_REP]myproject\\n [FIM_SEP]{filename}\\n{text} ... [FIM_SEP]filename\\n
    [bos] [FIM_PRE]{prefix}{prompt} [FIM_SUF]{suffix} [FIM_MID]

with the extra files first (their last tokens, as many as fit beside the batch and twice n_predict), the
prefix's last 3/4 of a batch and the suffix's first 1/4 less the prompt. Without FIM_REP the repo line is
left out; without FIM_SEP each file starts with a plain-text snippet marker instead.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from specserve.server.errors import RequestError, error_response
from specserve.server.prompts import tokenize_one
from specserve.server.schemas import ExtraChunk, InfillRequest
from specserve.server.tokenizing import TextEncoder

SNIPPET_MARK = "\n\n--- snippet ---\n\n"  # a file's start where the model has no FIM_SEP (llama-server's)


class InfillUnsupported(RequestError):
    """The served model has no FIM tokens: a request this model can never serve, so a 400 (llama-server: 501),
    typed as llama-server types it."""

    def response(self) -> JSONResponse:
        return error_response(400, str(self), type="not_supported_error")


def fim_ids(encoder: TextEncoder) -> tuple[int, int, int]:
    fim = encoder.tokenizer.fim
    missing = [name for name in ("pre", "suf", "mid") if fim[name] is None]
    if missing:
        names = {"pre": "prefix", "suf": "suffix", "mid": "middle"}
        raise InfillUnsupported("Infill is not supported by this model: it has no fill-in-the-middle "
                                f"{', '.join(names[m] for m in missing)} token")
    return fim["pre"], fim["suf"], fim["mid"]  # type: ignore[return-value]


def _text(encoder: TextEncoder, text: str) -> list[int]:
    return encoder.encode(text, add_special=False, parse_special=False)


def extra_tokens(encoder: TextEncoder, chunks: list[ExtraChunk]) -> list[int]:
    """The repo line and each extra file, then the current file's separator."""
    fim = encoder.tokenizer.fim
    out: list[int] = []
    if fim["rep"] is not None:
        out += [fim["rep"], *_text(encoder, "myproject\n")]
    for chunk in chunks:
        if fim["sep"] is not None:
            out += [fim["sep"], *_text(encoder, chunk.filename + "\n")]
        else:
            out += _text(encoder, SNIPPET_MARK)
        out += _text(encoder, chunk.text)
    if fim["sep"] is not None:
        out += [fim["sep"], *_text(encoder, "filename\n")]
    return out


def infill_prompt(encoder: TextEncoder, req: InfillRequest, n_batch: int, n_ctx: int, n_predict: int) -> list[int]:
    """The prompt tokens of an infill request (raises InfillUnsupported for a model without FIM tokens)."""
    pre, suf, mid = fim_ids(encoder)
    # Prefix and suffix are text, not control tokens (llama-server tokenizes them so); the prompt, like
    # /completion's, parses them, but gets no bos of its own in the middle of the layout.
    prefix = tokenize_one(encoder, req.input_prefix, add_special=False, parse_special=False)
    suffix = tokenize_one(encoder, req.input_suffix, add_special=False, parse_special=False)
    prompt = encoder.encode(req.prompt, add_special=False, parse_special=True) if req.prompt else []
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    extra = extra_tokens(encoder, req.input_extra)
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    tok = encoder.tokenizer
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return [*extra[len(extra) - n_extra:], *bos, pre, *prefix[len(prefix) - n_prefix:], *prompt,
            suf, *suffix[:n_suffix], mid]
