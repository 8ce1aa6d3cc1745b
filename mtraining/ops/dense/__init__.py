"""Dense causal attention of a chunk pair as a few dense blocks (cuDNN on CUDA)."""
