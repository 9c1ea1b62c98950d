"""specserve: a GGUF inference engine and HTTP server with speculative decoding."""

import os

# Before torch loads OpenMP: spinning worker threads would starve the HTTP threads and every other
# process on a shared CPU (a busy 2-core box ran the same commands 3-7x slower without it).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
