"""ngram-cache: 3-level n-gram statistics (context, dynamic file, static file) drafting token by token.

Semantics and file format follow llama.cpp's `common/ngram-cache.{h,cpp}` so that cache files
interoperate with its lookup-create / lookup-merge / lookup tools in both directions.

A cache maps an n-gram (a tuple of 1..4 token ids) to {next token: count}.

File format (little-endian int32 throughout), a sequence of records in any order:
    4 tokens of the n-gram (unused trailing slots = -1), number of entries k (> 0),
    then k pairs (token, count > 0).
"""

from __future__ import annotations

import os
import sys
import tempfile
from array import array
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from specserve.errors import SpecserveError
from specserve.speculative.base import SpecParams, Speculator

NgramCache = dict[tuple[int, ...], dict[int, int]]

NGRAM_MIN = 1  # context/dynamic caches hold n-grams of sizes NGRAM_MIN..NGRAM_MAX
NGRAM_MAX = 4  # also the number of token slots of a record in the file
NGRAM_STATIC = 2  # the static cache holds 2-grams only

# Draft thresholds indexed by n-gram size - 1: the total count of an n-gram must reach the
# sample size and the chosen token must have at least the given share (in percent).
MIN_SAMPLE_SIZE_LAX = (2, 2, 1, 1)
MIN_PERCENT_LAX = (66, 50, 50, 50)
MIN_SAMPLE_SIZE_STRICT = (4, 3, 2, 2)
MIN_PERCENT_STRICT = (75, 66, 66, 66)

STATIC_WEIGHT = 100  # a token the static cache also predicts weighs 100 x its static count
_EMPTY_SLOT = -1
_INT32_MAX = 2**31 - 1
_RECORD_HEADER = NGRAM_MAX + 1  # int32 words before the pairs


# ---- building and combining caches ------------------------------------------------------------


def count_ngrams(cache: NgramCache, tokens: Sequence[int], ngram_size: int, start: int, stop: int) -> None:
    """For each position i in [start, stop) with i >= ngram_size, count tokens[i] after its n-gram."""
    for i in range(max(start, ngram_size), min(stop, len(tokens))):
        ngram = tuple(tokens[i - ngram_size:i])
        token = tokens[i]
        part = cache.get(ngram)
        if part is None:
            cache[ngram] = {token: 1}
        else:
            part[token] = part.get(token, 0) + 1


def update_cache(cache: NgramCache, tokens: Sequence[int], ngram_min: int, ngram_max: int,
                 n_new: int | None = None) -> None:
    """Count, for the last `n_new` tokens (all when None), each n-gram of sizes ngram_min..ngram_max
    that precedes them. The earlier tokens only serve as the n-grams' context, so calling this
    with n_new = tokens added since the last call updates a cache incrementally."""
    size = len(tokens)
    first_new = 0 if n_new is None else max(size - n_new, 0)
    for ngram_size in range(ngram_min, ngram_max + 1):
        count_ngrams(cache, tokens, ngram_size, first_new, size)


def merge_cache(target: NgramCache, add: NgramCache) -> NgramCache:
    """Add the counts of `add` into `target` (in place); returns target."""
    for ngram, part in add.items():
        dest = target.get(ngram)
        if dest is None:
            target[ngram] = dict(part)
            continue
        for token, count in part.items():
            dest[token] = dest.get(token, 0) + count
    return target


# ---- drafting ---------------------------------------------------------------------------------


def _draft_static(part_static: dict[int, int] | None) -> int | None:
    """The static cache's own choice for the current 2-gram, with the lax threshold for size 2."""
    if not part_static:
        return None
    best_token, best_count, total = None, 0, 0
    for token, count in part_static.items():
        if count > best_count:
            best_token, best_count = token, count
        total += count
    if total < MIN_SAMPLE_SIZE_LAX[NGRAM_STATIC - 1]:
        return None
    if 100 * best_count < MIN_PERCENT_LAX[NGRAM_STATIC - 1] * total:
        return None
    return best_token


def _draft_primary(cache: NgramCache, tail: list[int], part_static: dict[int, int] | None,
                   min_sample_size: tuple[int, ...], min_percent: tuple[int, ...]) -> int | None:
    """Longest n-gram first: the token maximising count * static weight, if thresholds allow."""
    if not cache:
        return None
    static = part_static or {}
    for ngram_size in range(min(NGRAM_MAX, len(tail)), NGRAM_MIN - 1, -1):
        part = cache.get(tuple(tail[-ngram_size:]))
        if part is None:
            continue
        best_token, best_count, best_weight, total = None, 0, 0, 0
        for token, count in part.items():
            weight = STATIC_WEIGHT * static[token] if token in static else 1
            if count * weight > best_count * best_weight:
                best_token, best_count, best_weight = token, count, weight
            total += count
        if total < min_sample_size[ngram_size - 1]:
            continue
        if 100 * best_count < min_percent[ngram_size - 1] * total:
            continue
        return best_token
    return None


