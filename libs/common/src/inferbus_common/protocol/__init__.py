"""The data path's protocol: every byte format on the bus and its one set of rules.

* `framing`: byte helpers, the one error type (`FrameError`) and the one
  sanitiser for error text and header values (`one_line`).
* `envelope`: a request's metadata, one typed object from gateway to batcher.
* `tensors`: tensor frames (``IBT1``), the body of every request and reply.
* `bundles`: request bundles (``IBQ1``) and reply bundles (``IBR1``), the only
  framing of tensor requests and their answers (a lone request is a bundle of one).
* `microbatch`: micro-batches (``IBB3``), batcher → worker.
* `replies`: answering requests with errors; reading an answer's status.
* `headers`: NATS header names (generative and sequence requests, streams).

Byte layouts: docs/architecture.md ("Wire formats"); who may publish what
where, and what each hop checks: docs/security.md.
"""

from inferbus_common.protocol.envelope import Envelope
from inferbus_common.protocol.framing import FrameError, one_line

__all__ = ["Envelope", "FrameError", "one_line"]
