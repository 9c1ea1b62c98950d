"""Byte-level BPE tokenizer built from a GGUF's own vocabulary (`tokenizer.ggml.*`).

Encoding runs on the HF `tokenizers` library; the pre-tokenizer split is chosen by
`tokenizer.ggml.pre` with llama.cpp's regexes (llama-vocab.cpp). Decoding works on
per-token bytes, so `IncrementalDecoder` costs O(token length) per token.

Choices where llama.cpp and HF transformers differ (documented, both are fine for
the models we ship):
- A missing or unknown pre-tokenizer name falls back to the GPT-2 split with a
  logged warning (llama.cpp also degrades to a default split for a missing name).
- Control and unknown tokens (types 3, 2) are parsed out of text only with `parse_special=True`;
  user-defined tokens (type 4) always are, as in llama.cpp.
- Decoding renders every token's text, control tokens included unless
  `skip_special`; unused tokens (type 5) decode to their text, as HF does.
"""

from __future__ import annotations

import codecs
import functools
import logging
import operator
import threading
from collections.abc import Sequence
from functools import lru_cache

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from specserve.errors import SpecserveError
from specserve.gguf.reader import ModelFile

log = logging.getLogger(__name__)

# llama.cpp token types (gguf TokenType)
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# Pre-tokenizer regexes, copied in meaning from llama.cpp's llama-vocab.cpp.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class _PreTokenizer:
    """Regexes applied in sequence (each isolates its matches), plus llama.cpp's per-type flags."""

    def __init__(self, splits: tuple[str, ...], ignore_merges: bool = False, add_bos: bool = False):
        self.splits = splits
        self.ignore_merges = ignore_merges  # a word that is itself a token skips BPE (llama3)
        self.add_bos = add_bos  # default when the GGUF has no add_bos_token key


_GPT2 = _PreTokenizer((_GPT2_SPLIT,))
_STARCODER = _PreTokenizer((r"\p{N}", _GPT2_SPLIT))  # digits one by one, then GPT-2
_QWEN2 = _PreTokenizer((_QWEN2_SPLIT,))
_LLAMA3 = _PreTokenizer((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)

PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    **dict.fromkeys(("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"), _GPT2),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _STARCODER),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2", "hunyuan"), _QWEN2),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"), _LLAMA3
    ),
}

# Token texts llama.cpp treats as end-of-generation (llama-vocab.cpp, "special_eog_ids").
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    }
)  # fmt: skip
_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>",
    "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)  # fmt: skip
# FIM pad / repo / file-separator tokens also end generation in llama.cpp.
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# Fill-in-the-middle: prefix / suffix / middle token texts llama.cpp recognizes when the GGUF names no id.
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<|code_prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<|code_suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<|code_middle|>")


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed: char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _spell_bytes(text: str) -> str:
    """A token string stored with raw characters, re-spelled in the byte alphabet (as HF does)."""
    to_char = {b: c for c, b in byte_alphabet().items()}
    return "".join(to_char[b] for b in text.encode("utf-8"))


