"""The loggers themselves: TensorBoard, Weights & Biases and MLflow, each behind the same
three calls (:class:`Sink`), their libraries imported when opened. What they are sent, and
when, is :mod:`rlcore.app.loggers`'s.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from rlcore.config import RunConfig

__all__ = ["MLflowSink", "Sink", "TensorBoardSink", "WandbSink", "make_sinks"]


class Sink(Protocol):
    """One logger. Called on the loggers' thread only, in order: ``open``, ``log`` per
    line, ``close`` once (also after a failed ``open``: it must close what it opened)."""

    #: The config key that enables it (``logging.wandb``): in reports and ``loggers.json``.
    key: str

    def open(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """Start (or, with ``saved``, continue) the logger's run; return what to save for
        ``--resume`` (``saved`` is what an earlier run of this directory returned)."""
        ...

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        """Log one metrics line's values at ``step`` (``wall_time``: epoch seconds)."""
        ...

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        """Log a step's decoded samples (``samples.jsonl``'s lines: ``prompt``,
        ``completion``, ``reward``, ``weight_version``) as the logger shows text."""
        ...

    def close(self, outcome: str) -> None:
        """Flush and close; ``outcome`` is ``finished``, ``failed`` or ``interrupted``."""
        ...


#: The columns of a step's samples in every logger (``samples.jsonl``'s keys).
SAMPLE_COLUMNS = ("prompt", "completion", "reward", "weight_version")


def samples_markdown(lines: list[dict[str, Any]]) -> str:
    """A step's samples as a Markdown table (TensorBoard's text plugin renders it)."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    rows = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    rows += ["| " + " | ".join(cell(line.get(c)) for c in SAMPLE_COLUMNS) + " |" for line in lines]
    return "\n".join(rows)


class TensorBoardSink:
    """Event files under ``<run_dir>/tensorboard`` (PyTorch's writer of the ``tensorboard``
    package's format). ``resumed_after``: the step a resumed run's checkpoint holds."""

    key = "logging.tensorboard"

    def __init__(self, run_dir: Path, resumed_after: int | None = None) -> None:
        self.log_dir = run_dir / "tensorboard"
        self.resumed_after = resumed_after
        self._writer: Any = None

    def open(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run adds an event file beside the first: TensorBoard reads them all. The
        # steps after the checkpoint are done again: TensorBoard is told to drop the earlier
        # files' events from there on (a purge), so it shows each step once, as done last.
        purge = None if self.resumed_after is None else self.resumed_after + 1
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=10, purge_step=purge)
        return {"log_dir": str(self.log_dir)}

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step, walltime=wall_time)

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        self._writer.add_text("samples", samples_markdown(lines), global_step=step)

    def close(self, outcome: str) -> None:
        if self._writer is not None:
            self._writer.close()


class WandbSink:
    """A W&B run (``logging.wandb``) whose files are under ``<run_dir>/wandb``; its config
    is the run's."""

    key = "logging.wandb"

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self._run: Any = None

    def open(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        import wandb
        from omegaconf import OmegaConf

        cfg = self.config.logging.wandb
        self._run = wandb.init(
            mode=cfg.mode,
            project=cfg.project,
            entity=cfg.entity,
            dir=str(self.run_dir),
            name=self.run_dir.name,
            config=OmegaConf.to_container(OmegaConf.structured(self.config)),
            id=saved.get("id"),
            resume="allow" if saved.get("id") else None,
            reinit="create_new",  # a run of its own, beside any the user's code has open
            settings=wandb.Settings(console="off"),  # rlcore's console stays rlcore's
        )
        self._run.define_metric("*", step_metric="step")
        return {"id": self._run.id, "mode": cfg.mode}

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        self._run.log({"step": step, **values})

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        import wandb

        table = wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[line.get(c) for c in SAMPLE_COLUMNS] for line in lines])
        self._run.log({"step": step, "samples": table})

    def close(self, outcome: str) -> None:
        import wandb

        if self._run is not None:
            self._run.finish(exit_code=0 if outcome == "finished" else 1)
        # W&B's service process (wandb-core) outlives its runs until the interpreter exits;
        # nothing of the run may (the CLI would end it as a leftover after an interrupt).
        # Left alone while the user's code has a run of its own open.
        if wandb.run is None:
            wandb.teardown(exit_code=0 if outcome == "finished" else 1)


