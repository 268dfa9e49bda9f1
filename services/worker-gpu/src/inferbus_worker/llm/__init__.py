"""The generative (LLM) worker: vLLM's async engine behind the bus.

Runs as ``python -m inferbus_worker.llm`` with the interpreter of the separate
vLLM environment (``.venvs/vllm``, made by ``scripts/bootstrap-llm.sh``): torch
and vLLM never enter the uv workspace. Modules:

* `settings` — `LlmWorkerSettings` (env prefix ``INFERBUS_LLM_``);
* `engine` — `LlmEngine`, the one place that imports vLLM (lazily);
* `worker` — `LlmWorker`: a `VersionHost` (catalog, artifact checks,
  heartbeat, unload grace) for versions whose engine is ``vllm``;
* `versionserver` — `VersionServer`: one version's bounded intake on
  ``ib.gen.<model>.<version>``, streamed chunks, cancel, engine recovery;
* `metrics` — TTFT, inter-token latency, tokens, queue time, sequences, KV cache,
  engine restarts.
"""
