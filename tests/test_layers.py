"""The import contract: every layer imports only from the layers below it (pyproject.toml's
[tool.importlinter]), checked by import-linter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_layers_point_down() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_no_import_cycles_inside_a_package() -> None:
    """Modules of one package (kernels, model, engine, ...) import each other in one direction only: shared types
    live in modules of their own (kernels/quant_weight.py, kernels/quant_experts.py, model/registry.py's
    read_config) rather than in the dispatchers that use them."""
    import itertools

    import grimp

    graph = grimp.build_graph("specserve")
    packages = sorted(m for m in graph.modules if m.count(".") == 1 and graph.find_children(m))
    assert "specserve.kernels" in packages and "specserve.model" in packages
    cycles = []
    for package in packages:
        modules = sorted(graph.find_descendants(package))
        cycles += [(a, b) for a, b in itertools.combinations(modules, 2)
                   if graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)]
    assert not cycles, cycles
