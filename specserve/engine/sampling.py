"""Token sampling with llama.cpp's sampler chain, and sample-and-compare draft verification.

Chain order (llama-server defaults): penalties -> top_k -> top_p -> min_p -> temperature -> dist.
Greedy (temperature <= 0, or top_k == 1) is the argmax after penalties: the later filters all
keep the top token, so they cannot change it.

Randomness is counter-based: the token at generated position n is drawn with a generator
seeded from (seed, n). Drafts only decide *when* a position gets computed, never the noise it
gets, so with the same seed the text is identical with or without speculation, and the
emitted tokens follow the target's distribution exactly whatever the draft was.
"""

from __future__ import annotations

import math
import secrets
from array import array
from collections import deque
from dataclasses import dataclass

import torch

from specserve.errors import SpecserveError

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: nearby inputs give unrelated seeds (seed s, pos n+1 != seed s+1, pos n)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request for several (n > 1): choice 0 keeps the request's (so n = 1
    gives the same text), each other choice an unrelated one drawn from (seed, choice); -1 stays random."""
    if seed == -1 or choice == 0:
        return seed
    return _mix64(seed ^ _mix64(choice))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """Per-request sampling options; names and defaults follow llama.cpp."""

    temperature: float = 0.8  # <= 0 means greedy (argmax after penalties)
    top_k: int = 40  # <= 0 disables
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # 0 disables penalties, -1 = whole history
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = -1  # -1 = random seed

    def validate(self) -> SamplingParams:
        """Raise SpecserveError naming the first bad field; return self."""
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value):
                raise SpecserveError(f"sampling {name} must be a finite number, got {value!r}")
        for name in ("top_k", "repeat_last_n", "seed"):
            value = getattr(self, name)
            if not _is_int(value):
                raise SpecserveError(f"sampling {name} must be an integer, got {value!r}")
        for name in ("top_p", "min_p"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SpecserveError(f"sampling {name} = {value} is out of range [0, 1]")
        if self.repeat_penalty <= 0.0:
            raise SpecserveError(f"sampling repeat_penalty = {self.repeat_penalty} must be > 0")
        if self.repeat_last_n < -1:
            raise SpecserveError(f"sampling repeat_last_n = {self.repeat_last_n} must be >= -1 (-1 = whole history)")
        if not -1 <= self.seed <= _MASK64:
            raise SpecserveError(f"sampling seed = {self.seed} is out of range [-1, 2^64 - 1] (-1 = random)")
        return self

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax after penalties (no randomness involved)."""
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """True when the penalty stage changes logits (llama.cpp skips it otherwise)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )


def _push(window: deque[int], counts: dict[int, int], limit: int, token: int) -> None:
    """Append a token to the penalty window, evicting the oldest when it holds `limit` (-1: no limit)."""
    if limit > 0 and len(window) == limit:
        old = window.popleft()
        left = counts[old] - 1
        if left:
            counts[old] = left
        else:
            del counts[old]
    window.append(token)
    counts[token] = counts.get(token, 0) + 1


class Sampler:
    """One per slot: holds the penalty history and the seeded generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params.validate()
        # Each token is the argmax of its logits (greedy, no penalties), so a caller holding the argmax of many rows
        # at once (one transfer for a whole batch) can pass them to `accept`. (Read per row of every step: kept.)
        self.argmax_only = self.params.greedy and not self.params.penalized
        self._generator: torch.Generator | None = None
        self._window: deque[int] = deque()  # last repeat_last_n tokens of the history
        self._counts: dict[int, int] = {}  # token -> occurrences in _window
        self.n_sampled = 0  # tokens emitted since reset(); indexes the per-position noise
        self.seed = 0  # the seed in use (a fresh random one per reset() when params.seed == -1)
        self._seed_hash = 0
        self.reset([])

    def reset(self, prompt: list[int]) -> None:
        """Start a new generation: penalty history := prompt (as llama-server feeds it), noise from position 0."""
        p = self.params
        # -1 draws a fresh seed per generation; a fixed seed repeats the same text.
        self.seed = secrets.randbits(64) if p.seed == -1 else p.seed
        self._seed_hash = _mix64(self.seed)
        self.n_sampled = 0
        self._window.clear()
        self._counts.clear()
        if p.penalized:
            tail = prompt if p.repeat_last_n < 0 else prompt[-p.repeat_last_n :]
            for token in tail:
                _push(self._window, self._counts, p.repeat_last_n, int(token))

    def sample(self, logits: torch.Tensor) -> int:
        """Sample one token from a 1-D logits row, record it in the history and return it."""
        if logits.dim() != 1:
            raise ValueError(f"sample() wants 1-D logits [vocab], got shape {tuple(logits.shape)}")
        if self.argmax_only:
            token = int(logits.argmax().item())  # the hot path: one op, one sync
        else:
            token = int(self._sample_rows(logits.unsqueeze(0), []).item())
        self._record([token])
        return token

    def sample_and_verify(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Sample-and-compare over [len(draft)+1, vocab] logits; return accepted draft + one sampled token.

        Row i is sampled as if draft[:i] were accepted (that is the only case in which row i is
        used), so all rows go through the device in one batch and come back in one transfer.
        """
        if logits.dim() != 2 or logits.shape[0] != len(draft) + 1:
            raise ValueError(
                f"sample_and_verify() wants logits [{len(draft) + 1}, vocab] for a draft of {len(draft)}, "
                f"got shape {tuple(logits.shape)}"
            )
        sampled = logits.argmax(dim=-1).tolist() if self.argmax_only else self._sample_rows(logits, draft).tolist()
        return self.accept(sampled, draft)

    def accept(self, sampled: list[int], draft: list[int]) -> list[int]:
        """Token i sampled from row i (as if draft[:i] were accepted) -> the accepted draft prefix
        plus one new token; recorded for the penalties."""
        out: list[int] = []
        for i, token in enumerate(sampled):
            out.append(int(token))
            if i == len(draft) or token != draft[i]:
                break
        self._record(out)
        return out

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities [vocab] that sample() would draw from now (after penalties and the chain).

        Records nothing. Greedy gives a one-hot row. Used for n_probs-style reports and by tests.
        """
        if logits.dim() != 1:
            raise ValueError(f"distribution() wants 1-D logits [vocab], got shape {tuple(logits.shape)}")
        rows = self._penalized(logits.unsqueeze(0), [])
        if self.params.greedy:
            probs = torch.zeros_like(rows)
            return probs.scatter_(-1, rows.argmax(dim=-1, keepdim=True), 1.0).squeeze(0)
        vals, idx = self._filter(rows)
        probs = torch.softmax(vals, dim=-1)
        if idx is not None:
            probs = torch.zeros_like(rows).scatter_(-1, idx, probs)
        return probs.squeeze(0)

    # -- internals -------------------------------------------------------------------------------

    def _record(self, tokens: list[int]) -> None:
        p = self.params
        if p.penalized:
            for token in tokens:
                _push(self._window, self._counts, p.repeat_last_n, token)
        self.n_sampled += len(tokens)

    def _penalized(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        rows = logits.float()
        return self._apply_penalties(rows, draft) if self.params.penalized else rows

    def _sample_rows(self, logits: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """Tokens [rows] (on the logits' device): row i after the history plus draft[:i]."""
        rows = self._penalized(logits, draft)
        if self.params.greedy:
            return rows.argmax(dim=-1)
        vals, idx = self._filter(rows)
        # Exponential race (Gumbel-max): argmax(log p - log E) picks j with probability p_j,
        # without multinomial's extra passes. Masked entries are -inf and stay out.
        noise = self._noise(vals.shape[0], vals.shape[1], vals.device)
        pos = (vals - noise.log()).argmax(dim=-1, keepdim=True)
        return (pos if idx is None else idx.gather(-1, pos)).squeeze(-1)

    def _apply_penalties(self, rows: torch.Tensor, draft: list[int]) -> torch.Tensor:
        """llama.cpp penalties over the last repeat_last_n tokens; row i also counts draft[:i]."""
        p = self.params
        window, counts = deque(self._window), dict(self._counts)
        vocab = rows.shape[-1]
        flat: list[int] = []  # row * vocab + token, so plain 1-D take/put do the indexing
        occurrences: list[int] = []
        for i in range(rows.shape[0]):
            if i > 0:
                _push(window, counts, p.repeat_last_n, int(draft[i - 1]))
            flat.extend(i * vocab + t for t in counts)
            occurrences.extend(counts.values())
        if not flat:
            return rows
        # One host->device copy for all (position, count) pairs; array() converts ~10x faster than torch.tensor(list).
        pairs = torch.frombuffer(array("q", flat + occurrences), dtype=torch.long).to(rows.device)
        index, count = pairs[: len(flat)], pairs[len(flat) :].to(rows.dtype)
        out = rows.contiguous().clone()  # .float() may have returned the caller's tensor
        vals = out.view(-1).take(index)
        # Dividing a negative logit would make the token *more* likely, so those are multiplied.
        vals = torch.where(vals <= 0, vals * p.repeat_penalty, vals / p.repeat_penalty)
        vals = vals - count * p.frequency_penalty - p.presence_penalty  # every listed count is > 0
        out.view(-1).put_(index, vals)
        return out

    def _filter(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """top_k -> top_p -> min_p -> temperature; returns (scaled logits, -inf where cut; vocab ids or None)."""
        p = self.params
        vocab = rows.shape[-1]
        idx: torch.Tensor | None
        if 0 < p.top_k < vocab:
            vals, idx = torch.topk(rows, p.top_k, dim=-1)  # sorted, descending
        elif p.top_p < 1.0 or p.min_p > 0.0:
            vals, idx = torch.sort(rows, dim=-1, descending=True)
        else:
            vals, idx = rows, None  # nothing needs the order
        if p.top_p < 1.0:
            probs = torch.softmax(vals, dim=-1)
            # Keep the shortest prefix whose mass reaches top_p, the crossing token included:
            # token j stays while the mass *before* it is still < top_p (and token 0 always stays).
            before = torch.nn.functional.pad(probs.cumsum(dim=-1)[..., :-1], (1, 0))
            cut = before >= p.top_p
            cut[..., 0] = False
            vals = vals.masked_fill(cut, -math.inf)
        if p.min_p > 0.0:
            # p_j >= min_p * p_max  <=>  logit_j >= logit_max + log(min_p); vals[..., 0] is the max.
            vals = vals.masked_fill(vals < vals[..., :1] + math.log(p.min_p), -math.inf)
        return vals / p.temperature, idx

    def _noise(self, n_rows: int, width: int, device: torch.device) -> torch.Tensor:
        """Exp(1) noise [n_rows, width]; row i belongs to generated position n_sampled + i."""
        gen = self._generator
        if gen is None or gen.device != device:
            gen = self._generator = torch.Generator(device=device)
        noise = torch.empty((n_rows, width), dtype=torch.float32, device=device)
        for i in range(n_rows):
            # Seeding per position makes the noise independent of how positions were batched.
            gen.manual_seed(_mix64(self._seed_hash + self.n_sampled + i) & ((1 << 63) - 1))
            noise[i].exponential_(generator=gen)
        # An exact 0 would turn a masked -inf into NaN (and NaN wins argmax).
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)
