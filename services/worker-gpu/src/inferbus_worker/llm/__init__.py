"""The generative (LLM) worker: vLLM's async engine behind the bus.

Runs as ``python -m inferbus_worker.llm`` with the interpreter of the separate
vLLM environment (``.venvs/vllm``, made by ``scripts/bootstrap-llm.sh``): torch
and vLLM never enter the uv workspace. Modules:

* `settings` — `LlmWorkerSettings` (env prefix ``INFERBUS_LLM_``);
* `engine` — `LlmEngine`, the one place that imports vLLM (lazily);
* `service` — `LlmWorker`: follows the catalog, loads versions whose engine is
  ``vllm``, serves ``ib.gen.<model>.<version>`` with bounded admission, streams
  chunks, aborts on cancel, heartbeats, restarts an engine that died;
* `metrics` — TTFT, inter-token latency, tokens, queue time, sequences, KV cache,
  engine restarts.
"""
