"""GGUF files: metadata, tensors (mmap + dequantize), tokenizer, chat template."""
