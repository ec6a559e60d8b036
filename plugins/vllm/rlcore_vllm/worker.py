"""One vLLM engine: a plain worker class that rlcore runs as a Ray actor.

A :class:`VLLMWorker` owns one engine (a data-parallel replica), either

* **in-process** (default): ``vllm.LLM`` inside the worker process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), called directly; or
* **server mode** (``serve_openai``): vLLM's OpenAI-compatible server as a child
  process group (see :mod:`rlcore_vllm.server`); generation, logprobs and refit
  then go over HTTP to it, so what the endpoint serves is exactly what refit
  loaded.

Either way, weights arrive through vLLM's own weight-transfer API with the
``rlcore`` engine of :mod:`rlcore_vllm.transfer`.

Module import is light (the driver imports this module to name the class);
vllm, torch and transformers are imported inside the methods.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlcore.handles import Sample, SamplingParams
from rlcore.refit.worker import HFWeightSpecs
from rlcore.runtime import engine_http
from rlcore.runtime.engine_http import Request
from rlcore.runtime.generation_group import (
    EngineArgs,
    EngineWorker,
    PauseRoutes,
    label_version,
    versions_from_spans,
)
from rlcore_vllm import adapters
from rlcore_vllm.stepped import StepGate

log = logging.getLogger(__name__)


#: How a refit holds the server's requests in flight: ``keep`` freezes them in the
#: scheduler, and ``clear_cache`` (which vLLM 0.32 applies to ``keep`` too, whatever its
#: route's docstring says) preempts the running ones: their KV cache and the prefix cache
#: are dropped, and recomputed with the new weights after ``/resume``.
PAUSE = PauseRoutes(
    pause=("/pause?mode=keep&clear_cache=true", None),
    resume=("/resume", None),
    abort=("/abort_requests", None),
)


def kv_cache_bytes(gib: float) -> int:
    """``kv_cache_gib`` as vLLM's ``kv_cache_memory_bytes``."""
    return int(gib * (1 << 30))


class Completions:
    """vLLM server's OpenAI ``/v1/completions`` as the engine's HTTP API
    (:class:`rlcore.runtime.engine_http.EngineAPI`): one prompt per request, token ids in,
    ``return_token_ids`` and the sampled tokens' logprobs out; logprobs of given tokens
    through ``prompt_logprobs``."""

    route = "/v1/completions"

    def __init__(self, model: str) -> None:
        self.model = model

    def generate_requests(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[Request]:
        return [
            Request(self.route, {
                "model": self.model, "prompt": p, "n": params.n, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "seed": int(s), "logprobs": 0,
                "return_token_ids": True,
            }, [p])
            for p, s in zip(prompts, seeds, strict=True)
        ]

    def samples(self, answer: Any, request: Request) -> list[Sample]:
        return [
            {
                "token_ids": list(c["token_ids"]),
                "logprobs": [float(x) for x in c["logprobs"]["token_logprobs"]],
            }
            for c in sorted(answer["choices"], key=lambda c: c["index"])
        ]

    def logprobs_requests(self, batch: list[tuple[list[int], list[int]]]) -> list[Request]:
        return [
            Request(self.route, {"model": self.model, "prompt": p + c, "max_tokens": 1, "prompt_logprobs": 0}, [(p, c)])
            for p, c in batch
        ]

    def rows(self, answer: Any, request: Request) -> list[list[float]]:
        [(prompt, completion)] = request.items
        ids = prompt + completion
        lps = answer["choices"][0]["prompt_logprobs"]  # JSON keys are token ids as strings
        return [[float(lps[k][str(ids[k])]["logprob"]) for k in range(len(prompt), len(ids))]]


def _sample(c: Any) -> Sample:
    """A :class:`rlcore.handles.Sample` of vLLM's ``CompletionOutput``, with the version of
    each token when vLLM reported its spans (on a finished output, which ``LLM.generate``
    returns)."""
    sample: Sample = {
        "token_ids": list(c.token_ids),
        "logprobs": [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs, strict=True)],
    }
    spans = c.weight_versions
    if spans:
        versions = versions_from_spans(((s.version, s.start, s.end) for s in spans), len(c.token_ids))
        if versions is not None:
            sample["versions"] = versions
    return sample


