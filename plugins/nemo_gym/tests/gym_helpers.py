"""TEST-ONLY helpers of the nemo_gym backend's tests: a stub OpenAI-compatible
endpoint (stdlib HTTP server) and an InitContext built without the rest of setup.

The stub is allowed only here: it stands in for the generation endpoint so the
Gym side can be tested in seconds. The real endpoint (rlcore's vLLM backend in
server mode) is exercised by tests/e2e/test_e2e_nemo_gym.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rlcore.config import RunConfig
from rlcore.context import InitContext
from rlcore.declarations import Role
from rlcore.handles import Endpoint, RolloutRequest
from rlcore.testing import fixtures
from rlcore_nemo_gym.options import NemoGymOptions

REPO = Path(__file__).resolve().parents[3]


def gym_python() -> Path | None:
    """The Gym venv's python if it is installed (tests that need it skip otherwise)."""
    from rlcore.errors import ConfigError
    from rlcore_nemo_gym.servers import find_gym_python

    try:
        return find_gym_python(None)
    except ConfigError:
        return None


class StubEndpoint:
    """A stub of the generation endpoint: ``GET /v1/models``, ``POST /v1/chat/completions``.

    Answers every chat request with ``reply`` (default: the right choice of the first
    bunsenbench row), with token ids (bytes of the text) and logprobs -0.5 each, in
    the shape vLLM gives with ``return_token_ids`` / ``return_tokens_as_token_ids``.
    """

    def __init__(
        self,
        *,
        model: str = "policy",
        reply: str = "<choice>H2O</choice>",
        port: int = 0,
        token_ids: bool = True,
        tool_calls: bool = False,
        host: str = "127.0.0.1",
        token: str | None = None,
    ) -> None:
        self.model = model
        self.host = host
        # Set: every request must carry "Authorization: Bearer <token>", else 401 (as a
        # server of a run across nodes answers); the headers seen are kept.
        self.token = token
        self.authorizations: list[str | None] = []
        self.reply = reply
        self.token_ids = token_ids  # False: answer like a server that ignores return_token_ids
        # True: when the request offers tools and no tool has answered yet, call the first one.
        self.tool_calls = tool_calls
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                given = self.headers.get("Authorization")
                stub.authorizations.append(given)
                if stub.token is not None and given != f"Bearer {stub.token}":
                    self._send(401, {"error": {"message": "missing or wrong bearer token"}})
                    return True
                return False

            def do_GET(self) -> None:
                if self._refused():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._send(
                        200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]}
                    )
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if self._refused():
                    return
                stub.requests.append(body)
                if self.path != "/v1/chat/completions":
                    self._send(404, {"error": f"no route {self.path}"})
                    return
                if body.get("model") != stub.model:
                    self._send(
                        404, {"error": {"message": f"model {body.get('model')} does not exist"}}
                    )
                    return
                messages = body.get("messages") or []
                limit = int(body.get("max_tokens") or body.get("max_completion_tokens") or 64)
                message: dict[str, Any]
                tools = body.get("tools") or []
                if stub.tool_calls and tools and not any(m.get("role") == "tool" for m in messages):
                    args = json.dumps({"city": "San Francisco"})
                    gen = list(args.encode())
                    message = {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call_{len(stub.requests)}",
                                "type": "function",
                                "function": {
                                    "name": tools[0]["function"]["name"],
                                    "arguments": args,
                                },
                            }
                        ],
                    }
                    finish = "tool_calls"
                else:
                    gen = list(stub.reply.encode())[:limit]
                    message = {"role": "assistant", "content": bytes(gen).decode(errors="replace")}
                    finish = "stop"
                prompt = list(json.dumps(messages).encode())
                choice: dict[str, Any] = {
                    "index": 0,
                    "finish_reason": finish,
                    "message": message,
                    "logprobs": {
                        "content": [
                            {
                                "token": f"token_id:{t}",
                                "logprob": -0.5,
                                "bytes": None,
                                "top_logprobs": [],
                            }
                            for t in gen
                        ]
                    },
                    "token_ids": gen,
                }
                if not stub.token_ids:
                    del choice["token_ids"], choice["logprobs"]
                self._send(
                    200,
                    {
                        "id": f"chatcmpl-{len(stub.requests)}",
                        "object": "chat.completion",
                        "created": int(time.time()),
                        "model": stub.model,
                        "choices": [choice],
                        **({"prompt_token_ids": prompt} if stub.token_ids else {}),
                        "usage": {
                            "prompt_tokens": len(prompt),
                            "completion_tokens": len(gen),
                            "total_tokens": len(prompt) + len(gen),
                        },
                    },
                )

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(
            base_url=f"http://{self.host}:{self.port}/v1", model=self.model, api_key=self.token or "EMPTY"
        )

    def start(self) -> StubEndpoint:
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="stub-endpoint", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.server.shutdown()
            self._thread.join(5)
            self._thread = None
        self.server.server_close()


def make_ctx(
    tmp_path: Path,
    options: dict[str, Any] | None = None,
    *,
    deadline_s: float = 120.0,
    grpo: dict[str, Any] | None = None,
) -> InitContext:
    """An InitContext for ``init:env`` of nemo_gym, with its own event board."""
    config = RunConfig()
    for k, v in (grpo or {}).items():
        setattr(config.grpo, k, v)
    return fixtures.init_context(
        Role.ENV, "nemo_gym", config, NemoGymOptions, run_dir=tmp_path / "run",
        cache_dir=tmp_path / "cache", options=options or {}, deadline_s=deadline_s,
    )


def post_later(ctx: InitContext, delay_s: float, make: Any) -> threading.Thread:
    """Post ``generation.endpoint`` with ``make()`` after ``delay_s`` (a thread)."""

    def run() -> None:
        if not ctx.cancel.sleep(delay_s):
            ctx.events.post("generation.endpoint", make())

    t = threading.Thread(target=run, name="post-endpoint", daemon=True)
    t.start()
    return t


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def rollout_request(prompts: int, samples: int, *, step: int) -> RolloutRequest:
    """What the GRPO loop asks a Gym env for (Gym samples through its endpoint: no
    generation handle or tokenizer needed)."""
    return RolloutRequest(
        step=step,
        prompts=prompts,
        samples_per_prompt=samples,
        max_new_tokens=8,
        temperature=1.0,
        seed=step,
        generation=None,  # type: ignore[arg-type]
        tokenizer=None,
    )
