"""Constrained output: a GBNF grammar or a JSON schema masks the logits of every sampled position.

The field library is llguidance (docs/architecture.md says why, docs/perf.md compares the libraries).
`GrammarCompiler` holds the vocabulary in llguidance's form (built once per tokenizer) and a cache of compiled
grammars; `compile()` gives each request a `Constraint` of its own: the matcher state of that task, which lives
with the task and its slot.

Per step the scheduler asks a constrained slot's `Constraint` for the masks of its rows (`apply`): row i is
the target's view after draft[:i], so the matcher walks the draft, computes one mask per row and rolls back
to where it was. A draft token the grammar forbids can then never be the masked row's choice, so the
sampler rejects it like any mismatch, and constrained greedy text is the same with speculation or without.
`advance` then consumes what was accepted and cuts it where the grammar is complete (generation stops).

llguidance is imported on first use: importing specserve (and serving without constraints) never loads it.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specserve.errors import SpecserveError
from specserve.gguf.tokenizer import Tokenizer

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger(__name__)

# JSON whitespace as llama.cpp's json-schema-to-grammar allows it (one space, or newlines and up to 20
# spaces/tabs of indentation): unlimited whitespace lets a small model pad forever instead of finishing.
JSON_WHITESPACE = r"(?: |\n{1,2}[ \t]{0,20})?"
# lenient: keywords llguidance does not implement are ignored, as llama.cpp's converter ignores them;
# schemas that are wrong (a bad type, a dangling $ref, an unsatisfiable anyOf) are still refused.
_JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE, "lenient": True}
_CACHE_SIZE = 64  # compiled grammars kept (a matcher in its start state each)
_MAX_ERROR = 400  # characters of a library error message shown to the client
_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # a mask bit -> what is added to the logit


def _fit(bits: np.ndarray, vocab: int) -> np.ndarray:
    """Mask bits [rows, 32 * words] cut or padded (forbidden) to the logits' width: logits wider than the
    tokenizer's vocabulary have padding ids, which are never text."""
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))