def draft_from_caches(inp: Sequence[int], n_draft: int, context: NgramCache, dynamic: NgramCache,
                      static: NgramCache) -> list[int]:
    """Up to n_draft tokens to follow `inp` (history + last sampled), one at a time.

    Each token: the context cache (lax thresholds), else the dynamic cache (strict), else the
    static cache alone; drafting stops at the first position where none yields a token.
    """
    if len(inp) < NGRAM_STATIC:
        return []
    tail = list(inp[-NGRAM_MAX:])  # only the last NGRAM_MAX tokens of inp + draft matter
    draft: list[int] = []
    while len(draft) < n_draft:
        part_static = static.get(tuple(tail[-NGRAM_STATIC:])) if static else None
        token = _draft_primary(context, tail, part_static, MIN_SAMPLE_SIZE_LAX, MIN_PERCENT_LAX)
        if token is None:
            token = _draft_primary(dynamic, tail, part_static, MIN_SAMPLE_SIZE_STRICT, MIN_PERCENT_STRICT)
        if token is None:
            token = _draft_static(part_static)
        if token is None:
            break
        draft.append(token)
        tail.append(token)
        if len(tail) > NGRAM_MAX:
            del tail[0]
    return draft


# ---- file format ------------------------------------------------------------------------------


def _little_endian_words(data: bytes) -> array:
    words = array("i")
    words.frombytes(data)
    if sys.byteorder != "little":
        words.byteswap()
    return words


def parse_cache(data: bytes, source: str = "lookup cache") -> NgramCache:
    """Decode the bytes of a cache file; malformed or truncated data raises SpecserveError.

    Repeated records of one n-gram (or repeated tokens in one record) have their counts added,
    so a concatenation of files reads like their merge.
    """
    if len(data) % 4:
        raise SpecserveError(f"{source}: truncated lookup cache ({len(data)} bytes is not a whole number "
                             f"of int32 values)")
    words = _little_endian_words(data)
    n_words = len(words)
    cache: NgramCache = {}
    pos = 0
    record = 0
    while pos < n_words:
        where = f"{source}: record {record} at byte {4 * pos}"
        if pos + _RECORD_HEADER > n_words:
            raise SpecserveError(f"{where}: truncated record header (file ends after {n_words - pos} of "
                                 f"{_RECORD_HEADER} int32 values)")
        slots = words[pos:pos + NGRAM_MAX]
        size = 0
        while size < NGRAM_MAX and slots[size] != _EMPTY_SLOT:
            size += 1
        if size == 0 or any(t < 0 for t in slots[:size]) or any(t != _EMPTY_SLOT for t in slots[size:]):
            raise SpecserveError(f"{where}: malformed n-gram {list(slots)} (expected 1..{NGRAM_MAX} token ids "
                                 f">= 0, unused slots -1 at the end)")
        n_entries = words[pos + NGRAM_MAX]
        if n_entries <= 0:
            raise SpecserveError(f"{where}: malformed record, number of entries is {n_entries} (must be > 0)")
        pos += _RECORD_HEADER
        if pos + 2 * n_entries > n_words:
            raise SpecserveError(f"{where}: truncated record, {n_entries} entries announced but only "
                                 f"{(n_words - pos) // 2} present")
        ngram = tuple(slots[:size])
        part = cache.setdefault(ngram, {})
        for i in range(pos, pos + 2 * n_entries, 2):
            token, count = words[i], words[i + 1]
            if token < 0 or count <= 0:
                raise SpecserveError(f"{where}: malformed entry (token {token}, count {count}); token ids "
                                     f"must be >= 0 and counts > 0")
            part[token] = part.get(token, 0) + count
        pos += 2 * n_entries
        record += 1
    return cache


