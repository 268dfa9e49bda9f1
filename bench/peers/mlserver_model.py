"""An MLServer runtime that runs an ONNX model with onnxruntime, for the peer benchmark.

MLServer 1.7 ships no ONNX runtime, so this is the smallest custom
``MLModel`` that does the job: one onnxruntime session per MLServer inference
worker (``parallel_workers``), ``threads`` intra-op threads (model-settings
``parameters.extra.threads``). MLServer's adaptive batching
(``max_batch_size`` / ``max_batch_time`` in model-settings.json) joins
requests before `predict` sees them. ``bench/run_all.py`` writes the
settings files; this module is imported by MLServer from ``PYTHONPATH``.
"""

from __future__ import annotations

import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxModel(MLModel):
    """Run ``parameters.uri`` (an ONNX file) on each request's tensors."""

    async def load(self) -> bool:
        """Create the onnxruntime session."""
        extra = (self.settings.parameters.extra or {}) if self.settings.parameters else {}
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = int(extra.get("threads", 1))
        opts.inter_op_num_threads = 1
        uri = self.settings.parameters.uri if self.settings.parameters else None
        self._sess = ort.InferenceSession(uri, opts, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._sess.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        """Decode inputs to numpy, run the session, encode outputs."""
        feed = {inp.name: NumpyCodec.decode_input(inp) for inp in payload.inputs}
        results = self._sess.run(self._outputs, feed)
        return InferenceResponse(
            model_name=self.name,
            model_version=self.version,
            outputs=[
                NumpyCodec.encode_output(name, arr)
                for name, arr in zip(self._outputs, results, strict=True)
            ],
        )
