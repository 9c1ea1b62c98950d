"""The CUDA GEMV's sources, build bookkeeping and block shapes (runs anywhere: the NVRTC build is replaced
by a stand-in)."""

from __future__ import annotations

import re

import pytest
import torch

from specserve.kernels import quant_cuda
from specserve.kernels.cuda import block_shapes, build


def test_one_request_builds_every_row_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple] = []

    def fake_build(device: int, key: tuple) -> tuple:
        built.append(key)
        return ("kernel", key)

    monkeypatch.setattr(build, "_build", fake_build)
    monkeypatch.setattr(build, "_builds", {})
    monkeypatch.setattr(build.torch.cuda, "current_device", lambda: 0)
    key = ("gemv_mma", 4, 32, 3, 2, 1, 4, True, False, False, False, False)
    assert build.kernel(key) == ("kernel", key)
    assert build.kernel(("gemv_mma", 4, 32, 8, 2, 1, 4, True, False, False, False, False))[1][3] == 8
    other = ("gemv_q", 8, 4, 1, 2, 1, 1, False, False, True)
    build.prebuild([other])
    for future in list(build._builds.values()):  # the siblings build in a pool: wait for them all
        future.result()
    rows = sorted(key[3] for key in built if key[0] == "gemv_mma")
    assert rows == list(range(1, 17))  # all 16 row counts of the first variant, each built once
    assert other in built and len(built) == 17


def test_first_request_builds_the_keys_each_row_count_will_ask_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where blocks depend on the row count, the siblings built ahead are the keys those row counts
    will take (sibling(rows)), not copies of this key with another M."""
    built: list[tuple] = []
    monkeypatch.setattr(build, "_build", lambda device, key: built.append(key) or ("kernel", key))
    monkeypatch.setattr(build, "_builds", {})
    monkeypatch.setattr(build.torch.cuda, "current_device", lambda: 0)

    def sibling(rows: int) -> tuple:
        return ("gemv_mma", 4, 32, rows, 2 if rows == 1 else 4)

    build.kernel(sibling(1), sibling)
    for future in list(build._builds.values()):  # (the other 15 build in a pool: the test waits for them)
        future.result()
    assert sorted(built) == sorted(sibling(rows) for rows in range(1, 17))
    assert build.kernel(sibling(9), sibling) == ("kernel", sibling(9)) and len(built) == 16  # built already


def test_every_kernel_source_takes_its_parameters() -> None:
    """Each parameter a kernel's key names appears in its source, and a filled-in source has no
    placeholder left (a parameter missing from KERNELS would reach NVRTC as an unknown name)."""
    for name, names in build.KERNELS.items():
        source = build.read_source(f"{name}.cu")
        assert all(f"__{param}__" in source for param in names)
        src = build.kernel_source((name, *range(3, 3 + len(names))))
        assert not set(re.findall(r"__[A-Z][A-Z0-9_]*__", src)) - {"__CUDA_ARCH__"}  # CUDA's own macro stays
        assert "#define M 5" in src  # M is the third parameter: filled with the third value


def test_rmsnorm_folds_in_only_where_sixteen_rows_stage_whole() -> None:
    """RMSNorm needs whole rows staged: norm_fusable says yes only where one chunk of 16 rows, with
    both arrays of per-group sums beside it, fits the shared memory the kernel asks for."""
    from specserve.kernels.quant_weight import QuantWeight

    def weight(n: int, k: int) -> QuantWeight:
        return QuantWeight(torch.zeros(n, k // 8, dtype=torch.int32), torch.zeros(n, k // 32, 2), 4, 32)

    fusable = {k: quant_cuda.norm_fusable(weight(17920, k)) for k in (1536, 4096, 6144, 8192, 65536)}
    assert fusable == {1536: True, 4096: True, 6144: False, 8192: False, 65536: False}
    for k in (1536, 4096):  # what the launch then asks for: all of K in one chunk, both sum arrays beside it
        cfg = block_shapes.pick_mma_blocks(17920, k)
        cg, row_bytes = block_shapes.mma_chunk(16, k, 32, cfg["D"] * cfg["KSPLIT"] * 4, sums=2)
        assert cg * 32 >= k and 16 * row_bytes + cg * 64 * 2 <= block_shapes.MMA_SMEM_BYTES


def test_block_shapes_keep_the_summation_order_across_row_counts() -> None:
    """Only which warps share a block (TILES) and the register bound (MINB) may follow the row count:
    KSPLIT, D and KC (blocks of a cluster splitting K) set the order of a row's sums, which decode and
    verify steps must share; down's shape splits K across a cluster where clusters exist."""
    def order(cfg: dict[str, int]) -> tuple[int, int, int]:
        return cfg["KSPLIT"], cfg["D"], cfg.get("KC", 1)

    shapes = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536), (5120, 2048), (2048, 4096),
              (151936, 2048))
    for clusters in (False, True):
        for q8 in (False, True):
            for n, k in shapes:
                one = block_shapes.pick_mma_blocks(n, k, 1, clusters, q8)
                for rows in range(2, 17):
                    got = block_shapes.pick_mma_blocks(n, k, rows, clusters, q8)
                    assert order(got) == order(one), (n, k, rows, q8)
    assert block_shapes.pick_mma_blocks(1536, 8960, 1, True)["KC"] == 4
    assert order(block_shapes.pick_mma_blocks(1536, 8960, 1, False)) == (16, 2, 1)


