"""The server's settings (what `specserve serve`'s flags set) and their checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve import catalog
from specserve.engine.loading import RemoteOptions
from specserve.engine.local_runner import DEFAULT_CTX, checked_device
from specserve.engine.sampling import SamplingParams
from specserve.engine.slot_state import POOLINGS
from specserve.errors import SpecserveError
from specserve.gguf.reader import GGUFFile
from specserve.kernels.kv_format import KVTypes
from specserve.model.lora import check_adapter_files
from specserve.model.registry import read_config
from specserve.server.reasoning import FORMATS as REASONING_FORMATS
from specserve.speculative.base import SpecParams
from specserve.speculative.shared_suffix import DEFAULT_TOKENS


@dataclass
class ServerSettings:
    model: str | None = None  # catalog name or GGUF path; None = the default model
    model_draft: str | None = None
    # -c: KV positions all slots share (a paged pool), each slot able to reach all of them; None: 4096 a slot at
    # most (the model's training context if shorter), a pool of that times the slots
    ctx_size: int | None = None
    n_parallel: int = 4
    prefix_cache: bool = True  # full KV blocks cached by content across slots and tasks (kv_room.py)
    n_batch: int = 512
    adaptive_drafts: bool = True  # the draft gate (engine/draft_gate.py); False: slots draft whenever they can
    chain_drafts: bool = True  # past the gate's slot count, drafts ride chained steps; False: none drafts there
    # ngram-suffix also drafts from earlier requests of the same scope: tokens they keep in all (0: off)
    spec_shared_tokens: int = DEFAULT_TOKENS
    n_predict: int = -1
    device: str | None = None
    weight_format: str = "auto"  # see specserve.model.weights.WEIGHT_FORMATS
    kv_types: KVTypes = (None, None)  # -ctk, -ctv (kernels/kv_format.py; None: the compute dtype)
    draft_kv_types: KVTypes = (None, None)  # -ctkd, -ctvd
    remote: RemoteOptions | None = None  # run the model on a remote host
    tensor_parallel: int = 1  # ranks the model is split over (engine/tp_runner.py)
    alias: str | None = None  # names the API shows and accepts, comma-separated (the first is shown)
    tags: list[str] = field(default_factory=list)  # informational, shown by /v1/models (llama-server's --tags)
    chat_template: str | None = None  # Jinja text replacing the GGUF's template (--chat-template[-file])
    mmap: bool = True  # read the GGUF through a memory map; False: into memory at load (--no-mmap)
    endpoint_slots: bool = True  # GET /slots (llama-server's --slots / --no-slots)
    endpoint_metrics: bool = False  # GET /metrics (llama-server's --metrics: off unless asked for)
    lora: list[tuple[str, float]] = field(default_factory=list)  # LoRA adapter files and their first scales
    # -cram: MiB of host memory for prompt caches the KV pool gives up (engine/host_cache.py); -1 no limit, 0 none;
    # None: 8192 where the pool is on a GPU, none on the CPU (where the pool is host memory already)
    cache_ram: int | None = None
    sleep_idle_seconds: float = -1  # let the model go after this long without work, load it for the next (-1: never)
    context_shift: bool = False  # --context-shift: a generation that fills its context drops old tokens, goes on
    verbose: bool = False  # -v/--verbose: debug logs, and OpenAI answers carry `__verbose` (llama-server's)
    webui: bool = True  # the chat page at / (llama-server's --webui / --no-webui)
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413
    max_queue: int = 256  # generation requests waiting for a slot; more get 503
    responses_store: int = 256  # past /v1/responses kept for previous_response_id (responses_store.py); 0: none
    cors_origins: list[str] = field(default_factory=lambda: ["*"])  # browser origins allowed; [] = no CORS
    slot_save_path: str | None = None  # directory of /slots save/restore files; None: those actions are 501
    pooling: str | None = None  # embeddings: "mean" or "last"; None: the GGUF's pooling_type if one of them, else mean
    reasoning_format: str = "auto"  # --reasoning-format: how a chat answer's reasoning is split (reasoning.py)
    reasoning_budget: int = -1  # --reasoning-budget: -1 unlimited, 0 thinking off (the template's enable_thinking)
    # the scheduler and the runners in a process of their own (server/core_process.py); False: a thread here
    core_process: bool = False
    threads: int | None = None  # -t: the engine core's torch threads (None: torch's default)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)

    def host_cache_bytes(self, device_type: str) -> int:
        if self.cache_ram is None:
            return 8192 << 20 if device_type == "cuda" else 0
        return -1 if self.cache_ram < 0 else self.cache_ram << 20

    def kv_size(self) -> int | None:
        """-c: the pool's positions, which is also the most one slot may reach; None when not given."""
        if self.ctx_size is None or self.ctx_size == 0:
            return None
        if self.ctx_size < 16:
            raise SpecserveError(f"context size {self.ctx_size} is too small; give -c 16 or more")
        return self.ctx_size

    def default_kv_size(self) -> int:
        """Without -c: a pool of min(model, 4096) positions a slot (cached prefixes get none of their own: they
        keep what the slots leave). A remote host's model is not read here: 4096 a slot, the host's default
        context per sequence within it."""
        per_slot = DEFAULT_CTX
        if self.remote is None:
            gguf = GGUFFile(catalog.resolve(self.model))
            per_slot = min(read_config(gguf.metadata, set(gguf.tensor_names())).context_length,
                           DEFAULT_CTX)
        return per_slot * self.n_parallel


