"""Small Hugging Face model configs (dicts for ``mtraining.models.build_model(config=...)``) shared by tests."""

TINY = dict(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)
"""A two-layer Qwen2 that the eval CLI, the trainer and the fused kernels run in seconds."""

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
"""A smaller architecture without its ``model_type``, for tests that run it as several model types."""
