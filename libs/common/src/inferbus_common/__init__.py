"""Shared contracts and helpers for inferbus services.

Everything two services must agree on lives here: subject names (`subjects`),
the data path's protocol (`protocol`: header names, the envelope, every bus
message format, error answers), the batch-size rule (`batchrule`), tensor datatypes and
codecs (`datatypes`, `codec`), the error hierarchy (`errors`), model
configuration (`modelconfig`), the deployment catalog kept in NATS KV
(`catalog`), settings, logging and the operations HTTP endpoints.
"""

__version__ = "0.1.0"