def check_settings(s: ServerSettings) -> None:
    if s.n_parallel < 1:
        raise SpecserveError(f"-np/--parallel must be at least 1, got {s.n_parallel}")
    if s.n_batch < 1:
        raise SpecserveError(f"-b/--batch-size must be at least 1, got {s.n_batch}")
    if s.n_predict < -1:
        raise SpecserveError(f"-n/--n-predict must be -1 (unlimited) or more, got {s.n_predict}")
    if s.ctx_size is not None and s.ctx_size < 0:
        raise SpecserveError(f"-c/--ctx-size must not be negative, got {s.ctx_size}")
    if s.max_body_bytes < 1:
        raise SpecserveError(f"--max-body-bytes must be at least 1, got {s.max_body_bytes}")
    if s.max_queue < 0:
        raise SpecserveError(f"--max-queue must not be negative, got {s.max_queue}")
    if s.spec_shared_tokens < 0:
        raise SpecserveError(f"--spec-shared-tokens must not be negative, got {s.spec_shared_tokens}")
    if s.responses_store < 0:
        raise SpecserveError(f"--responses-store must not be negative, got {s.responses_store}")
    if s.pooling is not None and s.pooling not in POOLINGS:
        raise SpecserveError(f"--pooling must be one of {', '.join(POOLINGS)}, got {s.pooling!r}")
    if s.reasoning_format not in REASONING_FORMATS:
        raise SpecserveError(f"--reasoning-format must be one of {', '.join(REASONING_FORMATS)}, "
                             f"got {s.reasoning_format!r}")
    if s.reasoning_budget not in (-1, 0):  # a token budget would need the scheduler to end the block
        raise SpecserveError(f"--reasoning-budget: only -1 (unlimited) and 0 (thinking off) are supported, "
                             f"got {s.reasoning_budget}")
    if s.slot_save_path is not None:
        try:
            Path(s.slot_save_path).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SpecserveError(f"--slot-save-path {s.slot_save_path}: {exc.strerror or exc}") from None
    if s.cache_ram is not None and s.cache_ram < -1:
        raise SpecserveError(f"-cram/--cache-ram must be -1 (no limit), 0 (off) or a size in MiB, got {s.cache_ram}")
    if s.sleep_idle_seconds != -1 and not s.sleep_idle_seconds > 0:
        raise SpecserveError(f"--sleep-idle-seconds must be -1 (never) or more than 0, got {s.sleep_idle_seconds}")
    check_adapter_files(path for path, _ in s.lora)
    if s.remote is None:  # (a remote host checks its own device)
        checked_device(s.device)
    s.sampling.validate()
    s.spec.validate()
