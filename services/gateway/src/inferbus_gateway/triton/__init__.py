"""Triton's protocol extensions: model configuration and statistics documents,
the vLLM backend contract, system shared memory, sequences, decoupled models,
classification, the model repository, trace and log settings."""
