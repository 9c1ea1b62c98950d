"""The LoRA adapters as the API sees them (llama-server's): `GET /lora-adapters` lists them with their global
scales, `POST /lora-adapters` sets those, and a request's `lora: [{id, scale}]` replaces them for that request
(an adapter it does not name: scale 0). What runs is a scale per adapter on each task (Task.adapters); the
adapters themselves are loaded with the model (model/lora.py)."""

from __future__ import annotations

import threading

from specserve.errors import SpecserveError
from specserve.server.schemas import LoraScale


class LoraAdapters:
    def __init__(self, adapters: list[tuple[str, float]]):
        """adapters: (file, initial global scale), in id order."""
        self.paths = [path for path, _ in adapters]
        self._scales = [scale for _, scale in adapters]
        self._lock = threading.Lock()  # (POST /lora-adapters and request threads)

    def to_json(self) -> list[dict[str, object]]:
        with self._lock:
            return [{"id": i, "path": path, "scale": scale}
                    for i, (path, scale) in enumerate(zip(self.paths, self._scales, strict=True))]

    def _scales_of(self, items: list[LoraScale]) -> list[float]:
        scales = [0.0] * len(self.paths)
        for item in items:
            if item.id >= len(scales):
                loaded = f"ids 0..{len(scales) - 1}" if scales else "none is loaded (--lora)"
                raise SpecserveError(f"lora: no adapter has id {item.id} ({loaded})")
            scales[item.id] = item.scale
        return scales

    def set_global(self, items: list[LoraScale]) -> None:
        """POST /lora-adapters: the scales requests without a `lora` field get."""
        scales = self._scales_of(items)
        with self._lock:
            self._scales = scales

    def for_request(self, items: list[LoraScale] | None) -> tuple[float, ...]:
        """A task's scales: the request's (None: the global ones); () when every scale is 0."""
        if items is None:
            with self._lock:
                scales = list(self._scales)
        else:
            scales = self._scales_of(items)
        return tuple(scales) if any(scales) else ()
