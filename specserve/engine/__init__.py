"""Engine: batches, KV cache, runner, sampling, generation loop, slot scheduler."""