class VLLMWorker(HFWeightSpecs, EngineWorker):
    """One vLLM engine of the generation worker group.

    Arguments as :class:`rlcore.runtime.generation_group.EngineWorker`'s (an
    :class:`~rlcore.runtime.generation_group.EngineArgs`), and ``log_level``: ``model_dir``
    gives config and tokenizer always, weights only when not ``refit_fed`` (then the
    engine is built with dummy weights); ``options`` are the backend's
    :class:`rlcore_vllm.options.VLLMOptions`; ``log_dir`` is where server mode writes the
    server's log; ``seed`` is the engine's global seed; server mode binds where
    ``network`` says (loopback, or this node's address with the run's token); ``cuda``
    is the device the handle decided (in server mode the actor itself never imports torch).
    """

    engine = "vLLM"
    #: Refits land in a generate in flight: in server mode the server's pause holds its
    #: requests (:data:`PAUSE`); in-process they load between two engine steps (:attr:`gate`).
    inflight_refit = True
    #: The in-process engine (``vllm.LLM``); None in server mode.
    llm: Any = None
    #: Drives the in-process engine's step loop (:class:`rlcore_vllm.stepped.StepGate`):
    #: every call into ``llm`` from the refit thread goes through it.
    gate: Any = None
    #: The adapter every request names (``LoRARequest``; server mode: by its name), once an
    #: adapter refit loaded one (:mod:`rlcore_vllm.adapters`); None: the weights alone.
    lora: Any = None

    def __init__(self, rank: int, world_size: int, args: EngineArgs, *, log_level: str = "WARNING") -> None:
        super().__init__(rank, world_size, args)
        self.log_level = log_level

    def _set_vllm_env(self) -> None:
        """vLLM's settings of this process, made before vLLM is imported (it reads them
        then; a server started from here inherits them): the in-process engine without an
        engine-core subprocess, and vLLM's log level. Set here rather than as the actor's
        environment, so the actor can run in a worker Ray started ahead of time
        (:func:`rlcore.runtime.resources.actor_runtime_env`)."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["VLLM_LOGGING_LEVEL"] = self.log_level

    # ------------------------------------------------------------------ start

    def _engine_args(self) -> dict[str, Any]:
        o = self.options
        args: dict[str, Any] = {
            "model": self.model_dir,
            "dtype": self.dtype,
            "seed": self.seed,
            "max_model_len": o.max_model_len,
            "enforce_eager": o.enforce_eager,
        }
        if self.refit_fed:
            args["load_format"] = "dummy"
        args.update(adapters.engine_args(self.adapters))
        if self._on_cuda():
            args["gpu_memory_utilization"] = o.gpu_memory_utilization
        else:
            args["kv_cache_memory_bytes"] = kv_cache_bytes(o.kv_cache_gib)
        return args

    def _uncompiled(self) -> bool:
        """Whether vLLM's small ``torch.compile`` helpers run eagerly in this engine.

        With ``enforce_eager`` on CPU nothing of the model is compiled, yet vLLM's sampler
        still compiles its logprob-rank helper (``batched_count_greater_than``) with
        inductor at the first request that asks for logprobs: 2-4 s of C++ compilation
        inside the run's first step (the first refit's check). Run eagerly, the helper
        computes the same counts. On CUDA, or with compilation asked for, vLLM's choice
        stands.
        """
        return bool(self.options.enforce_eager) and not self._on_cuda()

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Build the engine (or start the server and wait for it); returns timings in seconds."""
        t0 = time.monotonic()
        self._set_vllm_env()
        if self.options.serve_openai:
            return {
                "server_start_s": self._start_server(timeout_s),
                "total_s": time.monotonic() - t0,
            }
        from rlcore_vllm.transfer import BACKEND, register

        register(strict=True)
        if self._uncompiled():
            import torch._dynamo

            # What TORCHDYNAMO_DISABLE=1 sets, for this process only.
            torch._dynamo.config.disable = True
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        t1 = time.monotonic()
        self.llm = LLM(
            **self._engine_args(), weight_transfer_config=WeightTransferConfig(backend=BACKEND)
        )
        self.gate = StepGate(self.llm)
        t2 = time.monotonic()
        return {"import_s": t1 - t0, "engine_s": t2 - t1, "total_s": t2 - t0}

    def _start_server(self, timeout_s: float) -> float:
        import json

        from rlcore_vllm.server import ServerProcess
        from rlcore_vllm.transfer import BACKEND

        o = self.options
        args = self._engine_args()
        # With adapters the served name is the adapter's (what clients of the endpoint get).
        served = o.served_model_name + (adapters.BASE_SUFFIX if self.adapters is not None else "")
        argv = ["--model", args.pop("model"), "--served-model-name", served]
        argv += ["--weight-transfer-config", json.dumps({"backend": BACKEND})]
        for flag in ("enforce_eager", "enable_lora"):
            if args.pop(flag, False):
                argv.append("--" + flag.replace("_", "-"))
        for key, value in args.items():
            argv += ["--" + key.replace("_", "-"), str(value)]
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self.adapters is not None:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter
        if self._uncompiled():
            env["TORCHDYNAMO_DISABLE"] = "1"
        allow = os.environ.get("VLLM_PLUGINS")
        if allow is not None and "rlcore_weight_transfer" not in allow.split(","):
            # An allowlist that leaves out our engine would make the server fail at start.
            env["VLLM_PLUGINS"] = ",".join(
                [p for p in allow.split(",") if p] + ["rlcore_weight_transfer"]
            )
        log_dir = Path(self.log_dir) if self.log_dir else Path("/tmp")
        self.server = ServerProcess(
            argv,
            log_path=log_dir / f"vllm-server-{self.rank}-{os.getpid()}.log",
            env=env,
            **self._bind(),
        )
        self._work_out_specs_ahead()
        try:
            return self.server.wait_ready(timeout_s)
        except BaseException:
            self.server.stop()
            raise

    # ------------------------------------------------------------- inference

    def _generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seeds: Sequence[int]
    ) -> list[list[Sample]]:
        """Prompt ``i`` samples with seed ``seeds[i]`` (vLLM gives its ``j``-th sample
        ``seeds[i] + j``). ``logprobs`` are the sampled tokens' log-probabilities
        under the model (before temperature), as :meth:`logprobs` computes them.
        In-process, ``versions`` come from the engine's spans of weight labels
        (``CompletionOutput.weight_versions``); server mode's ``/v1/completions`` has none,
        so the base class gives the version of the weights loaded at the call's start.
        """
        if self.server is not None:
            return engine_http.generate(
                self.server, Completions(self._served_name()), prompt_ids, params, seeds,
                timeout_s=self.options.call_timeout_s,
            )
        from vllm import SamplingParams as VLLMSampling

        sampling = [
            VLLMSampling(
                n=params.n,
                temperature=params.temperature,
                max_tokens=params.max_tokens,
                logprobs=0,
                seed=int(s),
                detokenize=False,
            )
            for s in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompt_ids], sampling, use_tqdm=False, lora_request=self.lora
        )
        return [[_sample(c) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outputs]

    def _logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        if self.adapters is not None and len(batch) > 1:
            # vLLM 0.32's LoRA logits processor indexes prompt logprobs by request, not by
            # token: two requests in one engine step fail (CPU) or mix rows. One at a time,
            # a request's rows share its one index. Only the refit's probe batch comes here.
            return [row for pair in batch for row in self._logprobs([pair])]
        if self.server is not None:
            return engine_http.logprobs(
                self.server, Completions(self._served_name()), batch,
                timeout_s=self.options.call_timeout_s,
            )
        from vllm import SamplingParams as VLLMSampling

        sampling = VLLMSampling(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p) + list(c)} for p, c in batch], sampling, use_tqdm=False,
            lora_request=self.lora,
        )
        result = []
        for (prompt, completion), o in zip(batch, outputs, strict=True):
            ids = list(prompt) + list(completion)
            lps = o.prompt_logprobs  # entry k: logprob of ids[k] given ids[:k] (entry 0 is None)
            result.append([float(lps[k][ids[k]].logprob) for k in range(len(prompt), len(ids))])
        return result

    def weight_version(self) -> int:
        """The version of the weights the engine says it holds (its weight label: vLLM's
        ``get_weight_version``, server mode's ``/weight_info``)."""
        if self.server is not None:
            label = self.server.request("/weight_info", timeout_s=30)["weight_version"]
        else:
            label = self.gate.run(self.llm.get_weight_version)  # not beside a refit job
        return label_version(label)

    # ----------------------------------------------------------------- refit

    def open_refit_channel(self, spec: Any, rank: int) -> None:
        """Join refit channel ``spec`` as ``rank`` (vLLM's ``init_weight_transfer_engine``)."""
        from rlcore_vllm.transfer import init_info

        info = init_info(spec, rank)
        if self.server is not None:
            self.server.post(
                "/init_weight_transfer_engine", {"init_info": info}, timeout_s=spec.timeout_s + 30
            )
        else:
            self.gate.run(lambda: self.llm.init_weight_transfer_engine({"init_info": info}))

    def refit_ceiling(self, spec: Any, rank: int, step: int, nbytes: int) -> float:
        """Receive ``nbytes`` raw over an open channel (bench: the transport's ceiling).

        In-process engines only: the channel lives in this process.
        """
        from rlcore.refit import channels

        if self.server is not None:
            raise RuntimeError("refit_ceiling needs the in-process engine (serve_openai=false)")
        return channels.ceiling(spec, rank, step, nbytes)

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> float:
        """Receive the buckets of ``step`` over ``spec`` and load them; returns seconds taken.

        vLLM's start/update/finish weight update, beside a generate in flight
        (:attr:`inflight_refit`). In server mode the requests in flight are held meanwhile
        (:data:`PAUSE`, which also drops the KV and prefix caches computed with the old
        weights) and go on with the new weights. In-process the update runs between two
        engine steps (:meth:`_load_between_steps`), with the same effect.

        A failure leaves the worker refusing to sample until a refit succeeds, and the
        requests in flight are aborted (none may go on with half-loaded weights).
        """
        from rlcore_vllm.transfer import update_info

        t0 = time.monotonic()
        info = update_info(spec, step, buckets)
        version = f"step-{step}"
        self.stale = f"refit step {step} over {spec.transport} did not complete"
        if self.server is not None:
            s, timeout = self.server, spec.timeout_s + 30
            with self._held_for_refit(PAUSE, step, timeout):
                s.post("/start_weight_update", timeout_s=timeout)
                s.post("/update_weights", {"update_info": info}, timeout_s=timeout)
                s.post("/finish_weight_update", {"weight_version": version}, timeout_s=timeout)
        else:
            self.gate.run(lambda: self._load_between_steps(lambda: self._update_weights(info, version), step))
        self.stale = None
        self.loaded_version = step
        return time.monotonic() - t0

    def _update_weights(self, info: Any, version: str) -> None:
        """vLLM's start/update/finish weight update of one refit, labelled ``version``."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(weight_version=version)

    def _load_between_steps(self, load: Callable[[], None], step: int) -> None:
        """The in-process ``load`` of refit ``step`` (weights or an adapter), between two
        steps of a generate in flight (or alone): then the running requests are preempted and
        the prefix cache reset, so their KV is recomputed with what was loaded. A failure
        aborts the requests in flight (the call they belong to fails: :attr:`refit_aborts`)."""
        try:
            load()
        except BaseException:
            self.refit_aborts += 1
            self.gate.abort_all()
            raise
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            log.warning("vLLM worker %d: prefix cache not reset after refit step %d", self.rank, step)

    def _served_name(self) -> str:
        """The model requests to the server name: the adapter's once one is loaded (the
        endpoint's name: its readers come after the first refit), else the base's."""
        name = self.options.served_model_name
        return name if self.adapters is None or self.lora is not None else name + adapters.BASE_SUFFIX

    def _load_adapter(self, path: Path, step: int) -> None:
        """Serve the adapter in ``path`` in place of the one loaded (vLLM's in-place
        reload), labelled ``step-<step>``; as a weight refit, beside a generate in flight:
        server mode holds its requests (:data:`PAUSE`), in-process it loads between two
        engine steps and the running requests are recomputed with the new adapter."""
        version, name = f"step-{step}", self.options.served_model_name
        if self.server is not None:
            s, timeout = self.server, self.options.call_timeout_s
            with self._held_for_refit(PAUSE, step, timeout):
                s.post(
                    "/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": str(path), "load_inplace": True},
                    timeout_s=timeout,
                )
                s.post("/update_weight_version", {"new_version": version}, timeout_s=timeout)
        else:
            request = adapters.request(name, str(path), reload=True)
            self.gate.run(lambda: self._load_between_steps(lambda: self._add_adapter(request, version), step))
        self.lora = adapters.request(name, str(path))

    def _add_adapter(self, request: Any, version: str) -> None:
        """vLLM's in-place reload of the adapter, labelled ``version`` as a weight update is."""
        self.llm.llm_engine.add_lora(request)
        self.llm.llm_engine.set_weight_version(version)

    # ------------------------------------------------------------- lifecycle

    def endpoint_info(self) -> dict[str, Any] | None:
        """``{"base_url", "model", "api_key", "pid", "pgid"}`` of this worker's server, or None in-process."""
        return None if self.server is None else self._endpoint_info()

    def teardown(self) -> None:
        """Stop the server's process group (server mode) and close refit channels. Idempotent."""
        self._stop_server()
        if self.llm is not None:
            try:
                self.llm.shutdown_weight_transfer_engine()
            except Exception as err:  # teardown must not raise
                log.debug("vLLM worker %d: closing refit channels failed: %s", self.rank, err)
        # No DistributedWorker.teardown: the default process group here is vLLM's own.

    shutdown = teardown