class MLflowSink:
    """An MLflow run (``logging.mlflow``), its params the run's config (dotted keys).

    The default store is SQLite at ``<run_dir>/mlflow/mlflow.db`` (artifacts beside it):
    MLflow 3 refuses its file store unless told otherwise, and SQLite needs no server.
    """

    key = "logging.mlflow"
    #: MLflow's limits on one ``log_batch`` and on a param's value.
    _BATCH, _PARAM_CHARS = 100, 6000

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, run_dir
        self._client: Any = None
        self._run_id: str | None = None

    def tracking_uri(self) -> str:
        uri = self.config.logging.mlflow.tracking_uri
        return uri if uri else f"sqlite:///{(self.run_dir / 'mlflow' / 'mlflow.db').resolve()}"

    def open(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        cfg, uri = self.config.logging.mlflow, self.tracking_uri()
        if not cfg.tracking_uri:
            (self.run_dir / "mlflow").mkdir(parents=True, exist_ok=True)
        client = MlflowClient(tracking_uri=uri)
        if saved.get("run_id") and saved.get("tracking_uri") == uri:
            self._run_id = str(saved["run_id"])
            client.update_run(self._run_id, status="RUNNING")
        else:
            experiment = client.get_experiment_by_name(cfg.experiment)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = None if cfg.tracking_uri else (self.run_dir / "mlflow" / "artifacts").resolve().as_uri()
                experiment_id = client.create_experiment(cfg.experiment, artifact_location=artifacts)
            self._run_id = client.create_run(experiment_id, run_name=self.run_dir.name).info.run_id
            params = [Param(k, v[: self._PARAM_CHARS]) for k, v in _flat_config(self.config).items()]
            for i in range(0, len(params), self._BATCH):
                client.log_batch(self._run_id, params=params[i : i + self._BATCH])
        self._client = client
        return {"run_id": self._run_id, "tracking_uri": uri}

    def log(self, values: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        ms = int(wall_time * 1000)
        metrics = [Metric(key, value, ms, step) for key, value in values.items()]
        for i in range(0, len(metrics), self._BATCH):
            self._client.log_batch(self._run_id, metrics=metrics[i : i + self._BATCH])

    def samples(self, lines: list[dict[str, Any]], step: int) -> None:
        text = "".join(json.dumps(line) + "\n" for line in lines)
        self._client.log_text(self._run_id, text, f"samples/step-{step:06d}.jsonl")

    def close(self, outcome: str) -> None:
        if self._client is not None and self._run_id is not None:
            status = {"finished": "FINISHED", "interrupted": "KILLED"}.get(outcome, "FAILED")
            self._client.set_terminated(self._run_id, status=status)


def _flat_config(config: RunConfig) -> dict[str, str]:
    """The config's leaves by dotted key, as strings (MLflow params are strings)."""
    from omegaconf import OmegaConf

    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, Mapping) and node:
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = json.dumps(node) if not isinstance(node, str) else node

    walk(OmegaConf.to_container(OmegaConf.structured(config)), "")
    return out


def make_sinks(config: RunConfig, run_dir: Path, resumed_after: int | None = None) -> list[Sink]:
    """The loggers the config enables (``resumed_after``: the step of the checkpoint a
    resumed run continues from)."""
    sinks: list[Sink] = []
    if config.logging.tensorboard:
        sinks.append(TensorBoardSink(run_dir, resumed_after))
    if config.logging.wandb.enabled:
        sinks.append(WandbSink(config, run_dir))
    if config.logging.mlflow.enabled:
        sinks.append(MLflowSink(config, run_dir))
    return sinks
