"""The ``nemo_gym`` env backend: start Gym's servers during setup, collect scored rollouts.

:func:`start_env` is ``rlcore_init_env``. It reads top to bottom:

1. find the Gym venv and start the launcher at once (Gym's servers start while
   policy and generation are still starting: this is where the overlap is);
2. meanwhile wait for the core event ``generation.endpoint`` (cancellable, with
   the task's deadline); the moment it arrives, write the endpoint's URL into
   the file Gym's model server reads on every request;
3. when both are done: check the endpoint answers, load the rows, optionally
   run one rollout end to end, and return the :class:`NemoGymEnv` handle.

The handle's ``collect_rollouts`` POSTs rows to Gym's ``/run`` over HTTP (httpx,
one asyncio loop per call): rlcore's venv never imports nemo_gym.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from rlcore.context import InitContext
from rlcore.declarations import ENDPOINT_EVENT
from rlcore.errors import Cancelled, CancelToken, ConfigError, Deadline, DeadlineExceeded
from rlcore.handles import Endpoint, Rollout, RolloutRequest
from rlcore.runtime.addresses import free_port
from rlcore_nemo_gym.servers import (
    REPORT_WAIT_S,
    GymError,
    GymServerDied,
    GymServers,
    LaunchSpec,
    check_env_name,
    find_gym_python,
)

log = logging.getLogger(__name__)

_instances = itertools.count()


def rows_for_step(n_rows: int, prompts: int, step: int) -> list[int]:
    """Row indices of ``step``: rows are cycled in file order, ``prompts`` per step
    (step 1 takes rows 0..prompts-1), wrapping around the file."""
    if n_rows <= 0:
        raise ValueError("no rows")
    start = (step - 1) * prompts
    return [(start + i) % n_rows for i in range(prompts)]


def to_sample(result: dict[str, Any]) -> Rollout:
    """One Gym ``/run`` result -> ``{"prompt_ids", "token_ids", "logprobs", "reward"}``.

    The *last* model turn that carries token ids is the sample: for a single-turn
    env that is the only one; in a multi-turn rollout its ``prompt_token_ids``
    already hold the whole conversation so far (earlier turns and tool results),
    so the completion is trained in the context it was generated in. Earlier
    turns are not trained on (``model_turns`` says how many there were).
    """
    output = (result.get("response") or {}).get("output") or []
    turns = [o for o in output if isinstance(o, dict) and o.get("generation_token_ids") is not None]
    if not turns:
        raise GymError(
            "a Gym rollout came back without token ids (no output item with generation_token_ids): "
            "the generation endpoint must return them for chat completions with "
            "return_token_ids / return_tokens_as_token_ids (vLLM's OpenAI server does)"
        )
    last = turns[-1]
    token_ids = [int(t) for t in last["generation_token_ids"]]
    logprobs = [float(x) for x in last.get("generation_log_probs") or []]
    if len(logprobs) != len(token_ids):
        raise GymError(
            f"a Gym rollout has {len(token_ids)} generated tokens but {len(logprobs)} logprobs"
        )
    reward = result.get("reward")
    if not isinstance(reward, int | float):
        raise GymError(f"a Gym rollout came back without a numeric reward (reward={reward!r})")
    return Rollout(
        prompt_ids=[int(t) for t in last["prompt_token_ids"]],
        token_ids=token_ids,
        logprobs=logprobs,
        reward=float(reward),
        model_turns=len(turns),
    )


@dataclass(frozen=True)
class RolloutSettings:
    """How the env runs rollouts and stops its servers (from ``env.options`` and ``grpo``).

    Attributes:
        max_output_tokens: the longest completion Gym asks the model for.
        temperature: the sampling temperature Gym asks the model for.
        rollout_timeout_s: the longest one batch of rollouts may take.
        max_concurrent: rollouts POSTed to Gym at once.
        shutdown_grace_s: how long Gym's servers get to stop before they are killed.
    """

    max_output_tokens: int
    temperature: float
    rollout_timeout_s: float
    max_concurrent: int
    shutdown_grace_s: float

    @classmethod
    def from_options(cls, options: Any, grpo: Any) -> RolloutSettings:
        """The env's settings: its own options, else the GRPO loop's sampling."""
        return cls(
            max_output_tokens=options.max_output_tokens or grpo.max_new_tokens,
            temperature=grpo.temperature if options.temperature is None else options.temperature,
            rollout_timeout_s=options.rollout_timeout_s,
            max_concurrent=options.max_concurrent_rollouts,
            shutdown_grace_s=options.shutdown_grace_s,
        )


class NemoGymEnv:
    """Handle of running Gym servers (``rlcore.handles.BackendHandle`` plus ``collect_rollouts``).

    Attributes:
        env_name: the Gym environment.
        agent_name: the agent server that runs each row.
        run_url: where rows are POSTed (the env's environment server, else its agent).
        rows: the tasks, in file order.
        endpoint: the generation endpoint Gym calls.
        timings: seconds from the start of init to: ``servers_ready``, ``endpoint_event``,
            ``endpoint_published``, ``ready`` (and ``verify`` for the check rollout).
    """

    def __init__(
        self,
        servers: GymServers,
        *,
        env_name: str,
        info: dict[str, Any],
        rows: list[dict[str, Any]],
        endpoint: Endpoint,
        cancel: CancelToken,
        sampling: RolloutSettings,
        timings: dict[str, float],
    ) -> None:
        self.servers = servers
        self.env_name = env_name
        self.agent_name: str = info["agent_name"]
        self.run_url: str = info["run_url"]
        self.rows = rows
        self.endpoint = endpoint
        self.cancel = cancel
        self.max_output_tokens = sampling.max_output_tokens
        self.temperature = sampling.temperature
        self.rollout_timeout_s = sampling.rollout_timeout_s
        self.max_concurrent = sampling.max_concurrent
        self.shutdown_grace_s = sampling.shutdown_grace_s
        self.timings = timings
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ rollouts

    def request(self, row: dict[str, Any], max_output_tokens: int | None = None) -> dict[str, Any]:
        """The ``/run`` body of one rollout of ``row`` (the row itself is not changed)."""
        body = copy.deepcopy(row)
        params = body.setdefault("responses_create_params", {})
        params["temperature"] = self.temperature
        params["max_output_tokens"] = max_output_tokens or self.max_output_tokens
        body["agent_ref"] = {"type": "responses_api_agents", "name": self.agent_name}
        return body

    def collect_rollouts(self, request: RolloutRequest) -> list[list[Rollout]]:
        """Run ``request.samples_per_prompt`` rollouts of each of ``request.prompts`` rows
        (:class:`rlcore.handles.EnvHandle`).

        Rows are cycled by step (:func:`rows_for_step`). Returns, per row, its samples
        ``{"prompt_ids", "token_ids", "logprobs", "reward", "model_turns"}`` (see
        :func:`to_sample`), in order whatever order Gym finishes them in. Gym's servers
        call the model through the generation endpoint with this env's own sampling
        options (``temperature``, ``max_output_tokens``); ``request.generation`` is not
        used. Bounded by ``rollout_timeout_s``; observes the run's cancellation.
        """
        if self._closed:
            raise GymError(f"nemo_gym env '{self.env_name}' is shut down")
        samples_per_prompt, step = request.samples_per_prompt, request.step
        picks = rows_for_step(len(self.rows), request.prompts, step)
        bodies = [self.request(self.rows[r]) for r in picks for _ in range(samples_per_prompt)]
        results = self._run(bodies, what=f"step {step} rollouts", timeout_s=self.rollout_timeout_s)
        samples = [to_sample(r) for r in results]
        return [
            samples[i * samples_per_prompt : (i + 1) * samples_per_prompt]
            for i in range(len(picks))
        ]

    def verify(self, timeout_s: float, deadline: Deadline | None = None) -> Rollout:
        """One short rollout of the first row, end to end; returns its sample."""
        result = self._run(
            [self.request(self.rows[0], max_output_tokens=min(self.max_output_tokens, 16))],
            what="the check rollout of init",
            timeout_s=timeout_s,
            deadline=deadline,
        )[0]
        return to_sample(result)

    def _run(
        self,
        bodies: list[dict[str, Any]],
        *,
        what: str,
        timeout_s: float,
        deadline: Deadline | None = None,
    ) -> list[dict[str, Any]]:
        self.servers.check_alive()
        limit = Deadline(timeout_s, f"nemo_gym {what}")
        if deadline is not None:
            limit = deadline.sooner(timeout_s, f"nemo_gym {what}")
        try:
            return asyncio.run(self._post_all(bodies, what, limit))
        except GymServerDied:
            raise  # named already
        except GymError as err:
            # A failed POST is often the first sign of a dead server (the agent answers
            # 500 for a resources server it cannot reach): name the dead part instead.
            dead = self.servers.wait_dead_part(REPORT_WAIT_S)
            if dead is None:
                raise
            first = str(err).split("\n", 1)[0]
            raise GymError(
                f"nemo_gym {what}: {dead} (the rollouts failed: {first[:300]}); "
                f"end of {self.servers.log_path}:\n{self.servers.log_tail(20)}"
            ) from err

    async def _post_all(
        self, bodies: list[dict[str, Any]], what: str, deadline: Deadline
    ) -> list[dict[str, Any]]:
        import httpx

        sem = asyncio.Semaphore(max(1, self.max_concurrent))
        results: list[dict[str, Any] | None] = [None] * len(bodies)
        timeout = httpx.Timeout(deadline.remaining() or self.rollout_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=max(1, self.max_concurrent))

        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

            async def one(i: int, body: dict[str, Any]) -> None:
                async with sem:
                    try:
                        r = await client.post(self.run_url, json=body)
                    except httpx.HTTPError as err:
                        raise GymError(
                            f"nemo_gym {what}: POST {self.run_url} failed: {type(err).__name__}: {err}"
                        ) from None
                if r.status_code != 200:
                    raise GymError(
                        f"nemo_gym {what}: POST {self.run_url} answered {r.status_code}: "
                        f"{r.text[:1500]}\nend of {self.servers.log_path}:\n{self.servers.log_tail(15)}"
                    )
                results[i] = r.json()

            tasks = [asyncio.create_task(one(i, b)) for i, b in enumerate(bodies)]
            pending: set[asyncio.Task[None]] = set(tasks)
            try:
                while pending:
                    if self.cancel.cancelled:
                        raise Cancelled(f"nemo_gym {what} cancelled: {self.cancel.reason}")
                    remaining = deadline.remaining()
                    if remaining is not None and remaining <= 0:
                        raise DeadlineExceeded(
                            f"nemo_gym {what}: {len(pending)} of {len(bodies)} rollouts at "
                            f"{self.run_url} did not finish within {deadline.seconds:g}s"
                        )
                    done, pending = await asyncio.wait(
                        pending,
                        timeout=0.2 if remaining is None else min(0.2, remaining),
                        return_when=asyncio.FIRST_EXCEPTION,
                    )
                    for t in done:
                        t.result()  # the first failure ends the batch
                    if pending and not self.servers.alive():
                        self.servers.check_alive()
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in results if r is not None]

    # ------------------------------------------------------------------ shutdown

    def pids(self) -> list[int]:
        """Live processes of the Gym servers' process group (for leak checks)."""
        return self.servers.pids()

    def shutdown(self) -> None:
        """Stop every Gym server (graceful, then the whole process group). Idempotent."""
        with self._lock:
            self._closed = True
            self.servers.stop(self.shutdown_grace_s)


# ---------------------------------------------------------------------- init


def _wait_endpoint_ready(endpoint: Endpoint, *, cancel: CancelToken, deadline: Deadline) -> float:
    """Poll ``GET {base_url}/models`` until it answers 200 and lists the model."""
    import httpx

    url = endpoint.base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    t0 = time.monotonic()
    last = "no answer"
    while True:
        cancel.raise_if_cancelled(
            f"nemo_gym: waiting for the generation endpoint {endpoint.base_url}"
        )
        try:
            left = deadline.remaining()
            timeout = 5.0 if left is None else max(0.05, min(5.0, left))
            r = httpx.get(url, headers=headers, timeout=timeout, trust_env=False)
            if r.status_code == 200:
                names = [m.get("id") for m in (r.json().get("data") or [])]
                if endpoint.model in names:
                    return time.monotonic() - t0
                last = f"it serves {names}, not model '{endpoint.model}'"
            else:
                last = f"status {r.status_code}"
        except (httpx.HTTPError, ValueError) as err:
            last = f"{type(err).__name__}: {err}"
        if deadline.expired:
            raise DeadlineExceeded(
                f"nemo_gym: the generation endpoint {endpoint.base_url} did not answer GET /models "
                f"with model '{endpoint.model}' within {deadline.seconds:g}s ({deadline.what}); "
                f"last: {last}"
            )
        cancel.sleep(min(0.25, deadline.remaining() or 0.25))


def load_rows(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as err:
                    raise ConfigError(
                        f"{path}:{n}: not JSON: {err}", key="env.options.data_path"
                    ) from None
    if not rows:
        raise ConfigError(f"rows file {path} has no rows", key="env.options.data_path")
    return rows


def _never_ready_nor_announced(ctx: InitContext, servers: GymServers) -> NoReturn:
    """The deadline of ``init:env`` passed before the endpoint event came and before Gym's
    servers were ready: one error that names the event, the servers and their log."""
    raise DeadlineExceeded(
        f"{ctx.task} ({ctx.backend}) waited {ctx.deadline.seconds:g}s for event "
        f"'{ENDPOINT_EVENT}', which never came (deadline of {ctx.deadline.what}); Gym's "
        f"servers were not ready either; end of {servers.log_path}:\n{servers.log_tail()}"
    )


def _check_options(ctx: InitContext) -> None:
    """Refuse options the env cannot run with, before anything starts."""
    o = ctx.options
    if o.max_concurrent_rollouts < 1:
        raise ConfigError(
            "env.options.max_concurrent_rollouts must be at least 1",
            key="env.options.max_concurrent_rollouts",
        )
    if not 0 <= o.nice <= 19:
        raise ConfigError(
            f"env.options.nice is {o.nice}; use 0 (off) to 19", key="env.options.nice"
        )
    if ctx.placement.pinned:
        # Gym's servers are children of the driver, which reads them: they stay beside it
        # (on loopback). Only the generation endpoint they call may be on another node.
        raise ConfigError(
            "backend 'nemo_gym' runs its servers beside the driver, so it cannot be placed on "
            "other nodes; remove placement.nodes.env (the generation may still be elsewhere)",
            key="placement.nodes.env",
        )


class _Startup:
    """One ``init:env``: Gym's servers started, the endpoint awaited alongside them.

    ``timings`` collects seconds since the start of init (see :class:`NemoGymEnv`).
    """

    def __init__(self, ctx: InitContext, python: Path) -> None:
        self.ctx = ctx
        self.o = ctx.options
        self.python = python
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.base = Path(ctx.run_dir) / "nemo_gym"
        self.base.mkdir(parents=True, exist_ok=True)

    def since_start(self) -> float:
        return time.monotonic() - self.t0

    def launch(self, model_name: str, api_key: str) -> GymServers:
        """Start Gym's servers (in a fresh work directory) for this model and key."""
        o = self.o
        workdir = Path(tempfile.mkdtemp(prefix=f"{o.env_name}-{next(_instances)}-", dir=self.base))
        spec = LaunchSpec.from_options(
            o,
            model_name=model_name,
            api_key=api_key,
            head_port=o.head_port or free_port(),
            workdir=workdir,
        )
        s = GymServers(self.python, spec, name=f"nemo_gym env '{o.env_name}'")
        s.start()
        return s

    def await_both(self, servers: GymServers) -> tuple[dict[str, Any], Endpoint]:
        """Wait for Gym's servers to be ready and for the endpoint event, both at once:
        Gym's servers come up while generation (and the first refit) are still running;
        the event may come before or after they are ready."""
        ctx = self.ctx
        start_deadline = ctx.deadline.sooner(self.o.server_start_timeout_s, "nemo_gym server start")
        info: dict[str, Any] | None = None
        endpoint: Endpoint | None = None
        while info is None or endpoint is None:
            if info is None:
                info = self._poll_servers(servers, start_deadline, endpoint_known=endpoint is not None)
            if endpoint is None and (ctx.events.posted(ENDPOINT_EVENT) or ctx.deadline.expired):
                endpoint = self._take_endpoint(servers)
            if info is None or endpoint is None:
                ctx.cancel.raise_if_cancelled(f"init:env ({ctx.backend})")
                ctx.cancel.sleep(0.05)
        return info, endpoint

    def _poll_servers(
        self, servers: GymServers, start_deadline: Deadline, *, endpoint_known: bool
    ) -> dict[str, Any] | None:
        """Gym's report if its servers are ready; None while they start; raises past the
        start deadline."""
        info = servers.poll_ready()
        if info is not None:
            self.timings["servers_ready"] = self.since_start()
            self.ctx.log.info(
                "Gym servers ready after %.2fs (%s)",
                self.timings["servers_ready"],
                info["run_via"],
            )
        elif start_deadline.expired:
            if not endpoint_known and self.ctx.deadline.expired:
                # The task's own deadline, with both waits outstanding: name both.
                _never_ready_nor_announced(self.ctx, servers)
            servers.wait_ready(cancel=self.ctx.cancel, deadline=start_deadline)  # raises, naming it
        return info

    def _take_endpoint(self, servers: GymServers) -> Endpoint:
        """The posted endpoint; published to Gym at once when Gym was started for its model."""
        endpoint = self.ctx.wait_event(ENDPOINT_EVENT)  # returns at once, or raises Deadline/Cancelled
        if not isinstance(endpoint, Endpoint):
            raise GymError(
                f"event {ENDPOINT_EVENT} carried {endpoint!r}, not an rlcore.handles.Endpoint"
            )
        self.timings["endpoint_event"] = self.since_start()
        self.ctx.log.info(
            "generation endpoint %s announced after %.2fs",
            endpoint.base_url,
            self.timings["endpoint_event"],
        )
        if (endpoint.model, endpoint.api_key) == (servers.spec.model_name, servers.spec.api_key):
            servers.publish_endpoint(endpoint.base_url)
            self.timings["endpoint_published"] = self.since_start()
        return endpoint

    def relaunch_for(self, servers: GymServers, endpoint: Endpoint) -> GymServers:
        """Gym puts the model name into every request: stop ``servers`` and start them
        again with the endpoint's (the caller holds the new ones before they are awaited,
        so a failed wait still ends them)."""
        log.warning(
            "nemo_gym: the endpoint serves model '%s' but Gym was started for '%s' "
            "(env.options.model_name / api_key); restarting Gym's servers with it",
            endpoint.model,
            servers.spec.model_name,
        )
        servers.stop(self.o.shutdown_grace_s)
        return self.launch(endpoint.model, endpoint.api_key)

    def ready_after_relaunch(self, servers: GymServers, endpoint: Endpoint) -> dict[str, Any]:
        """Wait for the relaunched servers, then hand them the endpoint."""
        info = servers.wait_ready(
            cancel=self.ctx.cancel, deadline=self.ctx.deadline.sooner(self.o.server_start_timeout_s)
        )
        servers.publish_endpoint(endpoint.base_url)
        self.timings["endpoint_published"] = self.timings["servers_ready"] = self.since_start()
        return info

    def finish(self, servers: GymServers, info: dict[str, Any], endpoint: Endpoint) -> NemoGymEnv:
        """Check the endpoint answers, load the rows, optionally run the check rollout."""
        ctx, o = self.ctx, self.o
        _wait_endpoint_ready(
            endpoint,
            cancel=ctx.cancel,
            deadline=ctx.deadline.sooner(o.endpoint_timeout_s, "nemo_gym endpoint check"),
        )
        env = NemoGymEnv(
            servers,
            env_name=o.env_name,
            info=info,
            rows=load_rows(info["data_path"]),
            endpoint=endpoint,
            cancel=ctx.cancel,
            sampling=RolloutSettings.from_options(o, ctx.config.grpo),
            timings=self.timings,
        )
        if o.verify_on_init:
            t = time.monotonic()
            env.verify(o.rollout_timeout_s, deadline=ctx.deadline)
            self.timings["verify"] = time.monotonic() - t
        self.timings["ready"] = self.since_start()
        ctx.log.info(
            "nemo_gym env '%s' ready: %s",
            o.env_name,
            {k: round(v, 3) for k, v in self.timings.items()},
        )
        _write_timings(servers.workdir, self.timings)
        return env


def start_env(ctx: InitContext) -> NemoGymEnv:
    """``rlcore_init_env`` of ``nemo_gym``: see the module docstring."""
    _check_options(ctx)
    o = ctx.options
    python = find_gym_python(o.gym_python)
    if o.config_path is None:
        check_env_name(python, o.env_name)
    startup = _Startup(ctx, python)
    # The run's token (a generation endpoint on another node checks it) is Gym's API key.
    servers = startup.launch(o.model_name, ctx.network.token or o.api_key)
    try:
        info, endpoint = startup.await_both(servers)
        if "endpoint_published" not in startup.timings:
            servers = startup.relaunch_for(servers, endpoint)
            info = startup.ready_after_relaunch(servers, endpoint)
        return startup.finish(servers, info, endpoint)
    except Cancelled:
        # Another task failed (or the run was interrupted): the executor gives a running
        # task a few seconds to stop before it abandons it, and Gym's own stop can take
        # longer than that on a loaded machine. Nothing to keep: end the servers at once.
        servers.stop(grace_s=0.0, term_s=1.0)
        raise
    except BaseException:
        servers.stop(o.shutdown_grace_s)
        raise


def _write_timings(workdir: Path, timings: dict[str, float]) -> None:
    try:
        (workdir / "timings.json").write_text(json.dumps(timings, indent=1))
    except OSError:
        pass


__all__ = [
    "NemoGymEnv",
    "RolloutSettings",
    "load_rows",
    "rows_for_step",
    "start_env",
    "to_sample",
]