def _optional_id(metadata: dict, key: str, n_vocab: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or not 0 <= value < n_vocab:
        log.warning("ignoring %s = %r: not a token id of this vocabulary (%d tokens)", key, value, n_vocab)
        return None
    return value


class Tokenizer:
    """Encode/decode text with the vocabulary, merges and special tokens stored in a GGUF."""

    def __init__(
        self,
        tokens: list[str],
        token_types: list[int],
        merges: list[str],
        pre: str | None,
        metadata: dict,
    ):
        n_vocab = len(tokens)
        if n_vocab == 0:
            raise SpecserveError("the GGUF tokenizer has an empty vocabulary")
        if len(token_types) != n_vocab:
            raise SpecserveError(f"GGUF tokenizer: {len(token_types)} token types for {n_vocab} tokens")
        self.vocab_size: int = n_vocab
        self._tokens = tokens
        self._types = token_types

        pre_tok = PRE_TOKENIZERS.get(pre or "")
        if pre_tok is None:
            log.warning(
                "pre-tokenizer %r is not known; using the GPT-2 split (tokenization may differ from the model's)",
                pre,
            )
            pre_tok = _GPT2

        self.bos_id: int | None = _optional_id(metadata, "tokenizer.ggml.bos_token_id", n_vocab)
        self.eos_id: int | None = _optional_id(metadata, "tokenizer.ggml.eos_token_id", n_vocab)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token")
        self.add_bos: bool = bool(pre_tok.add_bos if add_bos is None else add_bos) and self.bos_id is not None
        self.add_eos: bool = bool(add_eos) and self.eos_id is not None
        template = metadata.get("tokenizer.chat_template")
        self.chat_template: str | None = template if isinstance(template, str) and template else None

        alphabet = byte_alphabet()
        vocab: dict[str, int] = {}
        self._token_bytes: list[bytes] = []
        for i, (text, ttype) in enumerate(zip(tokens, token_types, strict=True)):
            if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
                # added tokens are matched and rendered verbatim, never byte-mapped
                vocab[text] = i
                self._token_bytes.append(text.encode("utf-8"))
            elif all(c in alphabet for c in text):
                vocab[text] = i
                self._token_bytes.append(bytes(alphabet[c] for c in text))
            else:
                vocab[_spell_bytes(text)] = i
                self._token_bytes.append(text.encode("utf-8"))

        pairs: list[tuple[str, str]] = []
        for m in merges:
            parts = m.split(" ")
            if len(parts) != 2:
                raise SpecserveError(f"GGUF tokenizer: malformed merge rule {m!r}")
            pairs.append((parts[0], parts[1]))

        # control and unknown tokens are "special" (llama.cpp parses them only on request)
        self._special_ids = frozenset(i for i, t in enumerate(token_types) if t in (TOKEN_CONTROL, TOKEN_UNKNOWN))
        self._backend = self._build_backend(vocab, pairs, pre_tok)
        self._add_special_tokens(self._backend)
        # A second copy that leaves control tokens in the text as plain characters: flipping the
        # flag on one shared object would race between threads encoding at the same time.
        self._backend_plain: HFTokenizer | None = None
        self._lock = threading.Lock()
        self._by_text = {t: i for i, t in enumerate(tokens)}  # a repeated text keeps its last id, as in llama.cpp
        self.eog_ids: frozenset[int] = self._find_eog(metadata)
        # FIM token ids ("pre", "suf", "mid", "rep", "sep"; None where the model has none): /infill's layout
        self.fim: dict[str, int | None] = {name: self._detect(metadata, f"tokenizer.ggml.fim_{name}_token_id", texts)
                                           for name, texts in (("pre", _FIM_PRE_TEXTS), ("suf", _FIM_SUF_TEXTS),
                                                               ("mid", _FIM_MID_TEXTS), ("rep", _FIM_REP_TEXTS),
                                                               ("sep", _FIM_SEP_TEXTS))}

    @staticmethod
    def _build_backend(vocab: dict[str, int], merges: list[tuple[str, str]], pre: _PreTokenizer) -> HFTokenizer:
        model = BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
        backend = HFTokenizer(model)
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in pre.splits]
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
        return backend

    def _add_special_tokens(self, backend: HFTokenizer) -> None:
        control = [AddedToken(self._tokens[i], special=True, normalized=False) for i in sorted(self._special_ids)]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(self._tokens, self._types, strict=True)
            if ty == TOKEN_USER_DEFINED
        ]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

    def _detect(self, metadata: dict, key: str, texts: Sequence[str]) -> int | None:
        """A special token's id: the GGUF's key, else the first id among the texts llama.cpp knows for it."""
        found = _optional_id(metadata, key, self.vocab_size)
        if found is not None:
            return found
        ids = [self._by_text[t] for t in texts if t in self._by_text]
        return min(ids) if ids else None

    def _find_eog(self, metadata: dict) -> frozenset[int]:
        """End-of-generation ids by llama.cpp's rules: known texts, FIM pad/repo/sep, eos/eot/eom."""
        by_text = self._by_text
        detect = functools.partial(self._detect, metadata)
        eot = detect("tokenizer.ggml.eot_token_id", _EOT_TEXTS)
        eom = detect("tokenizer.ggml.eom_token_id", ("<|eom_id|>",))
        fim = [
            detect("tokenizer.ggml.fim_pad_token_id", _FIM_PAD_TEXTS),
            detect("tokenizer.ggml.fim_rep_token_id", _FIM_REP_TEXTS),
            detect("tokenizer.ggml.fim_sep_token_id", _FIM_SEP_TEXTS),
        ]
        eog = {i for i in (*fim, self.eos_id, eot, eom) if i is not None}
        eog.update(i for t, i in by_text.items() if t in _EOG_TEXTS)
        # gpt-oss (harmony): <|end|> closes a message, not the generation, when <|return|>/<|call|> exist
        texts = {self._tokens[i]: i for i in eog}
        if {"<|return|>", "<|call|>", "<|end|>"} <= texts.keys():
            eog.discard(texts["<|end|>"])
        return frozenset(eog)

    @classmethod
    def from_gguf(cls, gguf: ModelFile) -> Tokenizer:
        md = gguf.metadata
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise SpecserveError(
                f"{gguf.path}: tokenizer model {model!r} is not supported; only byte-level BPE ('gpt2') is"
            )
        tokens = md.get("tokenizer.ggml.tokens")
        merges = md.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not isinstance(merges, list):
            raise SpecserveError(f"{gguf.path}: the GGUF has no tokenizer vocabulary or merges")
        types = md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
        try:
            tok = cls(tokens, types, merges, md.get("tokenizer.ggml.pre"), md)
        except SpecserveError as exc:
            raise SpecserveError(f"{gguf.path}: {exc}") from None
        return tok

    # -- encoding ---------------------------------------------------------------------------

    def _plain_backend(self) -> HFTokenizer:
        if self._backend_plain is None:
            with self._lock:
                if self._backend_plain is None:
                    backend = HFTokenizer.from_str(self._backend.to_str())
                    backend.encode_special_tokens = True
                    self._backend_plain = backend
        return self._backend_plain

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; `add_special` adds bos/eos as the model asks (add_bos/add_eos)."""
        if not isinstance(text, str):
            raise SpecserveError(f"can only tokenize text, got {type(text).__name__}")
        backend = self._backend if parse_special else self._plain_backend()
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    # -- decoding ---------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> None:
        try:
            valid = not isinstance(token_id, bool) and 0 <= operator.index(token_id) < self.vocab_size
        except TypeError:  # not an integer at all (numpy/torch integers are fine)
            valid = False
        if not valid:
            raise SpecserveError(f"invalid token id {token_id!r} (vocabulary has {self.vocab_size} tokens)")

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        for i in ids:
            self._check_id(i)
        tb = self._token_bytes
        if skip_special:
            skip = self._special_ids
            data = b"".join(tb[i] for i in ids if i not in skip)
        else:
            data = b"".join(tb[i] for i in ids)
        return data.decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the GGUF (byte-level spelling, e.g. 'Ġhello')."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token decodes to (byte-level spelling mapped back to raw bytes)."""
        self._check_id(token_id)
        return self._token_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control (or unknown) token: what `skip_special` leaves out."""
        return token_id in self._special_ids

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids


class IncrementalDecoder:
    """Turn a stream of token ids into text chunks without splitting a UTF-8 character.

    Bytes of an incomplete character are held back until the next token completes it;
    bytes that can never form a character become U+FFFD, exactly as `Tokenizer.decode`
    of the whole sequence would render them. With `skip_special`, control tokens give no
    text except those in `keep` (e.g. a tool-call marker the answer's parser reads).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False, keep: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        tok = self._tokenizer
        data = tok.token_bytes(token_id)
        if self._skip_special and tok.is_special(token_id) and token_id not in self._keep:
            return ""
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
