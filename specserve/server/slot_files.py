"""POST /slots/{id}?action=save|restore|erase, as llama-server: save writes the slot's tokens and K/V to
--slot-save-path/{filename}, restore loads them back (a prompt starting with those tokens then reuses
them), erase empties the slot's cache. Without --slot-save-path every action is 501. The work is a slot
job (engine/slot_jobs.py): it runs on the scheduler's thread once the slot is idle."""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

from starlette.concurrency import run_in_threadpool

from specserve.engine import slot_state
from specserve.errors import NotSupported, SpecserveError
from specserve.server.engine import Engine
from specserve.server.schemas import parse_body
from specserve.server.utility_schemas import SlotFileRequest

_RESERVED = set('/\\:*?"<>|')


def checked_filename(name: str) -> str:
    """A plain file name (llama.cpp's fs_validate_filename, in spirit): no directories, no tricks."""
    bad = (name in (".", "..") or name != name.strip() or name.endswith(".") or any(c in _RESERVED for c in name)
           or any(ord(c) < 32 or ord(c) == 127 for c in name))
    if bad:
        raise SpecserveError("Invalid filename")
    return name


async def slot_action(engine: Engine, id_slot: str, action: str, body: bytes) -> dict[str, Any]:
    if engine.settings.slot_save_path is None:
        raise NotSupported("This server does not support slots action. Start it with `--slot-save-path`")
    try:
        slot_id = int(id_slot)
    except ValueError:
        raise SpecserveError("Invalid slot ID") from None
    await run_in_threadpool(engine.core.wake)  # (--sleep-idle-seconds: off the event loop)
    if action == "erase":
        n = await asyncio.wrap_future(engine.core.submit_job(slot_state.erase, slot_id))
        return {"id_slot": slot_id, "n_erased": n}
    if action not in ("save", "restore"):
        raise SpecserveError(f"Invalid action {action!r} (save, restore or erase)")
    req = await run_in_threadpool(parse_body, SlotFileRequest, body)
    path = Path(engine.settings.slot_save_path) / checked_filename(req.filename)
    model = engine.slot_model()
    t0 = time.perf_counter()
    work = functools.partial(slot_state.save if action == "save" else slot_state.restore, path=path, model=model)
    n_tokens, n_bytes = await asyncio.wrap_future(engine.core.submit_job(work, slot_id))
    ms = (time.perf_counter() - t0) * 1000
    if action == "save":
        return {"id_slot": slot_id, "filename": req.filename, "n_saved": n_tokens, "n_written": n_bytes,
                "timings": {"save_ms": ms}}
    return {"id_slot": slot_id, "filename": req.filename, "n_restored": n_tokens, "n_read": n_bytes,
            "timings": {"restore_ms": ms}}
