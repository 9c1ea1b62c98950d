"""benchmarks/llama_cpp_tools.py's llama_bench against a stand-in binary: prefill and decode run apart, so a prefill
that dies of a signal (a native build's AMX code on a VM) leaves the decode rate, and only both failing is an
error."""

from __future__ import annotations

import importlib
import stat
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
tools = importlib.import_module("llama_cpp_tools")

# -p P -n N as llama-bench takes them; `dies` names the test that kills itself (pp, tg or both)
FAKE = """#!/bin/sh
p=0; n=0
while [ $# -gt 0 ]; do case "$1" in -p) p=$2; shift;; -n) n=$2; shift;; esac; shift; done
test=$([ "$n" = 0 ] && echo pp || echo tg)
case "{dies}" in *$test*) kill -ILL $$;; esac
echo "[{{\\"n_prompt\\": $p, \\"n_gen\\": $n, \\"avg_ts\\": $([ $test = pp ] && echo 900.5 || echo 250.25)}}]"
"""


def _fake(tmp_path: Path, dies: str) -> Path:
    binary = tmp_path / "llama-bench"
    binary.write_text(FAKE.format(dies=dies))
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return binary


def test_both_rates(tmp_path: Path) -> None:
    assert tools.llama_bench(_fake(tmp_path, "none"), tmp_path / "m.gguf", n_prompt=512, n_gen=64) == {
        "pp": 900.5, "tg": 250.25}


def test_a_prefill_that_dies_leaves_the_decode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tools.llama_bench(_fake(tmp_path, "pp"), tmp_path / "m.gguf", threads=2) == {"pp": None, "tg": 250.25}
    assert "pp run failed (killed by SIGILL)" in capsys.readouterr().out


def test_both_failing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pp run failed.*tg run failed"):
        tools.llama_bench(_fake(tmp_path, "pp tg"), tmp_path / "m.gguf")
