"""An OpenAI-compatible HTTP endpoint in front of a token-level generation engine.

For generation backends whose engine has no server of its own (megatron-core's
static engine, say): environments such as NeMo Gym talk to the policy model over
``/v1/chat/completions``, and :class:`OpenAIEndpoint` turns those requests into
calls of the backend's :class:`TokenGenerator` -- the same ``generate`` the
training loop calls, so what the endpoint serves is exactly what refit loaded.

What it serves (the subset RL environments use, in vLLM's dialect):

* ``GET /v1/models``, ``GET /health``;
* ``POST /v1/chat/completions`` -- the chat template of the model's tokenizer,
  ``logprobs`` (the sampled token's, ``top_logprobs`` 0), vLLM's
  ``return_tokens_as_token_ids`` (``token_id:<id>`` strings) and
  ``return_token_ids`` (``prompt_token_ids`` and ``choice.token_ids``);
* ``POST /v1/completions`` -- text or token-id prompts, the same extensions;
* ``POST /tokenize`` and ``POST /detokenize`` (vLLM's routes; NeMo Gym asks
  ``/tokenize`` for the prompt's ids when a response carries none).

Concurrent requests are gathered into one engine call (:class:`RequestBatcher`):
requests that arrive within ``batch_wait_s`` of each other and share sampling
parameters run as one batch. Engine calls run one at a time in a worker thread,
off the event loop. Unsupported parameters (stop strings, ``top_p`` < 1,
``top_logprobs`` > 0, ``echo``) are answered with a 400 naming the parameter
rather than ignored.

The tokenizer of a path is :func:`rlcore.models.tokenizer.load`'s (transformers', chat template
included). The server's imports (starlette, uvicorn) happen in
:meth:`OpenAIEndpoint.start`, or ahead of it in a thread (:func:`prepare`): a backend that
starts the endpoint once its engine is ready calls :func:`prepare` when the engine starts
and passes the future as the endpoint's tokenizer.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlcore.errors import DeadlineExceeded, NotServingError, RlcoreError
from rlcore.handles import Endpoint, SamplingParams

log = logging.getLogger(__name__)

#: ``apply_chat_template``'s own options: a request's ``chat_template_kwargs`` may not set
#: them (they are not template variables, and would change what the call returns).
APPLY_OPTIONS = frozenset({
    "tokenize", "return_dict", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "padding", "truncation", "max_length", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})

#: A sample as generation handles return it: ``{"token_ids": [...], "logprobs": [...]}``.
Sample = dict[str, list]


class TokenGenerator(Protocol):
    """What the endpoint drives: a generation handle's ``generate`` (see :mod:`rlcore.app.grpo`)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]: ...


class EndpointRequestError(RlcoreError):
    """A request the endpoint refuses (HTTP 400, or ``status``), naming the parameter."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# ---------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------


@dataclass
class _Pending:
    prompt: list[int]
    key: tuple[int, float, int | None]  # max_tokens, temperature, seed
    future: asyncio.Future[Sample]


@dataclass
class RequestBatcher:
    """Gathers concurrent requests into engine calls (one call at a time).

    ``run(prompts, max_tokens, temperature, seed)`` returns one sample per prompt;
    it runs in a worker thread. A batch holds requests with the same
    ``(max_tokens, temperature, seed)``, at most ``max_batch`` of them, in arrival
    order; requests without a seed draw one from a counter starting at ``seed``.
    """

    run: Callable[[list[list[int]], int, float, int], list[Sample]]
    max_batch: int = 64
    wait_s: float = 0.005
    seed: int = 0
    #: Engine calls made and prompts served (for tests and logs).
    calls: int = 0
    served: int = 0
    _queue: collections.deque[_Pending] = field(default_factory=collections.deque)
    _wake: asyncio.Event | None = None
    _task: asyncio.Task[None] | None = None
    _seeds: itertools.count[int] | None = None

    async def submit(
        self, prompt: list[int], *, max_tokens: int, temperature: float, seed: int | None
    ) -> Sample:
        """One sample for ``prompt``; waits for its batch."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._seeds = itertools.count(self.seed)
            self._task = asyncio.get_running_loop().create_task(self._loop())
        future: asyncio.Future[Sample] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(prompt, (max_tokens, temperature, seed), future))
        assert self._wake is not None
        self._wake.set()
        return await future

    def _take_batch(self) -> list[_Pending]:
        while self._queue and self._queue[0].future.done():  # the client went away
            self._queue.popleft()
        if not self._queue:
            return []
        key = self._queue[0].key
        batch, rest = [], collections.deque()
        while self._queue:
            item = self._queue.popleft()
            if item.future.done():
                continue
            (batch if item.key == key and len(batch) < self.max_batch else rest).append(item)
        self._queue = rest
        return batch

    async def _loop(self) -> None:
        assert self._wake is not None and self._seeds is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            # Let the requests that are on their way join this batch.
            await asyncio.sleep(self.wait_s)
            while batch := self._take_batch():
                max_tokens, temperature, seed = batch[0].key
                call_seed = next(self._seeds) if seed is None else seed
                prompts = [p.prompt for p in batch]
                try:
                    samples = await asyncio.to_thread(
                        self.run, prompts, max_tokens, temperature, call_seed
                    )
                    if len(samples) != len(batch):
                        raise RlcoreError(
                            f"the engine returned {len(samples)} samples for {len(batch)} prompts"
                        )
                except Exception as err:  # every request of the batch gets the cause
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(err)
                    continue
                self.calls += 1
                self.served += len(batch)
                for p, s in zip(batch, samples, strict=True):
                    if not p.future.done():
                        p.future.set_result(s)


