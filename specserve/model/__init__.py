"""Model definition: ModelConfig from GGUF metadata, weights, the shared blocks (blocks.py; moe.py holds the
mixture-of-experts layer), the architecture families as one table (registry.py: llama, qwen2, qwen3, qwen2moe,
qwen3moe), and the transformer that stacks them."""