def test_register_bound_aims_at_one_wave_within_what_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """One wave where the registers allow it, never under 64 registers a thread, never more blocks
    than the shared memory holds (an H200: 132 SMs, 228 KB each)."""
    monkeypatch.setattr(block_shapes, "sm_resources", lambda device: (132, 228 * 1024))
    assert block_shapes.one_wave_blocks(96, 512, 150_000, 0) == 1  # down: one wave anyway
    assert block_shapes.one_wave_blocks(560, 128, 37_000, 0) == 5  # gate_up, 8 rows
    assert block_shapes.one_wave_blocks(560, 128, 66_000, 0) == 3  # 16 rows: shared memory holds 3
    assert block_shapes.one_wave_blocks(1187, 512, 10_000, 0) == 2  # output: 64 registers at least


def test_sources_ship_as_package_data() -> None:
    """The CUDA C files sit in the package (read through importlib.resources, not a path beside the
    checkout), and pyproject.toml declares them, so a non-editable install ships them too."""
    import tomllib
    from importlib import resources
    from pathlib import Path

    files = ["common.cuh", *(f"{name}.cu" for name in build.KERNELS)]
    package = resources.files("specserve.kernels.cuda")
    assert all(package.joinpath(name).is_file() for name in files)
    assert build.common_source() in build.kernel_source(("gemv_q", 4, 4, 1, 1, 1, 1, False, False, False))
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    declared = pyproject["tool"]["setuptools"]["package-data"]["specserve.kernels.cuda"]
    assert all(any(Path(name).match(pattern) for pattern in declared) for name in files)


