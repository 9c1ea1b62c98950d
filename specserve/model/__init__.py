"""Model definition: ModelConfig from GGUF metadata, weights, the shared blocks (blocks.py), one module per
architecture family (llama, qwen2, qwen3) found through registry.py, and the transformer that stacks them."""
