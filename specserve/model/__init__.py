"""Model definition: ModelConfig from GGUF metadata, weights, the shared blocks (blocks.py), one module per
architecture family (llama, qwen2, qwen3, qwen2moe, qwen3moe; moe.py holds the mixture-of-experts layer)
found through registry.py, and the transformer that stacks them."""