# ---------------------------------------------------------------------------
# Requests and responses
# ---------------------------------------------------------------------------


def _check_sampling(body: dict[str, Any], *, max_tokens_default: int | None) -> tuple[int, float]:
    """``(max_tokens, temperature)`` of a request; 400 for what the engine cannot honour."""
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise EndpointRequestError(
            "stop sequences are not supported by this endpoint", param="stop"
        )
    top_p = body.get("top_p")
    if top_p is not None and float(top_p) < 1.0:
        raise EndpointRequestError(
            f"top_p={top_p} is not supported by this endpoint (it samples from the full "
            "distribution); leave top_p unset or 1",
            param="top_p",
        )
    if body.get("echo"):
        raise EndpointRequestError("echo is not supported by this endpoint", param="echo")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise EndpointRequestError(f"n must be a positive integer, got {n!r}", param="n")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max_tokens_default
    if max_tokens is None or not isinstance(max_tokens, int) or max_tokens < 1:
        raise EndpointRequestError(
            f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens"
        )
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    if temperature < 0:
        raise EndpointRequestError("temperature must be >= 0", param="temperature")
    seed = body.get("seed")
    if seed is not None and not isinstance(seed, int):
        raise EndpointRequestError(f"seed must be an integer, got {seed!r}", param="seed")
    return max_tokens, temperature


