"""The CUDA GEMV's build bookkeeping (runs anywhere: the NVRTC build is replaced by a stand-in)."""

from __future__ import annotations

import pytest

from specserve.kernels import linear_cuda


def test_one_request_builds_every_row_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple] = []

    def fake_build(device: int, key: tuple) -> tuple:
        built.append(key)
        return ("kernel", key)

    monkeypatch.setattr(linear_cuda, "_build", fake_build)
    monkeypatch.setattr(linear_cuda, "_builds", {})
    monkeypatch.setattr(linear_cuda.torch.cuda, "current_device", lambda: 0)
    key = (4, 4, 3, 2, 1, 1, True, False, False)
    assert linear_cuda._kernel(*key) == ("kernel", key)
    assert linear_cuda._kernel(4, 4, 8, 2, 1, 1, True, False, False)[1][2] == 8
    linear_cuda.prebuild([(8, 4, 1, 2, 1, 1, False, False, True)])
    rows = sorted(key[2] for key in built if key[0] == 4)
    assert rows == list(range(1, 17))  # all 16 row counts of the first variant, each built once
    assert (8, 4, 1, 2, 1, 1, False, False, True) in built and len(built) == 17
