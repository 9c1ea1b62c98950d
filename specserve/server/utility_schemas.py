"""Request bodies of the endpoints that generate nothing: embeddings, slot files, tokenize / detokenize, LoRA
scales (schemas.py has the generation requests and the parsing)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, RootModel, model_validator

from specserve.server.prompts import PromptInput
from specserve.server.schemas import LoraScale, StrictModel


class LoraScales(RootModel[list[LoraScale]]):
    """POST /lora-adapters: [{id, scale}, ...]."""


class EmbeddingRequest(StrictModel):
    """POST /embedding (llama-server: `content` or `input`) and /v1/embeddings (OpenAI: `input`)."""

    input: PromptInput | None = None
    content: PromptInput | None = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # llama-server's: -1 none, 0 max absolute (int16 range), 1 taxicab, 2 euclidean (the default), p > 2 p-norm
    embd_normalize: int = Field(2, ge=-1, le=100)

    @model_validator(mode="after")
    def _has_input(self) -> EmbeddingRequest:
        if self.input is None and self.content is None:
            raise ValueError('"input" or "content" must be provided')
        return self

    def texts(self) -> PromptInput:
        return self.input if self.input is not None else self.content  # type: ignore[return-value]


class SlotFileRequest(StrictModel):
    """POST /slots/{id}?action=save|restore: a file name in --slot-save-path (no directories)."""

    filename: str = Field(min_length=1, max_length=255)


class TokenizeRequest(StrictModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(StrictModel):
    tokens: list[int]