def test_launched_variants_fill_every_placeholder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key a product asks for (both kernels, each fusion, 1..16 rows, with and without clusters)
    gives a source with no placeholder left; the launches are recorded, not run."""
    from specserve.kernels.quant_weight import QuantWeight
    from specserve.kernels.rope import RopeWrite

    keys: list[tuple] = []

    def stand_in(key: tuple, sibling: object = None) -> None:
        keys.append(key)

    monkeypatch.setattr(build, "kernel", stand_in)
    monkeypatch.setattr(build, "launch", lambda *args, **kwargs: None)
    monkeypatch.setattr(block_shapes, "sm_resources", lambda device: (132, 228 * 1024))

    def weight(n: int, k: int, bits: int, group: int, u_max: int) -> QuantWeight:
        return QuantWeight(torch.zeros(1, 1, dtype=torch.int32).expand(n, k * bits // 32),
                           torch.zeros(1, 1, 2).expand(n, k // group, 2), bits, group, u_max)

    heads, kv, head_dim, k = 4, 2, 64, 256
    wqkv = weight((heads + 2 * kv) * head_dim, k, 4, 32, 15)
    caches = torch.zeros(2, 1, kv, 8, head_dim, dtype=torch.bfloat16)
    cos = torch.zeros(8, head_dim // 2)
    norm = (torch.ones(k, dtype=torch.bfloat16), 1e-6)
    for clusters in (False, True):
        monkeypatch.setattr(build, "sm90", lambda device, on=clusters: on)
        for rows in range(1, 17):
            x = torch.zeros(rows, k, dtype=torch.bfloat16)
            pos = torch.zeros(rows, dtype=torch.long)
            rope = RopeWrite(cos, cos, pos, pos, caches[0], caches[1], heads, kv, "neox")
            quant_cuda.gemv(x, wqkv, None, False, torch.bfloat16, kernel="gemv_mma", norm=norm, rope=rope)
            quant_cuda.gemv(x, weight(512, k, 8, 16, 63), None, False, torch.bfloat16, kernel="gemv_mma",
                            swiglu_output=True, norm=norm)
            quant_cuda.gemv(x, weight(96, k, 8, 32, 255), None, False, torch.bfloat16, kernel="gemv_mma",
                            add_to=torch.zeros(rows, 96, dtype=torch.bfloat16))
            quant_cuda.gemv(torch.zeros(rows, 8960, dtype=torch.bfloat16), weight(96, 8960, 4, 32, 15), None, False,
                            torch.bfloat16, kernel="gemv_mma")  # down's shape: K split across a cluster
            quant_cuda.gemv(torch.zeros(rows, 2 * k, dtype=torch.bfloat16), weight(40, k, 4, 16, 15),
                            torch.zeros(40, dtype=torch.bfloat16), True, torch.float32, kernel="gemv_q")
    assert {key[0] for key in keys} == {"gemv_mma", "gemv_q"} and len(keys) == 2 * 16 * 5
    # KC: clusters split down's K in four, a q8 product's in two
    assert {key[-2] for key in keys if key[0] == "gemv_mma"} == {1, 2, 4}
    ids = torch.zeros(3, 8, dtype=torch.long)  # mixture-of-experts pairs: 3 tokens x 8 slots of 4 experts
    act = quant_cuda.expert_gemv(torch.zeros(3, k, dtype=torch.bfloat16), ids, weight(4 * 64, k, 4, 32, 15), 4,
                                 torch.bfloat16, by_token=True, swiglu_output=True)
    assert act.shape == (24, 32)
    quant_cuda.expert_gemv(act, ids, weight(4 * k, 32, 8, 32, 255), 4, torch.float32, by_token=False)
    assert [key[-1] for key in keys[-2:]] == [8, 1]  # EXPERTS: x rows per pair divisor
    for key in set(keys):
        assert not set(re.findall(r"__[A-Z][A-Z0-9_]*__", build.kernel_source(key))) - {"__CUDA_ARCH__"}, key


@pytest.fixture
def recorded_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """(key, grid) of every launch, none run: an sm_90 device with 132 SMs, no PDL."""
    launches: list[tuple] = []
    monkeypatch.setattr(build, "kernel", lambda key, sibling=None: key)
    monkeypatch.setattr(build, "launch", lambda built, grid, *args, **kwargs: launches.append((built, grid)))
    monkeypatch.setattr(block_shapes, "sm_resources", lambda device: (132, 228 * 1024))
    monkeypatch.setattr(build, "sm90", lambda device: True)
    monkeypatch.setattr(build, "pdl_enabled", lambda device: False)
    return launches


def q4_weight(n: int, k: int) -> object:
    """An [n, k] Q4 weight of zeros (expanded views: no memory), for recorded launches."""
    from specserve.kernels.quant_weight import QuantWeight

    words, scales = torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, 1, 2)
    return QuantWeight(words.expand(n, k // 8), scales.expand(n, k // 32, 2), 4, 32, 15)


def test_rows_past_sixteen_launch_once_for_their_whole_slices(recorded_launches: list[tuple]) -> None:
    """A 40-row product: one launch of two 16-row slices (block rows) of the 16-row variant, then one of the
    8 rows left; the CUDA-core kernel keeps a launch per slice."""
    w = q4_weight(96, 512)
    quant_cuda.gemv(torch.zeros(40, 512, dtype=torch.bfloat16), w, None, False, torch.bfloat16, kernel="gemv_mma")
    assert [(key[3], grid[1]) for key, grid in recorded_launches] == [(16, 2), (8, 1)]
    recorded_launches.clear()
    quant_cuda.gemv(torch.zeros(40, 512, dtype=torch.bfloat16), w, None, False, torch.bfloat16, kernel="gemv_q")
    assert len(recorded_launches) == 3


def test_cluster_products_take_their_slices_in_one_launch(recorded_launches: list[tuple]) -> None:
    """Where clusters split K (down's shape on sm_90+), 40 rows go as one launch over two 16-row slices (clusters
    along x, slices along y) and one of 8 rows."""
    quant_cuda.gemv(torch.zeros(40, 8960, dtype=torch.bfloat16), q4_weight(96, 8960), None, False, torch.bfloat16,
                    kernel="gemv_mma")
    assert [(key[3], key[-2], grid[1]) for key, grid in recorded_launches] == [(16, 4, 2), (8, 4, 1)]


def test_the_private_torch_apis_the_build_uses_are_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """On every machine: a torch that moved or changed them fails here, in one line, not at a kernel's first launch."""
    from specserve.errors import SpecserveError
    from specserve.kernels.cuda import torch_private

    torch_private.check()
    monkeypatch.delattr(torch_private.torch.cuda, "_compile_kernel")
    with pytest.raises(SpecserveError, match="torch.cuda._compile_kernel"):
        torch_private.compile_kernel("", "k")