def _message_text(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A chat message with its content as one string (text parts joined)."""
    if not isinstance(message, dict) or "role" not in message:
        raise EndpointRequestError(
            f"messages[{index}] must be an object with a 'role'", param="messages"
        )
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("text", "input_text", "output_text"):
                raise EndpointRequestError(
                    f"messages[{index}].content has a part of type {kind!r}; this endpoint "
                    "serves text only",
                    param="messages",
                )
            texts.append(str(part.get("text", "")))
        content = "".join(texts)
    return {**message, "content": "" if content is None else str(content)}


def _caused_by(err: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first exception of type ``kind`` in ``err``'s ``__cause__`` chain."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, kind):
            return seen
        seen = seen.__cause__
    return None


@dataclass
class _Served:
    """One finished choice."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ServedModel:
    """What an :class:`OpenAIEndpoint` serves.

    Attributes:
        name: the name requests must use (``model``) and ``/v1/models`` lists.
        max_sequence_length: longest prompt + completion the engine takes; longer
            requests get a 400 saying "maximum context length", as vLLM's do.
        eos_token_ids: ends of sequence (``finish_reason`` ``stop`` vs ``length``).
    """

    name: str
    max_sequence_length: int
    eos_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class Listen:
    """Where an :class:`OpenAIEndpoint` listens.

    Attributes:
        host, port: the address (port 0: a free port).
        token: the run's token (:class:`rlcore.config.placement.Network`): every request but
            ``/health`` must then carry ``Authorization: Bearer <token>`` (401 without),
            and ``endpoint.api_key`` is it. Required when ``host`` is not loopback.
    """

    host: str = "127.0.0.1"
    port: int = 0
    token: str | None = None


@dataclass(frozen=True)
class Batching:
    """How an :class:`OpenAIEndpoint` gathers requests into engine calls (:class:`RequestBatcher`).

    Attributes:
        max_batch: most prompts in one engine call.
        wait_s: how long a batch waits for requests on their way.
        seed: first sampling seed of requests without one.
    """

    max_batch: int = 64
    wait_s: float = 0.005
    seed: int = 0


class OpenAIEndpoint:
    """An OpenAI-compatible HTTP server (uvicorn, in a thread of this process).

    Args:
        generator: the engine (a generation handle's ``generate``).
        tokenizer: a Hugging Face tokenizer,
            the path of one (loaded at start by :func:`rlcore.models.tokenizer.load`) or the
            future :func:`prepare` returns.
        model: what it serves (:class:`ServedModel`).
        listen: where it listens, and the token it wants (:class:`Listen`).
        batching: how requests are gathered into engine calls (:class:`Batching`).

    An engine error caused (anywhere in its ``__cause__`` chain) by
    :class:`rlcore.errors.NotServingError` is answered with 503, others with 500;
    both carry the cause's message.
    """

    def __init__(
        self,
        generator: TokenGenerator,
        tokenizer: Any,
        model: ServedModel,
        *,
        listen: Listen = Listen(),
        batching: Batching = Batching(),
    ) -> None:
        self.generator = generator
        self.tokenizer = tokenizer
        self.model_name = model.name
        self.max_sequence_length = int(model.max_sequence_length)
        self.eos_token_ids = {int(t) for t in model.eos_token_ids}
        self.host = listen.host
        self.port = int(listen.port)
        self.token = listen.token
        self.batcher = RequestBatcher(
            self._run_batch, max_batch=max(1, int(batching.max_batch)), wait_s=batching.wait_s, seed=batching.seed
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._endpoint: Endpoint | None = None

    # ------------------------------------------------------------ engine side

    def _run_batch(
        self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int
    ) -> list[Sample]:
        out = self.generator.generate(prompts, SamplingParams(1, max_tokens, temperature, seed))
        return [samples[0] for samples in out]

    async def _complete(self, prompt: list[int], body: dict[str, Any], n: int) -> list[_Served]:
        max_tokens, temperature = _check_sampling(body, max_tokens_default=None)
        if not prompt:
            raise EndpointRequestError("the prompt is empty", param="prompt")
        if len(prompt) + max_tokens > self.max_sequence_length:
            raise EndpointRequestError(
                f"This model's maximum context length is {self.max_sequence_length} tokens. "
                f"However, you requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                f"prompt, {max_tokens} for the completion). Please reduce the length of the "
                "prompt or max_tokens.",
                param="max_tokens",
            )
        seed = body.get("seed")
        samples = await asyncio.gather(
            *(
                self.batcher.submit(
                    prompt,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    seed=None if seed is None else seed + i,
                )
                for i in range(n)
            )
        )
        served = []
        for s in samples:
            ids = [int(t) for t in s["token_ids"]]
            ended = bool(ids) and ids[-1] in self.eos_token_ids
            served.append(
                _Served(
                    prompt,
                    ids,
                    [float(x) for x in s["logprobs"]],
                    "stop" if ended or len(ids) < max_tokens else "length",
                )
            )
        return served

    # ------------------------------------------------------------ tokenizer side

    def _decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _token_text(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else str(self.tokenizer.decode([token_id]))

    def chat_prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The prompt's token ids: the tokenizer's chat template over ``messages``."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointRequestError("messages must be a non-empty list", param="messages")
        messages = [_message_text(m, i) for i, m in enumerate(messages)]
        continue_final = bool(body.get("continue_final_message", False))
        add_generation_prompt = bool(body.get("add_generation_prompt", not continue_final))
        kwargs = dict(body.get("chat_template_kwargs") or {})
        reserved = sorted(set(kwargs) & APPLY_OPTIONS)
        if reserved:
            # apply_chat_template's own options (the endpoint renders text): a variable of
            # that name would collide with them or send the call to transformers.
            raise EndpointRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)} (not template variables)",
                param="chat_template_kwargs",
            )
        if body.get("tools"):
            kwargs["tools"] = body["tools"]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final,
                **kwargs,
            )
        except Exception as err:  # a template error is the request's fault
            raise EndpointRequestError(
                f"the chat template failed on these messages: {err}", param="messages"
            ) from err
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _completion_prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, list) and len(prompt) == 1:
            return self._completion_prompt_ids(prompt[0])
        raise EndpointRequestError(
            "prompt must be a string or a list of token ids (one prompt per request)",
            param="prompt",
        )

    # ------------------------------------------------------------ routes

    async def chat_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The response to one ``/v1/chat/completions`` body (a dict, as JSON decodes it)."""
        self._check_request(body, top_field="top_logprobs")
        prompt = self.chat_prompt_ids(body)
        n = int(body.get("n") or 1)
        served = await self._complete(prompt, body, n)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        with_ids = bool(body.get("return_token_ids"))
        choices = []
        for i, s in enumerate(served):
            choice: dict[str, Any] = {
                "index": i,
                "message": {"role": "assistant", "content": self._decode(s.token_ids)},
                "finish_reason": s.finish_reason,
                "logprobs": None,
            }
            if body.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": (tok := self._token_text(t, as_ids)),
                            "logprob": lp,
                            "bytes": list(tok.encode()),
                            "top_logprobs": [],
                        }
                        for t, lp in zip(s.token_ids, s.logprobs, strict=True)
                    ]
                }
            if with_ids:
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        response = self._envelope("chat.completion", "chatcmpl", prompt, served, choices)
        if with_ids:
            response["prompt_token_ids"] = prompt
        return response

    async def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        """The response to one ``/v1/completions`` body."""
        self._check_request(body, top_field="logprobs")
        logprobs = body.get("logprobs")
        body = {**body, "max_tokens": body.get("max_tokens", 16)}
        prompt = self._completion_prompt_ids(body.get("prompt"))
        served = await self._complete(prompt, body, int(body.get("n") or 1))
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        choices = []
        for i, s in enumerate(served):
            choice: dict[str, Any] = {
                "index": i,
                "text": self._decode(s.token_ids),
                "finish_reason": s.finish_reason,
                "logprobs": None,
            }
            if logprobs is not None:
                tokens = [self._token_text(t, as_ids) for t in s.token_ids]
                offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": s.logprobs,
                    "top_logprobs": None,
                    "text_offset": offsets[: len(tokens)],
                }
            if body.get("return_token_ids"):
                choice["prompt_token_ids"] = prompt
                choice["token_ids"] = s.token_ids
            choices.append(choice)
        return self._envelope("text_completion", "cmpl", prompt, served, choices)

    def tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``messages`` (chat template) or ``prompt``."""
        if "messages" in body:
            ids = self.chat_prompt_ids(body)
        else:
            ids = self._completion_prompt_ids(body.get("prompt"))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_sequence_length}

    def detokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EndpointRequestError("tokens must be a list of token ids", param="tokens")
        return {"prompt": self._decode(tokens)}

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "owned_by": "rlcore",
                    "max_model_len": self.max_sequence_length,
                }
            ],
        }

    def _check_request(self, body: dict[str, Any], *, top_field: str) -> None:
        """The model's name, no streaming, and no top-N logprobs (``top_field``)."""
        model = body.get("model")
        if model not in (None, self.model_name):
            raise EndpointRequestError(
                f"The model `{model}` does not exist; this endpoint serves `{self.model_name}`",
                param="model",
                status=404,
            )
        if body.get("stream"):
            raise EndpointRequestError("streaming is not supported", param="stream")
        top = body.get(top_field)
        if top not in (None, 0):
            raise EndpointRequestError(
                f"{top_field}={top} is not supported: this endpoint returns the sampled "
                f"token's logprob only ({top_field} 0)",
                param=top_field,
            )

    def _envelope(
        self,
        kind: str,
        prefix: str,
        prompt: list[int],
        served: list[_Served],
        choices: list[dict[str, Any]],
    ) -> dict[str, Any]:
        completion_tokens = sum(len(s.token_ids) for s in served)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt) + completion_tokens,
            },
        }

    # ------------------------------------------------------------ HTTP

    def app(self) -> Any:
        """The Starlette application (routes above, errors in OpenAI's shape). Plain
        Starlette, not FastAPI: the handlers parse the JSON body themselves (FastAPI's
        injection would answer malformed bodies with its own 422 shape), and FastAPI's
        import (pydantic's models) would cost the driver ~0.15 CPU-s more."""
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({})

        async def models(request: Request) -> JSONResponse:
            return JSONResponse(self.models())

        routes = [
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", self._post(self.chat_completion), methods=["POST"]),
            Route("/v1/completions", self._post(self.completion), methods=["POST"]),
            Route("/tokenize", self._post(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._post(self.detokenize), methods=["POST"]),
        ]
        middleware = []
        if self.token:
            from rlcore.serve.auth import BearerGuard

            middleware.append(Middleware(BearerGuard, token=self.token))

        async def http_error(request: Request, exc: Exception) -> JSONResponse:
            # Unknown routes and methods: OpenAI's error shape, as every other answer.
            assert isinstance(exc, HTTPException)
            return _error(exc.status_code, str(exc.detail))

        return Starlette(
            routes=routes, middleware=middleware, exception_handlers={HTTPException: http_error}
        )

    def _post(self, route: Callable[[dict[str, Any]], Any]) -> Callable[[Any], Any]:
        """The Starlette endpoint of a POST ``route``: its JSON body in, its answer (or the
        error it raised, in OpenAI's shape) out."""
        from starlette.responses import JSONResponse

        async def endpoint(request: Any) -> Any:
            result = await self._answer(request, route)
            return result if isinstance(result, JSONResponse) else JSONResponse(result)

        return endpoint

    async def _answer(self, request: Any, route: Callable[[dict[str, Any]], Any]) -> Any:
        """What ``route`` answers to ``request``'s JSON body, or an error response."""
        try:
            body = await request.json()
        except ValueError as err:
            return _error(400, f"the request body is not JSON: {err}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            result = route(body)
            if asyncio.iscoroutine(result):
                result = await result
            return result
        except EndpointRequestError as err:
            return _error(err.status, str(err), err.param)
        except Exception as err:  # the cause goes to the client and the log
            if (cause := _caused_by(err, NotServingError)) is not None:
                return _error(503, f"the engine is not serving: {cause}")
            log.exception("%s: request failed", self.model_name)
            return _error(500, f"{type(err).__name__}: {err}")

    @property
    def endpoint(self) -> Endpoint | None:
        """Where it listens, once started (``base_url`` ends in ``/v1``)."""
        return self._endpoint

    def start(self, timeout_s: float = 30.0) -> Endpoint:
        """Bind, serve in a daemon thread, return once it accepts connections."""
        import uvicorn

        from rlcore.runtime.addresses import is_loopback

        if not is_loopback(self.host) and not self.token:
            raise RlcoreError(
                f"the OpenAI-compatible endpoint would listen on {self.host}, beyond loopback, "
                "without a token; pass token= (the run's InitContext.network.token)"
            )
        if isinstance(self.tokenizer, Future):
            self.tokenizer = self.tokenizer.result(timeout=max(1.0, timeout_s))
        if isinstance(self.tokenizer, str):
            self.tokenizer = _load_tokenizer(self.tokenizer)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        host, port = sock.getsockname()[:2]
        config = uvicorn.Config(
            self.app(),
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"openai-endpoint-{port}",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                sock.close()
                raise RlcoreError(f"the OpenAI-compatible endpoint on {host}:{port} did not start")
            if time.monotonic() > deadline:
                self.stop()
                raise DeadlineExceeded(
                    f"the OpenAI-compatible endpoint on {host}:{port} did not start within {timeout_s}s"
                )
            time.sleep(0.01)
        self.port = int(port)
        self._endpoint = Endpoint(
            base_url=f"http://{host}:{port}/v1", model=self.model_name, api_key=self.token or "EMPTY"
        )
        log.info(
            "OpenAI-compatible endpoint for %s on %s", self.model_name, self._endpoint.base_url
        )
        return self._endpoint

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and join the thread (forcefully after ``timeout_s``). Idempotent."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        self._endpoint = None
        if server is None or thread is None:
            return
        server.should_exit = True
        thread.join(timeout_s / 2)
        if thread.is_alive():
            server.force_exit = True
            thread.join(timeout_s / 2)
        if thread.is_alive():
            log.warning(
                "the OpenAI-compatible endpoint thread did not stop within %.1fs", timeout_s
            )


#: The OpenAI error type of each HTTP status the endpoint answers with.
_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    503: "ServiceUnavailableError",
}


def _error(status: int, message: str, param: str | None = None) -> Any:
    """An error response in OpenAI's shape (a Starlette ``JSONResponse``)."""
    from starlette.responses import JSONResponse

    return JSONResponse(
        {
            "object": "error",
            "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"),
            "param": param,
            "code": status,
            # OpenAI's own clients read the message from here.
            "error": {"message": message, "param": param, "code": status},
        },
        status_code=status,
    )


def _load_tokenizer(path: str) -> Any:
    from pathlib import Path

    from rlcore.models.tokenizer import load

    return load(Path(path))


def prepare(tokenizer_path: str) -> Future[Any]:
    """Load what :meth:`OpenAIEndpoint.start` needs ahead of it, in a daemon thread: the
    tokenizer of ``tokenizer_path`` (:func:`rlcore.models.tokenizer.load`, chat template included)
    and the server's imports (starlette, uvicorn). Returns the tokenizer's future; pass it as
    the endpoint's ``tokenizer``. Started with the engine, this overlaps the engine's start
    instead of following it (the endpoint is on the path every reader waits on).
    """
    done: Future[Any] = Future()

    def load() -> None:
        try:
            import starlette.applications  # noqa: F401  (what start() imports, ready when it does)
            import uvicorn  # noqa: F401

            done.set_result(_load_tokenizer(tokenizer_path))
        except BaseException as err:  # start() re-raises it
            done.set_exception(err)

    threading.Thread(target=load, name="openai-endpoint-prepare", daemon=True).start()
    return done
