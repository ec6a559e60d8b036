"""One SGLang replica: a plain worker class that rlcore runs as a Ray actor.

A :class:`SGLangWorker` owns one SGLang server process group (see
:mod:`rlcore_sglang.server`) and talks to it over SGLang's own HTTP API:

* ``/generate`` (token ids in, token ids and logprobs out) for ``generate`` and
  ``logprobs``; SGLang's OpenAI-compatible ``/v1`` is the endpoint others use;
* refit, by what the channel's transport is (its ``process_group``,
  :class:`rlcore.refit.transports.base.RefitTransport`), never by its name:

  - a group transport (``collective``): ``/init_weights_update_group`` once per channel (the server's
    rank joins the core's channel: :mod:`rlcore_sglang.site.sitecustomize`), then
    per refit ``/begin_weight_update``, one ``/update_weights_from_distributed``
    per bucket (``load_format="flattened_bucket"``: one broadcast of the
    bucket's packed bytes, as the core's sender sends it) and
    ``/end_weight_update``; the session calls only when the server has those
    routes (read from its OpenAPI schema at start);
  - otherwise (``disk`` / ``shared_memory``): ``/update_weights_from_disk`` of the step
    directory the core published atomically (one safetensors file per bucket).

Module import is light (the driver imports this module to name the class);
transformers and torch are imported inside the methods that need them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.errors import RefitError
from rlcore.handles import Sample, SamplingParams
from rlcore.refit import transports
from rlcore.refit.worker import HFWeightSpecs
from rlcore.runtime import engine_http
from rlcore.runtime.engine_http import Request, sample_seeds
from rlcore.runtime.generation_group import (
    EngineArgs,
    EngineWorker,
    PauseRoutes,
    label_version,
    versions_from_spans,
)
from rlcore_sglang.server import ServerError, ServerProcess, find_sglang_python

log = logging.getLogger(__name__)

#: Group names of core refit channels in SGLang (must match the server's sitecustomize).
GROUP_PREFIX = "rlcore-refit:"
#: ``load_format`` of a bucket the server receives and does not load (after a rejection).
DRAIN = "rlcore_drain"
#: Routes of SGLang's weight-update session (0.5.21+); older servers have neither.
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")
#: How a refit holds the requests in flight: ``retract`` puts the running ones back in the
#: waiting queue with their KV cache freed (recomputed with the new weights on continue),
#: so the update's ``flush_cache`` succeeds; while paused, updates skip the writer lock
#: that every running request would otherwise hold them behind.
PAUSE = PauseRoutes(
    pause=("/pause_generation", {"mode": "retract"}),
    resume=("/continue_generation", None),
    abort=("/abort_request", {"abort_all": True}),
)


class NativeGenerate:
    """SGLang's own ``/generate`` as the engine's HTTP API
    (:class:`rlcore.runtime.engine_http.EngineAPI`): one request per call, a prompt's ``n``
    samples as ``n`` inputs with their own ``sampling_seed``; logprobs of given tokens
    through ``logprob_start_len``. ``rank`` names the worker in errors."""

    route = "/generate"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def generate_requests(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Request]:
        sampling = [
            {"temperature": float(params.temperature), "max_new_tokens": int(params.max_tokens),
             "sampling_seed": s}
            for seed in seeds for s in sample_seeds(seed, params.n)
        ]
        ids = [p for p in prompts for _ in range(params.n)]
        body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
        return [Request(self.route, body, prompts)]

    def samples(self, answer: Any, request: Request) -> list[Sample]:
        return [_sample(o["meta_info"]) for o in answer]

    def logprobs_requests(self, batch: list[tuple[list[int], list[int]]]) -> list[Request]:
        body = {
            "input_ids": [p + c for p, c in batch],
            "sampling_params": [{"temperature": 1.0, "max_new_tokens": 1}] * len(batch),
            "return_logprob": True,
            # entry 0 (the last prompt token) has no logprob; the rest are the completion's
            "logprob_start_len": [len(p) - 1 for p, _ in batch],
        }
        return [Request(self.route, body, batch)]

    def rows(self, answer: Any, request: Request) -> list[list[float]]:
        rows = []
        for (_, completion), o in zip(request.items, answer, strict=True):
            # Compare lengths, not ids: SGLang reports the id vocab_size - 1 as 0 (it clips
            # "padded" ids in input logprobs); the logprob itself is of the real token.
            entries = o["meta_info"]["input_token_logprobs"][1:]
            if len(entries) != len(completion):
                raise RuntimeError(
                    f"SGLang worker {self.rank}: {len(entries)} input logprobs for a completion "
                    f"of {len(completion)} tokens"
                )
            rows.append([float(lp) for lp, _, _ in entries])
        return rows


def _sample(meta: dict[str, Any]) -> Sample:
    """A :class:`rlcore.handles.Sample` of one ``/generate`` answer's ``meta_info``, with
    the version of each token: from SGLang's spans of weight labels (``weight_versions``,
    on finished requests), else its one ``weight_version`` (else the base class's
    counter gives them)."""
    entries = meta["output_token_logprobs"]
    sample: Sample = {
        "token_ids": [int(t) for _, t, _ in entries],
        "logprobs": [float(lp) for lp, _, _ in entries],
    }
    spans = meta.get("weight_versions")
    versions = (
        versions_from_spans(((s["version"], s["start"], s["end"]) for s in spans), len(entries))
        if spans
        else None
    )
    if versions is None and meta.get("weight_version") is not None:
        versions = [label_version(meta["weight_version"])] * len(entries)
    if versions is not None:
        sample["versions"] = versions
    return sample


def group_name(spec: Any) -> str:
    """SGLang group name of the core's collective channel ``spec`` (key and timeout in it)."""
    return f"{GROUP_PREFIX}{spec.key}:{spec.timeout_s:g}"


