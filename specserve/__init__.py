"""specserve: a GGUF inference engine and HTTP server with speculative decoding."""

__version__ = "0.1.0"
