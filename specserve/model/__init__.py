"""Model definition: ModelConfig from GGUF metadata, weights per architecture, the transformer."""