@dataclass(frozen=True)
class GrammarSource:
    """What a request constrains its output with: kind "gbnf" (llama.cpp GBNF; llguidance's Lark is
    accepted too), "lark" (llguidance's Lark: the server's own grammars, e.g. a forced tool call) or
    "json_schema" (the schema as JSON text)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GrammarSource:
        # Key order is kept: it is the order the model writes the properties in.
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))


def _library() -> Any:
    try:
        import llguidance
    except ImportError:
        raise SpecserveError("constrained output (grammar, json_schema, response_format) needs the "
                             "llguidance package: pip install llguidance") from None
    return llguidance


def _one_line(message: str) -> str:
    text = " ".join(message.split())
    return text if len(text) <= _MAX_ERROR else text[:_MAX_ERROR - 3] + "..."


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper wants it: bytes per token id, special tokens marked
    with a leading 0xff byte (so a grammar's text never matches them), and an encode function."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        eog = sorted(tokenizer.eog_ids)
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [b"\xff" + tokenizer.token_bytes(i) if i in special else tokenizer.token_bytes(i)
                       for i in range(tokenizer.vocab_size)]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class GrammarCompiler:
    """Compiles grammars for one tokenizer; thread-safe (request handlers compile in worker threads)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSource, llguidance.LLMatcher] = OrderedDict()

    def warm(self) -> bool:
        """Build llguidance's vocabulary now (~0.1-0.4 s, holding the GIL: the server does it while loading,
        not while streams run). False when llguidance is missing (constrained requests then get a 400)."""
        try:
            self._tokenizer_ll()
        except SpecserveError as exc:
            log.warning("%s", exc)
            return False
        return True

    def _tokenizer_ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _library()
                vocab = _Vocabulary(self.tokenizer)
                # Every end-of-generation token may end the output where the grammar accepts.
                self._ll_tokenizer = llg.LLTokenizer(llg.TokenizerWrapper(vocab),
                                                     eos_token=sorted(self.tokenizer.eog_ids) or None)
            return self._ll_tokenizer

    def compile(self, source: GrammarSource) -> Constraint:
        """A fresh per-task constraint; SpecserveError (-> 400) naming the problem for a bad grammar/schema."""
        ll_tokenizer = self._tokenizer_ll()
        with self._lock:
            pristine = self._cache.get(source)
            if pristine is not None:
                self._cache.move_to_end(source)
                return Constraint(pristine.deep_copy(), source, self.tokenizer.vocab_size)
        pristine = self._build(source, ll_tokenizer)  # (outside the lock: llguidance drops the GIL here)
        with self._lock:
            self._cache[source] = pristine
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            return Constraint(pristine.deep_copy(), source, self.tokenizer.vocab_size)

    @staticmethod
    def _build(source: GrammarSource, ll_tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
        llg = _library()
        what = "json_schema" if source.kind == "json_schema" else "grammar"
        try:
            if source.kind in ("gbnf", "lark"):
                grammar = llg.grammar_from(source.kind, source.text)
            elif source.kind == "json_schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(source.text, defaults=_JSON_OPTIONS)
            else:
                raise SpecserveError(f"unknown constraint kind {source.kind!r}")
        except ValueError as exc:
            raise SpecserveError(f"invalid {what}: {_one_line(str(exc))}") from None
        matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0,
                                limits=llg.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise SpecserveError(f"invalid {what}: {_one_line(matcher.get_error())}")
        return matcher


class Constraint:
    """One task's matcher. Invariant: it has consumed every token the task generated so far, so its mask is
    the one for the next position (row 0 of the slot's next step)."""

    def __init__(self, matcher: llguidance.LLMatcher, source: GrammarSource, vocab_size: int):
        self._m = matcher
        self.source = source
        self._words = (vocab_size + 31) // 32  # llguidance's bitmask: one bit per token, 32 per int32
        self.done = False  # the grammar is complete: generation stops

    def masks(self, draft: list[int]) -> torch.Tensor:
        """Bitmasks [len(draft) + 1, words] (int32, bit t of row i: token t allowed after draft[:i]).

        Rows after the first draft token the grammar forbids (or after one that completes it) are left
        all-allowed: the sampler never reaches them (the forbidden token cannot be row i's choice)."""
        out = torch.full((len(draft) + 1, self._words), -1, dtype=torch.int32)
        n_ok = self._m.validate_tokens(draft) if draft else 0
        walked = 0
        for i in range(n_ok + 1):
            if self._m.is_stopped():  # draft[:i] completes the grammar: advance() cuts the output there
                break
            self._m.unsafe_compute_mask_ptr(out[i].data_ptr(), self._words * 4)
            if i == n_ok:
                break
            if not self._m.consume_token(draft[i]):
                raise SpecserveError(f"grammar matcher failed: {_one_line(self._m.get_error())}")
            walked += 1
        if walked and not self._m.rollback(walked):
            raise SpecserveError(f"grammar matcher failed to roll back: {_one_line(self._m.get_error())}")
        return out

    def apply(self, rows: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """rows [len(draft) + 1, vocab] with every token the grammar forbids at -inf (a new tensor; the raw
        rows stay for log-probabilities)."""
        words = self.masks(draft)
        return masked_on_host(rows, words) if rows.device.type == "cpu" else masked_on_device(rows, words)

    def advance(self, tokens: list[int]) -> list[int]:
        """Consume the accepted tokens; return them cut after the one that completes the grammar."""
        for n, token in enumerate(tokens, 1):
            if not self._m.consume_token(token):
                raise SpecserveError(f"a generated token broke the grammar: {_one_line(self._m.get_error())}")
            if self._m.is_stopped():
                self.done = True
                return tokens[:n]
        return tokens


def masked_on_host(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """CPU logits: numpy unpacks the bits and looks up 0 / -inf per token in C (~2x faster than torch's
    shifts and masked_fill on one thread)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")
    return rows + torch.from_numpy(_BIAS[_fit(bits, rows.shape[-1])])


def masked_on_device(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Logits on an accelerator: the packed words travel (32x smaller than a mask) and are unpacked there."""
    packed = words.to(rows.device)
    shifts = torch.arange(32, dtype=torch.int32, device=rows.device)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).view(packed.shape[0], -1).bool()
    vocab = rows.shape[-1]
    if allowed.shape[1] < vocab:  # padding ids past the tokenizer's vocabulary are never text
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return rows.masked_fill(~allowed[:, :vocab], float("-inf"))