def load_cache(path: str | os.PathLike[str]) -> NgramCache:
    """Read a cache file written by us or by llama.cpp."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise SpecserveError(f"lookup cache not found: {path}") from None
    except OSError as exc:
        raise SpecserveError(f"cannot read lookup cache {path}: {exc.strerror or exc}") from None
    return parse_cache(data, str(path))


def serialize_cache(cache: NgramCache) -> bytes:
    words = array("i")
    for ngram, part in cache.items():
        if not part:
            continue
        if not 1 <= len(ngram) <= NGRAM_MAX:
            raise ValueError(f"n-gram {ngram} does not fit a cache record (1..{NGRAM_MAX} tokens)")
        words.extend(ngram)
        words.extend([_EMPTY_SLOT] * (NGRAM_MAX - len(ngram)))
        words.append(len(part))
        for token, count in part.items():
            words.append(token)
            words.append(min(count, _INT32_MAX))  # int32 on disk: saturate rather than wrap
    if sys.byteorder != "little":
        words.byteswap()
    return words.tobytes()


def save_cache(cache: NgramCache, path: str | os.PathLike[str]) -> None:
    """Write atomically (temp file + rename) so a crash never leaves a truncated cache behind."""
    target = Path(path)
    data = serialize_cache(cache)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent or Path("."))
    except OSError as exc:
        raise SpecserveError(f"cannot write lookup cache {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise SpecserveError(f"cannot write lookup cache {path}: {exc.strerror or exc}") from None


# ---- the speculator ---------------------------------------------------------------------------


def _file_stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


@lru_cache(maxsize=4)
def _shared_static(path: Path, stamp: tuple[int, int] | None) -> NgramCache:
    """A static cache file, loaded once for all speculators (slots) that use it: it is only read.
    Keyed by the file's mtime and size, so a rewritten file is loaded again."""
    return load_cache(path)


class NgramCacheSpeculator(Speculator):
    """The `ngram-cache` type: drafts from the context cache, the dynamic file, the static file.

    The context cache covers the current generation (prompt + accepted tokens) and is updated
    incrementally with only the tokens that arrived since the last draft() call. At end() it is
    merged into the dynamic cache, which is saved back to `lookup_cache_dynamic` (if given).
    """

    name = "ngram_cache"

    def __init__(self, params: SpecParams):
        super().__init__()
        self.static: NgramCache = {}
        self.dynamic: NgramCache = {}
        self.context: NgramCache = {}
        self.static_path = Path(params.lookup_cache_static) if params.lookup_cache_static else None
        self.dynamic_path = Path(params.lookup_cache_dynamic) if params.lookup_cache_dynamic else None
        if self.static_path is not None:
            if not self.static_path.is_file():
                raise SpecserveError(f"static lookup cache not found: {self.static_path}")
            self.static = _shared_static(self.static_path, _file_stamp(self.static_path))
        self._dynamic_stamp: tuple[int, int] | None = None  # file state the in-memory cache matches
        if self.dynamic_path is not None and self.dynamic_path.exists():
            self.dynamic = load_cache(self.dynamic_path)
            self._dynamic_stamp = _file_stamp(self.dynamic_path)
        self._seen: list[int] = []  # the tokens the context cache has counted, in order

    def begin(self, prompt: list[int]) -> None:
        self.context = {}
        self._seen = []
        self._feed(prompt)

    def _feed(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        self._seen.extend(tokens)
        update_cache(self.context, self._seen, NGRAM_MIN, NGRAM_MAX, n_new=len(tokens))

    def _sync_context(self, history: list[int], last_sampled: int) -> None:
        """Count the tokens of history + [last_sampled] that the context cache has not seen yet."""
        n_seen = len(self._seen)
        n_total = len(history) + 1
        overlap = min(n_seen, len(history))
        # Cheap consistency check on the last few shared tokens; a different sequence (no begin()
        # for a new generation) restarts the context cache rather than mixing two sequences.
        lo = max(overlap - NGRAM_MAX, 0)
        if n_total < n_seen or history[lo:overlap] != self._seen[lo:overlap]:
            self.context = {}
            self._seen = []
            n_seen = 0
        if n_seen < len(history):
            self._feed(history[n_seen:])
            n_seen = len(self._seen)
        if n_seen == len(history):
            self._feed([last_sampled])
        elif self._seen[-1] != last_sampled:  # same length: only the last token could differ
            self.context = {}
            self._seen = []
            self._feed(history)
            self._feed([last_sampled])

    def _propose(self, history: list[int], last_sampled: int, n_max: int) -> list[int]:
        self._sync_context(history, last_sampled)
        return draft_from_caches(self._seen, n_max, self.context, self.dynamic, self.static)

    def end(self, history: list[int]) -> None:
        """Fold this generation into the dynamic cache and save it (if a file was given). (What the context cache
        learned from the drafts: `history` is not read.)"""
        if not self.context:
            return
        if self.dynamic_path is not None:
            stamp = _file_stamp(self.dynamic_path)
            if stamp is not None and stamp != self._dynamic_stamp:
                # Another speculator (another slot) saved since we loaded: build on its version.
                self.dynamic = load_cache(self.dynamic_path)
        merge_cache(self.dynamic, self.context)
        self.context = {}
        self._seen = []
        if self.dynamic_path is not None:
            save_cache(self.dynamic, self.dynamic_path)
            self._dynamic_stamp = _file_stamp(self.dynamic_path)
