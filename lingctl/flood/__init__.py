"""flood: offline batch inference for Ling MoE checkpoints (continuous batching, segment KV cache, prefix
sharing, pipeline stages). Importing the package does not import torch; import the submodules."""
