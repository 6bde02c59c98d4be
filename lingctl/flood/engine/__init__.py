"""The inference engine: continuous batching over a segment KV cache, the forward pass, its native kernels, pipeline stages, threads and the memory plan."""