def _joins_group(spec: Any) -> bool:
    """Whether the server joins ``spec``'s torch.distributed group through SGLang's own
    routes (its transport's ``process_group``); otherwise it loads the step's files."""
    return transports.get(spec.transport).process_group


def server_env(threads: int, *, cuda: bool) -> dict[str, str]:
    """The environment a server gets beside the caller's (``ServerProcess`` puts the
    plugin's ``site`` directory first on its ``PYTHONPATH``)."""
    env = {
        # logprobs of the unscaled distribution (temperature 1), as rlcore.handles wants
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "1",
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not cuda:
        env["SGLANG_USE_CPU_ENGINE"] = ""  # set, it needs a CPU sgl_kernel that PyPI lacks
        env["RLCORE_SGLANG_SEEDS"] = "1"  # per-request seeds (site/sitecustomize.py)
    return env


def launch_args(
    model_dir: str, *, dtype: str, refit_fed: bool, options: Any, seed: int, cuda: bool
) -> list[str]:
    """``sglang.launch_server`` arguments of one replica (without host and port)."""
    o = options
    args = ["--model-path", model_dir, "--served-model-name", o.served_model_name]
    args += ["--dtype", dtype, "--random-seed", str(seed), "--max-total-tokens", str(o.max_total_tokens)]
    args += ["--skip-server-warmup"]
    if o.context_length:
        args += ["--context-length", str(o.context_length)]
    if refit_fed:
        args += ["--load-format", "dummy"]
    if cuda:
        args += ["--mem-fraction-static", str(o.mem_fraction_static)]
    else:  # the CPU route (plugins/sglang/README.md): torch attention and sampling, no graphs
        args += ["--device", "cpu", "--attention-backend", "torch_native"]
        args += ["--sampling-backend", "pytorch", "--disable-cuda-graph", "--disable-overlap-schedule"]
    return args + [str(a) for a in o.extra_args]


class SGLangWorker(HFWeightSpecs, EngineWorker):
    """One SGLang server of the generation worker group.

    Arguments as :class:`rlcore.runtime.generation_group.EngineWorker`'s (an
    :class:`~rlcore.runtime.generation_group.EngineArgs`): ``model_dir``
    gives config and tokenizer always, weights only when not ``refit_fed`` (then the
    server starts with ``--load-format dummy``); ``options`` are the backend's
    :class:`rlcore_sglang.options.SGLangOptions`; ``log_dir`` (required) is where the
    server's log goes; ``seed + rank`` is the server's ``--random-seed``. Besides:

    Args:
        threads: CPU threads of the server (``OMP_NUM_THREADS``).

    The actor imports neither torch nor transformers before its server is launched.
    """

    engine = "SGLang"
    inflight_refit = True

    def __init__(self, rank: int, world_size: int, args: EngineArgs, *, threads: int = 1) -> None:
        if args.log_dir is None:
            raise ValueError("an SGLang worker needs a log_dir (EngineArgs.log_dir) for its server's log")
        super().__init__(rank, world_size, args)
        self.threads = threads
        self.sessions = False  # the server has begin/end_weight_update
        #: Open collective channels: key -> SGLang group name.
        self.groups: dict[str, str] = {}

    # ------------------------------------------------------------------ start

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Start the server and wait until it serves; returns timings in seconds. The weight
        specs are worked out while it starts."""
        t0 = time.monotonic()
        python = find_sglang_python(self.options.python)
        cuda = self._on_cuda()
        args = launch_args(
            self.model_dir, dtype=self.dtype, refit_fed=self.refit_fed, options=self.options,
            seed=self.seed + self.rank, cuda=cuda,
        )
        env = server_env(self.threads, cuda=cuda)
        log_path = Path(self.log_dir) / f"sglang-server-{self.rank}-{os.getpid()}.log"
        self.server = ServerProcess(python, args, log_path=log_path, env=env, **self._bind())
        self._work_out_specs_ahead()
        try:
            ready = self.server.wait_ready(timeout_s)
            paths = self.server.request("/openapi.json", timeout_s=30).get("paths", {})
        except BaseException:
            self.server.stop()
            self.server = None
            raise
        self.sessions = all(r in paths for r in SESSION_ROUTES)
        return {"server_start_s": ready, "total_s": time.monotonic() - t0, "sessions": self.sessions}

    def _server(self) -> ServerProcess:
        if self.server is None:
            raise RuntimeError(f"SGLang worker {self.rank}: the server is not running")
        return self.server

    # ------------------------------------------------------------- inference

    def _generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Sample]]:
        """Sample ``j`` of prompt ``i`` is sampled with ``sampling_seed = seeds[i] + j``
        (on CPU through the server-side hook; on CUDA SGLang honours it with
        ``--enable-deterministic-inference`` in ``extra_args``).
        ``logprobs`` are the sampled tokens' log-probabilities at temperature 1;
        a completion ends with the EOS token when SGLang stopped on it.
        """
        return engine_http.generate(
            self._server(), NativeGenerate(self.rank), prompt_ids, params, seeds,
            timeout_s=self.options.call_timeout_s,
        )

    def _logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        return engine_http.logprobs(
            self._server(), NativeGenerate(self.rank), batch, timeout_s=self.options.call_timeout_s
        )

    # ----------------------------------------------------------------- refit

    def open_refit_channel(self, spec: Any, rank: int) -> None:
        """Join channel ``spec`` as ``rank``: a group transport through
        ``/init_weights_update_group`` (the server's rank joins; this worker holds no end)."""
        if not _joins_group(spec) or spec.key in self.groups:
            return
        name = group_name(spec)
        body = {
            "master_address": spec.addr, "master_port": int(spec.port), "rank_offset": int(rank),
            "world_size": int(spec.world_size), "group_name": name, "backend": spec.backend,
        }
        try:
            self._server().request("/init_weights_update_group", body, timeout_s=spec.timeout_s + 30)
        except ServerError as err:
            raise RefitError(f"SGLang worker {self.rank}: joining refit channel {spec.key}: {err}") from None
        self.groups[spec.key] = name

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> float:
        """Receive the buckets of ``step`` over ``spec`` and load them; returns seconds taken.

        Runs beside a generate in flight (:attr:`inflight_refit`): its requests are held
        (:data:`PAUSE`) while the weights load, and go on with the new ones; each
        finished request's ``meta_info.weight_versions`` says which tokens came from which.

        Raises :class:`RefitError` quoting the server if it rejects the update; the
        server's ``weight_version`` then stays the old one. Unless the rejection
        came before anything was loaded, this worker refuses to sample until a
        refit succeeds, and the requests it held are aborted.
        """
        t0 = time.monotonic()
        version = f"step-{step}"
        if _joins_group(spec):
            with self._held_for_refit(PAUSE, step, spec.timeout_s + 30):
                self._receive_collective(spec, step, buckets, version)
        else:
            self._receive_files(spec, step, version)
        self.loaded_version = step
        return time.monotonic() - t0

    def _receive_files(self, spec: Any, step: int, version: str) -> None:
        from rlcore.errors import Deadline
        from rlcore.publish import wait_for_artifact
        from rlcore.refit import channels

        directory = wait_for_artifact(
            channels.step_dir(spec, step), deadline=Deadline(spec.timeout_s, "refit files")
        )
        body = {
            "model_path": str(directory), "load_format": "safetensors",
            "weight_version": version, "flush_cache": True,
        }
        timeout = spec.timeout_s + 30
        with self._held_for_refit(PAUSE, step, timeout):
            self.stale = f"refit step {step} over {spec.transport} did not complete"
            try:
                self._server().request("/update_weights_from_disk", body, timeout_s=timeout)
            except ServerError as err:
                if err.message.startswith("Failed to get"):  # loader or file list: nothing loaded
                    self.stale = None
                raise RefitError(
                    f"SGLang worker {self.rank} rejected refit step {step} from {directory}: {err}"
                ) from None
            self.stale = None

    def _receive_collective(self, spec: Any, step: int, buckets: list[list[Any]], version: str) -> None:
        name = self.groups.get(spec.key)
        if name is None:
            raise RefitError(f"SGLang worker {self.rank}: refit channel {spec.key} was never opened")
        s = self._server()
        timeout = spec.timeout_s + 30
        if self.sessions:
            try:
                s.request("/begin_weight_update", {}, timeout_s=timeout)
            except ServerError as err:
                # Nothing received: leave the channel, so the sender fails now, not at its timeout.
                self._leave(spec)
                raise RefitError(
                    f"SGLang worker {self.rank} rejected refit step {step} "
                    f"(begin_weight_update): {err}"
                ) from None
        self.stale = f"refit step {step} over collective did not complete"
        failure: ServerError | None = None
        failed_at = -1
        try:
            for k, bucket in enumerate(buckets):
                last = k == len(buckets) - 1
                body = {
                    "names": [t.name for t in bucket],
                    "dtypes": [t.dtype for t in bucket],
                    "shapes": [list(t.shape) for t in bucket],
                    "group_name": name,
                    "load_format": "flattened_bucket" if failure is None else DRAIN,
                    "flush_cache": last and failure is None,
                    "weight_version": version if last and failure is None else None,
                }
                try:
                    s.request("/update_weights_from_distributed", body, timeout_s=timeout)
                except ServerError as err:
                    if failure is not None or not err.message.startswith("Failed to update"):
                        # A receive failed (or the server is gone): the channel is unusable.
                        self._leave(spec)
                        failure = failure or err
                        failed_at = k if failed_at < 0 else failed_at
                        break
                    failure, failed_at = err, k  # loading failed after the bytes arrived: drain
        finally:
            if self.sessions and s.alive():
                try:
                    s.request("/end_weight_update", {}, timeout_s=timeout)
                except ServerError as err:
                    failure = failure or err
        if failure is not None:
            raise RefitError(
                f"SGLang worker {self.rank} rejected refit step {step} at bucket "
                f"{failed_at + 1}/{len(buckets)}: {failure}"
            )
        self.stale = None

    def refit_ceiling(self, spec: Any, rank: int, step: int, nbytes: int) -> float:
        """Receive ``nbytes`` raw over ``spec``; seconds taken (``bench/``: the transport's ceiling).

        Collective: the server receives one broadcast of ``nbytes`` through SGLang's own
        route (a session and one ``/update_weights_from_distributed`` that loads
        nothing), so the ceiling includes SGLang's per-request cost. File transports:
        this worker reads the published file (the server would read it on this host).
        """
        from rlcore.refit import channels

        if not _joins_group(spec):
            return channels.ceiling(spec, rank, step, nbytes)
        s, timeout = self._server(), spec.timeout_s + 30
        t0 = time.monotonic()
        if self.sessions:
            s.request("/begin_weight_update", {}, timeout_s=timeout)
        try:
            body = {
                "names": ["rlcore-raw-bytes"], "dtypes": ["uint8"], "shapes": [[int(nbytes)]],
                "group_name": self.groups[spec.key], "load_format": DRAIN, "flush_cache": False,
            }
            s.request("/update_weights_from_distributed", body, timeout_s=timeout)
        finally:
            if self.sessions:
                s.request("/end_weight_update", {}, timeout_s=timeout)
        return time.monotonic() - t0

    def _leave(self, spec: Any) -> None:
        name = self.groups.pop(spec.key, None)
        if name is None or self.server is None or not self.server.alive():
            return
        try:
            self.server.request("/destroy_weights_update_group", {"group_name": name}, timeout_s=30)
        except ServerError as err:
            log.warning("SGLang worker %d: leaving refit channel %s failed: %s", self.rank, spec.key, err)

    def weight_version(self) -> int:
        """The version of the weights the server says it holds (its ``weight_version``
        label, ``step-<n>`` after the refit of step n: :func:`label_version`)."""
        return label_version(self._server().request("/model_info", timeout_s=30)["weight_version"])

    # ------------------------------------------------------------- lifecycle

    def endpoint_info(self) -> dict[str, Any]:
        """``{"base_url", "model", "api_key", "pid", "pgid", "log"}`` of this worker's server."""
        s = self._server()  # raises, naming this worker, when no server runs
        return {**self._endpoint_info(), "log": str(s.log_path)}

    def teardown(self) -> None:
        """Stop the server's process group. Idempotent."""
        self._stop_server()
        self.groups.clear()

    shutdown = teardown
