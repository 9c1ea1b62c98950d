"""specserve: a GGUF inference engine and HTTP server with speculative decoding."""

import os

# Before torch loads OpenMP: spinning worker threads would starve the HTTP threads and every other
# process on a shared CPU (a busy 2-core box ran the same commands 3-7x slower without it).
# Child processes that are not specserve (a reference engine in a benchmark) get the environment without it:
# llama.cpp's OpenMP barriers under PASSIVE decode ~4x slower.
OMP_WAIT_POLICY_SET = "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def foreign_env() -> dict[str, str]:
    """The environment as it was before specserve set its thread defaults."""
    env = dict(os.environ)
    if OMP_WAIT_POLICY_SET:
        env.pop("OMP_WAIT_POLICY", None)
    return env

__version__ = "0.1.0"
