"""Training: config, data and packing, the chunked loss, FSDP2 x context-parallel trainer, checkpoints."""
