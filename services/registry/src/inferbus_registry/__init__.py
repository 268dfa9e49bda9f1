"""inferbus registry: model versions, aliases and artifacts, published to NATS KV.

Modules: `store` (local/S3 object stores), `naming` (what names and versions
may be), `onnxcheck` (ONNX graph vs config.json), `repository` (versions,
manifests, aliases on a store), `publisher` (catalog KV and events), `service`
(the gRPC API), `app` (the process), `client` (asyncio client for the CLI).
"""
