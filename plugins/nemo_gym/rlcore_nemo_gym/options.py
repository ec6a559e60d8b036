"""``env.options`` of the ``nemo_gym`` backend: plain data, imported by ``rlcore plugins``
and by the backend's own modules (never through the entry point)."""

from __future__ import annotations

from dataclasses import dataclass

from rlcore.config import bounded


@dataclass
class NemoGymOptions:
    """``env.options`` of the ``nemo_gym`` backend."""

    #: The Gym environment: a directory under Gym's ``resources_servers/``.
    #: The default is single-turn, needs no download and scores a ``<choice>`` tag.
    env_name: str = "bunsenbench_chemistry_mcq"
    #: Gym config file that defines the environment's servers (relative to Gym's
    #: install, or absolute). ``null``: ``resources_servers/<env_name>/configs/<env_name>.yaml``.
    config_path: str | None = None
    #: The agent server that runs each row. ``null``: the config's only agent.
    agent_name: str | None = None
    #: JSONL file of rows (tasks), relative to Gym's install or absolute.
    #: ``null``: the agent's first dataset in the config, else the env's ``data/example.jsonl``.
    data_path: str | None = None
    #: Python of the Gym venv. ``null``: ``$RLCORE_GYM_PYTHON``, else ``.venv-gym/bin/python``
    #: beside the running venv (``install.sh`` makes it).
    gym_python: str | None = None
    #: Model name Gym puts into its requests. It must equal the generation endpoint's
    #: ``model`` (rlcore's vLLM backend serves ``policy`` by default); if the endpoint
    #: announces another name, the Gym servers are restarted with it (one more start).
    model_name: str = "policy"
    #: API key Gym sends to the endpoint (same rule as ``model_name``).
    api_key: str = "EMPTY"
    #: Largest completion per model call. ``null``: ``grpo.max_new_tokens``.
    max_output_tokens: int | None = bounded(None, ge=1)
    #: Sampling temperature. ``null``: ``grpo.temperature``.
    temperature: float | None = bounded(None, ge=0)
    #: How long the Gym servers may take to start (import, spawn, every server ready).
    server_start_timeout_s: float = bounded(180.0, gt=0)
    #: How long the endpoint may take to answer ``GET /models`` once it was announced.
    endpoint_timeout_s: float = bounded(60.0, gt=0)
    #: Upper bound on one ``collect_rollouts`` call (all of its rollouts).
    rollout_timeout_s: float = bounded(600.0, gt=0)
    #: Rollouts in flight at once.
    max_concurrent_rollouts: int = bounded(64, ge=1)
    #: Run one short rollout at the end of init, so a broken chain (an endpoint without
    #: token ids, a failing verifier) fails setup rather than step 1. Off by default: it
    #: puts a generation on the setup's critical path (vLLM's first request after the
    #: first refit, 2.6-4.4 s on the CPU example) and step 1 follows at once anyway.
    verify_on_init: bool = False
    #: Niceness of Gym's processes (0-19). Their start has slack (it only has to be done
    #: when the endpoint serves), so by default they yield the CPU to the inits on the
    #: setup's critical path; on a CPU-only host rollouts then yield to generation too.
    nice: int = bounded(10, ge=0, le=19)
    #: Port of Gym's head server; 0 picks a free one (one per instance).
    head_port: int = bounded(0, ge=0, le=65535)
    #: How long Gym's servers get to stop gracefully before their process group is killed.
    shutdown_grace_s: float = bounded(15.0, ge=0)
