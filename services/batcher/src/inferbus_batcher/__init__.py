"""inferbus batcher: per model-version queues, dynamic batching, micro-batches to JetStream.

Run with ``python -m inferbus_batcher``; see `inferbus_batcher.service.Batcher`.
"""
