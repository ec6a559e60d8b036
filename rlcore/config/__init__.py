"""The run's configuration: OmegaConf structured config, YAML plus ``key=value`` overrides.

Every section is a dataclass with documented defaults. :func:`load_config`
merges a YAML file and command-line overrides onto the schema and turns
OmegaConf's errors into :class:`~rlcore.errors.ConfigError` messages that name
the key, the closest valid key, the value and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcore.errors import ConfigError

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from omegaconf.errors import OmegaConfBaseException

# omegaconf is imported where a config is loaded, not here: the contract's modules import
# this package (context.py: placement), and a plugin's module must import nothing heavy.


@dataclass(frozen=True)
class Bounds:
    """The range a numeric config value must lie in (``None``: no bound on that side).

    Declared once, next to the field, with :func:`bounded`; :func:`check_bounds`
    enforces every one of them when the config is loaded.
    """

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def describe(self) -> str:
        """``at least 1``, ``greater than 0``, ``between 0 and 1``, in words."""
        low = f"at least {self.ge:g}" if self.ge is not None else None
        low = f"greater than {self.gt:g}" if self.gt is not None else low
        high = f"at most {self.le:g}" if self.le is not None else None
        return " and ".join(p for p in (low, high) if p) or "any number"

    def holds(self, value: float) -> bool:
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )

    def example(self) -> str:
        """A value inside the range, for messages (``grpo.steps=1``)."""
        if self.ge is not None:
            return f"{self.ge:g}"
        if self.gt is not None:
            return f"{self.gt + 1:g}"
        return f"{self.le:g}" if self.le is not None else "0"


def bounded(
    default: Any, *, ge: float | None = None, gt: float | None = None, le: float | None = None
) -> Any:
    """A dataclass field whose value must lie in a range (``steps: int = bounded(20, ge=1)``).

    ``default`` is the default value, or a factory (``dict``) for a mapping whose
    every value must lie in the range. ``None`` values (optional fields) are not checked.
    """
    meta = {"bounds": Bounds(ge=ge, gt=gt, le=le)}
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class TinyModelConfig:
    """Shape of the tiny Llama-family model rlcore creates when ``model.path`` is unset.

    Sized so that vLLM's CPU attention accepts it (head size 32: hidden / heads).
    """

    seed: int = bounded(0, ge=0)
    hidden_size: int = bounded(128, ge=1)
    num_layers: int = bounded(2, ge=1)
    num_heads: int = bounded(4, ge=1)
    num_kv_heads: int = bounded(2, ge=1)
    intermediate_size: int = bounded(256, ge=1)
    max_position_embeddings: int = bounded(512, ge=1)
    #: Shift of the end-of-sequence token's logit, in nats, for any input (0: none). A trained
    #: model ends a completion when its answer is done; random weights end it by chance,
    #: about one token in fifty with this vocabulary. A negative shift lets the random model
    #: write completions of realistic length (-3: about 400 of up to 512 tokens on average);
    #: training moves it like any weight. Kept by ``model.preset``.
    eos_logit_bias: float = bounded(0.0, le=0)


@dataclass
class ModelConfig:
    """The model trained and served."""

    #: A Hugging Face checkpoint directory. ``null``: rlcore creates a tiny model locally.
    path: str | None = None
    #: Compute dtype of policy and generation: float32, bfloat16 or float16.
    dtype: str = "float32"
    #: A named shape for the model rlcore creates (``model.path`` null): one of
    #: :data:`MODEL_PRESETS` (``llama-1b``: Llama 3.2 1B's layers, ~1 B parameters). It sets
    #: every ``model.tiny`` field but ``seed``. ``null``: ``model.tiny`` as given.
    preset: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


#: ``model.preset`` values: shapes of real model families for the locally made model
#: (random weights, the character-level tokenizer of :mod:`rlcore.models.tiny`).
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {},  # the default shape of model.tiny
    # Llama 3.2 1B's decoder (16 layers, hidden 2048, 32 heads of 64, 8 KV heads, MLP 8192):
    # 0.97 B parameters with the small vocabulary, 1.9 GiB in bf16.
    "llama-1b": dict(
        hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
        intermediate_size=8192, max_position_embeddings=2048,
    ),
    # Qwen2-0.5B's decoder shape (24 layers, hidden 896, 14 heads of 64, 2 KV heads, MLP
    # 4864) as a Llama (no attention bias): 0.36 B parameters with the small vocabulary.
    "qwen2-0.5b": dict(
        hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
        intermediate_size=4864, max_position_embeddings=2048,
    ),
}


@dataclass
class RoleConfig:
    """One role's backend and its options."""

    #: The backend serving this role, by its declared name (``rlcore plugins`` lists them).
    #: ``null`` only for ``env``: the run has no environment backend.
    backend: str | None = None
    #: Number of workers (ranks) of the role's worker group.
    workers: int = bounded(1, ge=1)
    #: Devices per worker: GPUs when CUDA is present, else CPU cores reserved in Ray.
    devices_per_worker: float = bounded(1.0, gt=0)
    #: Backend-specific options; checked against the backend's declared options dataclass.
    options: dict[str, Any] = field(default_factory=dict)


#: Values of ``generation.on_worker_loss``.
WORKER_LOSS_ACTIONS = ("abort", "replace")
#: Values of ``refit.check``.
REFIT_CHECKS = ("sampled", "probe")
#: Values of ``refit.adapters``.
REFIT_ADAPTERS = ("auto", "merged")
#: ``grpo.on_mismatch``: what a step above ``grpo.max_mismatch`` does (:mod:`rlcore.app.mismatch`).
MISMATCH_ACTIONS = ("warn", "stop")
#: Values of ``grpo.loss_aggregation`` (:class:`rlcore.handles.LossOptions`).
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
#: Values of ``grpo.rollout_correction`` (:class:`rlcore.handles.LossOptions`).
ROLLOUT_CORRECTIONS = ("none", "tis", "mis")


@dataclass
class GenerationConfig(RoleConfig):
    #: Start without reading checkpoint weights; the first refit brings them.
    #: Only for backends that declare ``refit_fed``.
    refit_fed: bool = False
    #: What the run does when a generation worker's process is lost mid-run: ``abort``
    #: (stop with an error naming the worker) or ``replace`` (shut the generation down,
    #: start it again through its backend's init hook, refit it from the policy's current
    #: weights and retry the interrupted phase of the step; see rlcore/app/recovery.py).
    #: A lost policy rank always aborts.
    on_worker_loss: str = "abort"


@dataclass
class NodeSelector:
    """Which Ray nodes a role's actors may run on, in Ray's own terms (both must hold).

    ``resources``: custom resources each actor asks for (``{node_a: 0.01}``): Ray places
    it only on a node that declares them (``ray start --resources='{"node_a": 1}'``).
    ``labels``: node labels the node must carry (Ray's ``label_selector``, exact values;
    ``ray start --labels=zone=a``). Empty: anywhere Ray finds room.
    """

    resources: dict[str, float] = bounded(dict, gt=0)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class RoleNodes:
    """``placement.nodes``: a :class:`NodeSelector` per role (only on a joined cluster)."""

    policy: NodeSelector = field(default_factory=NodeSelector)
    generation: NodeSelector = field(default_factory=NodeSelector)
    env: NodeSelector = field(default_factory=NodeSelector)


@dataclass
class PlacementConfig:
    #: Policy and generation share the same devices (and take turns on them).
    colocated: bool = False
    #: Colocated: the roles whose backends declare ``memory_handoff`` give device memory
    #: back while the other works (the generation sleeps through the train step, the
    #: policy through sampling). ``false`` keeps both resident: no handoff time per step,
    #: both roles' peaks at once.
    memory_handoff: bool = True
    #: Where each role's actors run on a cluster joined by ``cluster.address``
    #: (``placement.nodes.policy.resources: {node_a: 0.01}``); see :class:`NodeSelector`.
    nodes: RoleNodes = field(default_factory=RoleNodes)


@dataclass
class ClusterConfig:
    #: Address of an existing Ray cluster to join (``host:port``, ``ray://host:port``, or
    #: ``auto``: Ray's own lookup); ``local``: always a new embedded cluster; ``null``: the
    #: cluster this process is a driver of, else ``$RAY_ADDRESS`` (set by ``ray job submit``),
    #: else a new embedded one (rlcore/runtime/join.py, docs/ray-cluster.md).
    address: str | None = None
    #: CPUs the embedded cluster offers (``null``: all of this machine's).
    num_cpus: int | None = bounded(None, ge=1)
    #: GPUs the embedded cluster offers (``null``: Ray detects them).
    num_gpus: int | None = bounded(None, ge=0)
    #: A worker whose process stops answering its liveness probe (frozen, SIGSTOPped) is
    #: declared hung within this many seconds, in any phase: the run ends naming it, or a
    #: generation engine is replaced under ``on_worker_loss: replace``. A long call that
    #: keeps its process running is never a hang (rlcore/runtime/liveness.py). ``null``
    #: turns the probe off: workers' calls then run on their process's main thread (the
    #: probe needs a thread of its own) and a frozen worker ends only a call's own timeout.
    #: A cluster's head whose GCS is gone (it accepts no connection) ends the run within it
    #: too, in one line naming the GCS's address (rlcore/runtime/head_watch.py); ``null``
    #: leaves that to Ray (about 60 s, then Ray's own line).
    hang_timeout_s: float | None = bounded(30.0, gt=0)


@dataclass
class SetupConfig:
    #: Deadline for all of setup, in seconds.
    deadline_s: float = bounded(1800.0, gt=0)
    #: Per-task deadlines in seconds, by task name (``init:policy: 600``); others use ``deadline_s``.
    task_deadline_s: dict[str, float] = bounded(dict, gt=0)
    #: How long tearing down one started backend may take before it is abandoned.
    shutdown_timeout_s: float = bounded(60.0, gt=0)
    #: A setup task still running after this many seconds is named on the run's console,
    #: once (``setup: init:generation still running after 60 s``).
    slow_task_warn_s: float = bounded(60.0, gt=0)
    #: Where shared artifacts (converted checkpoints, the tiny model) are cached.
    #: ``null``: ``$RLCORE_CACHE_DIR`` or ``~/.cache/rlcore``.
    cache_dir: str | None = None


@dataclass
class PluginsConfig:
    #: Only these plugins load (entry-point names). ``null``: all installed plugins;
    #: ``$RLCORE_PLUGINS`` (comma-separated) narrows the set further.
    allow: list[str] | None = None


@dataclass
class RefitConfig:
    #: ``auto`` picks the best transport both sides declare for the placement;
    #: otherwise one of collective, shared_memory, cuda_ipc, disk.
    transport: str = "auto"
    #: Upper bound on one bucket of streamed weights, in MiB.
    bucket_mb: float = bounded(64.0, gt=0)
    #: Timeout of every refit collective and of one whole refit, in seconds.
    timeout_s: float = bounded(300.0, gt=0)
    #: Prompts in the probe batch compared after each refit (token_mult_prob_error).
    probe_prompts: int = bounded(4, ge=1)
    #: Stop the run when ``refit/token_mult_prob_error`` after a refit exceeds this
    #: (the generation computes with other weights than the policy trains); the
    #: step's metrics are written first. ``null`` disables the check.
    max_mult_prob_error: float | None = bounded(1.05, ge=1)
    #: How each refit is checked (``refit/token_mult_prob_error``): ``sampled`` compares
    #: the logprobs the next step already has (the generation's of its samples against
    #: the policy's of the same tokens; the last step's refit with the probe after the
    #: loop); ``probe`` runs the probe batch through both after every refit (costlier).
    check: str = "sampled"
    #: Where the policy trains LoRA adapters (``policy.options.lora``): ``auto`` refits the
    #: adapters alone to a generation that takes them in place (``takes_adapters``) and
    #: merged weights to any other; ``merged`` always sends merged weights (base + the
    #: adapters' product). ``rlcore plan`` says which a run gets.
    adapters: str = "auto"


@dataclass
class GRPOConfig:
    """The small GRPO loop of ``rlcore run``."""

    #: Training steps (each: rollout, reward, train step, refit).
    steps: int = bounded(20, ge=1)
    #: Prompts (or env rows) per step.
    prompts_per_step: int = bounded(8, ge=1)
    #: Samples per prompt (G): advantages are normalised within each group.
    samples_per_prompt: int = bounded(8, ge=1)
    #: Longest completion, in tokens.
    max_new_tokens: int = bounded(8, ge=1)
    #: Sampling temperature (0: greedy).
    temperature: float = bounded(1.0, ge=0)
    #: Policy learning rate (0: the policy does not move).
    learning_rate: float = bounded(5e-3, ge=0)
    #: PPO-style ratio clip: the ratio is kept within [1 - clip_eps, 1 + clip_eps].
    clip_eps: float = bounded(0.2, gt=0)
    #: The ratio's upper clip, 1 + clip_eps_high, when set (DAPO's clip-higher: room for
    #: unlikely tokens to grow; 0.28 in the paper). null: clip_eps on both sides.
    clip_eps_high: float | None = bounded(None, gt=0)
    #: How the per-token losses make the step's loss (:data:`LOSS_AGGREGATIONS`):
    #: ``token_mean`` (every completion token of the batch weighs the same),
    #: ``seq_mean_token_mean`` (each sample's token mean, averaged over samples: GRPO's
    #: paper), ``seq_mean_token_sum_norm`` (each sample's token sum over max_new_tokens,
    #: averaged over samples: Dr. GRPO, no length bias).
    loss_aggregation: str = "token_mean"
    #: Correction for the sampler/trainer mismatch (:data:`ROLLOUT_CORRECTIONS`): each
    #: token's loss weighed by w = p_policy / p_generation of its sampled token, ``tis``
    #: truncated at rollout_correction_cap, ``mis`` masked (weight 0) above it; ``none``.
    rollout_correction: str = "none"
    rollout_correction_cap: float = bounded(2.0, ge=1)
    #: DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage) is
    #: dropped and the env asked for more prompts, up to dynamic_sampling_max_draws extra
    #: calls a step, until prompts_per_step groups teach (the env must declare extra_draws).
    dynamic_sampling: bool = False
    dynamic_sampling_max_draws: int = bounded(4, ge=1)
    seed: int = bounded(0, ge=0)
    #: How many weight versions a trained sample may lag the policy (k). 0: the
    #: synchronous loop (generation waits through every train step and refit). k >= 1:
    #: the rollouts of step t+1..t+k are generated while step t trains, and a sample
    #: whose oldest token is more than k versions old is not trained on; the policy
    #: backend must declare it accepts k (``rlcore plan`` shows the schedule).
    max_staleness: int = bounded(0, ge=0)
    #: Bound on the sampler/trainer mismatch of each step's own samples: the token mean of
    #: the k3 estimate of KL(generation || policy) (``mismatch/kl``; null: no bound). Above
    #: it, ``on_mismatch`` warns (the step trains) or stops the run before the step trains.
    max_mismatch: float | None = bounded(None, gt=0)
    on_mismatch: str = "warn"


@dataclass
class CheckpointConfig:
    """Training checkpoints (``rlcore run --resume DIR`` continues from the last one)."""

    #: Save every N steps, and after the last step (0: no checkpoints).
    every_steps: int = bounded(0, ge=0)
    #: How many complete checkpoints to keep (older ones go only once a newer is complete).
    keep: int = bounded(2, ge=1)
    #: Also keep, for good, the checkpoint of every step that is a multiple of N (0: none):
    #: milestones to evaluate or go back to later. By step number, so restarts keep them too.
    keep_every: int = bounded(0, ge=0)
    #: On SIGTERM (preemption), finish the step in progress and save before stopping,
    #: within ``sigterm_grace_s``; past it the run stops as without checkpoints.
    on_sigterm: bool = True
    sigterm_grace_s: float = bounded(120.0, gt=0)
    #: Where checkpoints go (default: ``<run_dir>/checkpoints``).
    dir: str | None = None
    #: Overlap the save with the next step's rollouts where the policy declares it may.
    overlap: bool = True
    #: Where the policy declares staged saves, the loop waits only for the copy of the
    #: state off the devices; the files are written in the background (false: the
    #: loop waits for the whole save).
    staged: bool = True


@dataclass
class WandbConfig:
    """Weights & Biases (``pip install 'rlcore[wandb]'``): a W&B run whose history is the
    run's ``metrics.jsonl`` lines and whose config is the run's (:mod:`rlcore.app.loggers`)."""

    #: Log to W&B. Its files go under ``<run_dir>/wandb``.
    enabled: bool = False
    #: The W&B project (and, online, where the run appears).
    project: str = "rlcore"
    #: The W&B team or user (``null``: W&B's default for the logged-in user).
    entity: str | None = None
    #: One of :data:`WANDB_MODES`: ``offline`` writes under the run directory with no
    #: network (upload later with ``wandb sync``); ``online`` syncs as it goes.
    mode: str = "offline"


#: ``logging.wandb.mode`` values (W&B's own ``disabled`` is ``logging.wandb.enabled=false``).
WANDB_MODES = ("offline", "online")


@dataclass
class MLflowConfig:
    """MLflow (``pip install 'rlcore[mlflow]'``): an MLflow run whose metrics are the run's
    ``metrics.jsonl`` lines and whose params are the run's config (dotted keys)."""

    #: Log to MLflow.
    enabled: bool = False
    #: The tracking store. ``null``: SQLite at ``<run_dir>/mlflow/mlflow.db``, no server
    #: (``mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow/mlflow.db`` shows it).
    tracking_uri: str | None = None
    #: The MLflow experiment the run goes in (created if missing).
    experiment: str = "rlcore"


@dataclass
class LoggingConfig:
    """Where a run's metrics go besides ``metrics.jsonl`` (each an optional extra, checked
    before the run starts): the same lines, step for step (:mod:`rlcore.app.loggers`)."""

    #: TensorBoard event files under ``<run_dir>/tensorboard`` (``pip install 'rlcore[tensorboard]'``).
    tensorboard: bool = False
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MLflowConfig = field(default_factory=MLflowConfig)
    #: Write ``samples.jsonl`` every N steps (0: never): prompt, completion, reward and
    #: weight version of a few samples (:mod:`rlcore.app.samples`; ``rlcore samples DIR``).
    samples_every: int = bounded(1, ge=0)
    #: Samples written per such step, one per prompt first.
    samples_per_step: int = bounded(4, ge=1)


@dataclass
class RunConfig:
    """A whole rlcore run."""

    name: str = "rlcore"
    model: ModelConfig = field(default_factory=ModelConfig)
    policy: RoleConfig = field(default_factory=RoleConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    env: RoleConfig = field(default_factory=RoleConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    setup: SetupConfig = field(default_factory=SetupConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)
    refit: RefitConfig = field(default_factory=RefitConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    #: Parent of run directories; each run writes ``<output_dir>/<name>-<timestamp>``.
    output_dir: str = "runs"


ROLE_SECTIONS = ("policy", "generation", "env")


def _closest(key: str, candidates: Sequence[str]) -> str | None:
    match = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.5)
    return match[0] if match else None


def _keys_at(schema: DictConfig, parent: str) -> list[str]:
    from omegaconf import DictConfig, OmegaConf

    node: Any = schema
    if parent:
        node = OmegaConf.select(schema, parent)
    if isinstance(node, DictConfig):
        return [str(k) for k in node.keys()]
    return []


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str) -> ConfigError:
    from omegaconf.errors import (
        ConfigAttributeError,
        ConfigKeyError,
        MissingMandatoryValue,
        ValidationError,
    )

    full_key = str(getattr(err, "full_key", "") or "")
    if isinstance(err, ConfigAttributeError | ConfigKeyError):
        parent, _, leaf = full_key.rpartition(".")
        valid = _keys_at(schema, parent)
        hint = _closest(leaf, valid)
        where = f"in section '{parent}'" if parent else "at the top level"
        msg = f"{source}: unknown config key '{full_key}' {where}."
        msg += f" Did you mean '{(parent + '.') if parent else ''}{hint}'?" if hint else ""
        msg += f" Valid keys: {', '.join(valid)}."
        return ConfigError(msg, key=full_key)
    if isinstance(err, ValidationError):
        expected = _expected_type(schema, full_key)
        value = str(getattr(err, "msg", err)).splitlines()[0]
        return ConfigError(
            f"{source}: wrong value for config key '{full_key}': {value}"
            + (f" (expected {expected})" if expected else ""),
            key=full_key,
        )
    if isinstance(err, MissingMandatoryValue):
        return ConfigError(f"{source}: config key '{full_key}' must be set", key=full_key)
    return ConfigError(f"{source}: {err}", key=full_key or None)


def _expected_type(schema: DictConfig, full_key: str) -> str | None:
    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = full_key.rpartition(".")
    node: Any = OmegaConf.select(schema, parent) if parent else schema
    if not isinstance(node, DictConfig):
        return None
    obj_type = OmegaConf.get_type(node)
    if obj_type is None or not dataclasses.is_dataclass(obj_type):
        return None
    for f in dataclasses.fields(obj_type):
        if f.name == leaf:
            t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            return str(t)
    return None


def _merge(schema: DictConfig, other: Any, source: str) -> DictConfig:
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        merged = OmegaConf.merge(schema, other)
        assert isinstance(merged, DictConfig)
        return merged
    except OmegaConfBaseException as err:
        raise _explain(err, schema, source) from None


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Build a :class:`RunConfig` from a YAML file and ``key=value`` overrides.

    ``base`` (a plain mapping) is merged first, then the file, then the overrides.
    Raises :class:`ConfigError` for unknown keys, wrong types and bad overrides.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = OmegaConf.structured(RunConfig)
    cfg = schema
    if base:
        cfg = _merge(cfg, OmegaConf.create(dict(base)), "base config")
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{p}' does not exist")
        try:
            loaded = OmegaConf.load(p)
        except Exception as err:  # YAML syntax errors come in several types
            raise ConfigError(f"{p}: cannot parse YAML: {err}") from None
        cfg = _merge(cfg, loaded, str(p))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override '{item}' is not of the form key=value (e.g. grpo.steps=5)", key=item
            )
        try:
            dot = OmegaConf.from_dotlist([item])
        except Exception as err:  # OmegaConf's own errors, and YAML's for a malformed value
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(
                f"override '{item}' does not parse ({first}); quote values with spaces, "
                "e.g. 'setup.task_deadline_s={init:policy: 60}'",
                key=item.split("=")[0],
            ) from None
        cfg = _merge(cfg, dot, f"override '{item}'")
    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise _explain(err, schema, "config") from None
    assert isinstance(run, RunConfig)
    validate_run_config(run)
    return run


def check_bounds(obj: Any, prefix: str = "") -> None:
    """Check every :func:`bounded` field of a config dataclass, recursively.

    Raises :class:`ConfigError` for the first value out of range, naming the key,
    the value, the range and a value that would do.
    """
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_bounds(value, f"{key}.")
            continue
        bounds: Bounds | None = f.metadata.get("bounds")
        if bounds is None or value is None:
            continue
        items = value.items() if isinstance(value, Mapping) else [(None, value)]
        for sub, v in items:
            where = key if sub is None else f"{key}.{sub}"
            if isinstance(v, bool) or not isinstance(v, int | float) or v != v or not bounds.holds(v):
                raise ConfigError(
                    f"config key '{where}' is {v!r}; it must be {bounds.describe()} "
                    f"(e.g. {where}={bounds.example()})",
                    key=where,
                )


def apply_model_preset(cfg: RunConfig) -> None:
    """``model.preset``'s shape into ``model.tiny`` (its seed and end-of-sequence shift kept);
    unknown names refused."""
    name = cfg.model.preset
    if name is None:
        return
    if name not in MODEL_PRESETS:
        hint = _closest(name, sorted(MODEL_PRESETS))
        raise ConfigError(
            f"config key 'model.preset' is {name!r}; expected one of {sorted(MODEL_PRESETS)}"
            + (f" (did you mean {hint!r}?)" if hint else "") + ", or null",
            key="model.preset",
        )
    kept = TinyModelConfig(seed=cfg.model.tiny.seed, eos_logit_bias=cfg.model.tiny.eos_logit_bias)
    cfg.model.tiny = dataclasses.replace(kept, **MODEL_PRESETS[name])


def validate_run_config(cfg: RunConfig) -> None:
    """Checks that a single key's type cannot express: ranges (:func:`bounded`), choices,
    required keys and relations between keys. Needs nothing but the config."""
    for section in ("policy", "generation"):
        if not getattr(cfg, section).backend:
            raise ConfigError(
                f"config key '{section}.backend' must be set (`rlcore plugins` lists the backends)",
                key=f"{section}.backend",
            )
    check_bounds(cfg)
    apply_model_preset(cfg)
    _check_model(cfg)
    _check_choices(cfg)
    _check_names(cfg)


def _check_model(cfg: RunConfig) -> None:
    """``model.dtype`` is one rlcore runs; ``model.path`` is not blank; the tiny model's
    heads divide its hidden size and its key-value heads divide its heads."""
    if cfg.model.dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(
            f"config key 'model.dtype' is {cfg.model.dtype!r}; expected float32, bfloat16 or float16",
            key="model.dtype",
        )
    if cfg.model.path is not None and not str(cfg.model.path).strip():
        raise ConfigError(
            "config key 'model.path' is empty; set it to a Hugging Face checkpoint directory, "
            "or to null for the tiny local model",
            key="model.path",
        )
    tiny = cfg.model.tiny
    if cfg.model.path is None and tiny.hidden_size % tiny.num_heads:
        raise ConfigError(
            f"config key 'model.tiny.hidden_size' is {tiny.hidden_size}, which "
            f"model.tiny.num_heads={tiny.num_heads} does not divide; pick a multiple of it",
            key="model.tiny.hidden_size",
        )
    if cfg.model.path is None and tiny.num_heads % tiny.num_kv_heads:
        raise ConfigError(
            f"config key 'model.tiny.num_kv_heads' is {tiny.num_kv_heads}, which does not divide "
            f"model.tiny.num_heads={tiny.num_heads}; pick a divisor of it",
            key="model.tiny.num_kv_heads",
        )


def _check_choices(cfg: RunConfig) -> None:
    """``refit.transport``, ``generation.on_worker_loss``, ``refit.check`` and
    ``logging.wandb.mode`` are among their choices."""
    from rlcore.declarations import Transport

    allowed_transports = {"auto", *(t.value for t in Transport)}
    if cfg.refit.transport not in allowed_transports:
        hint = _closest(cfg.refit.transport, sorted(allowed_transports))
        raise ConfigError(
            f"config key 'refit.transport' is {cfg.refit.transport!r}; expected one of "
            f"{sorted(allowed_transports)}" + (f" (did you mean '{hint}'?)" if hint else ""),
            key="refit.transport",
        )
    if cfg.generation.on_worker_loss not in WORKER_LOSS_ACTIONS:
        raise ConfigError(
            f"config key 'generation.on_worker_loss' is {cfg.generation.on_worker_loss!r}; expected "
            f"one of {list(WORKER_LOSS_ACTIONS)} (abort: stop the run; replace: start a new engine)",
            key="generation.on_worker_loss",
        )
    if cfg.refit.check not in REFIT_CHECKS:
        raise ConfigError(
            f"config key 'refit.check' is {cfg.refit.check!r}; expected one of "
            f"{list(REFIT_CHECKS)} (sampled: the next step's sampling logprobs; probe: the probe "
            "batch after every refit)",
            key="refit.check",
        )
    if cfg.refit.adapters not in REFIT_ADAPTERS:
        raise ConfigError(
            f"config key 'refit.adapters' is {cfg.refit.adapters!r}; expected one of "
            f"{list(REFIT_ADAPTERS)} (auto: the adapters alone where the generation takes them; "
            "merged: merged weights always)",
            key="refit.adapters",
        )
    if cfg.grpo.on_mismatch not in MISMATCH_ACTIONS:
        raise ConfigError(
            f"config key 'grpo.on_mismatch' is {cfg.grpo.on_mismatch!r}; expected one of "
            f"{list(MISMATCH_ACTIONS)} (warn: say so and train; stop: end the run before the step trains)",
            key="grpo.on_mismatch",
        )
    for key, allowed in (("loss_aggregation", LOSS_AGGREGATIONS), ("rollout_correction", ROLLOUT_CORRECTIONS)):
        value = getattr(cfg.grpo, key)
        if value not in allowed:
            hint = _closest(value, allowed)
            raise ConfigError(
                f"config key 'grpo.{key}' is {value!r}; expected one of {list(allowed)}"
                + (f" (did you mean '{hint}'?)" if hint else "") + " (docs/grpo.md)",
                key=f"grpo.{key}",
            )
    if cfg.logging.wandb.mode not in WANDB_MODES:
        raise ConfigError(
            f"config key 'logging.wandb.mode' is {cfg.logging.wandb.mode!r}; expected one of "
            f"{list(WANDB_MODES)} (offline: files under the run directory, no network)",
            key="logging.wandb.mode",
        )


def _check_names(cfg: RunConfig) -> None:
    """``name`` and ``output_dir`` are set; ``name`` can name a directory."""
    for key in ("name", "output_dir"):
        if not str(getattr(cfg, key)).strip():
            raise ConfigError(f"config key '{key}' is empty; give it a value", key=key)
    if "/" in cfg.name or cfg.name in (".", ".."):
        raise ConfigError(
            f"config key 'name' is {cfg.name!r}; it names the run directory, so it may not "
            "contain '/' (set output_dir for the parent directory)",
            key="name",
        )


def resolve_options(options: Mapping[str, Any], schema: type | None, *, section: str, backend: str) -> Any:
    """Check ``<section>.options`` against a backend's options dataclass.

    Returns an instance of ``schema`` (or a plain dict when the backend declares no
    schema). Unknown keys and wrong types raise :class:`ConfigError` naming the key,
    the backend and the closest valid option; so do values outside a range the
    dataclass declares with :func:`bounded` (``timeout_s: float = bounded(300.0, gt=0)``).
    A ``ValueError`` or :class:`ConfigError` the dataclass's ``__post_init__`` raises comes
    out as one :class:`ConfigError` naming ``<section>.options.<field>`` (the option its
    message or key names; ``<section>.options`` where it names none) and the backend.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if schema is None:
        return dict(options)
    base = OmegaConf.structured(schema)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(dict(options)))
        resolved = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, schema, section=section, backend=backend) from None
    except (ConfigError, ValueError) as err:
        # A rule of the dataclass's __post_init__ (omegaconf's own errors are caught above).
        raise _post_init_error(err, schema, section=section, backend=backend) from None
    try:
        check_bounds(resolved, f"{section}.options.")
    except ConfigError as err:
        raise ConfigError(f"{err} (an option of backend '{backend}')", key=err.key) from None
    return resolved


def _omegaconf_error(err: Exception, schema: type, *, section: str, backend: str) -> ConfigError:
    """The one-line :class:`ConfigError` for an unknown option or a value of the wrong type."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    leaf = str(getattr(err, "full_key", "") or "")
    if isinstance(err, ConfigAttributeError | ConfigKeyError):
        # A nested option (policy.options.lora.rnk): suggest among its own section's keys.
        parent, _, name = leaf.rpartition(".")
        valid = _option_names(schema, parent)
        hint = _closest(name, valid)
        at = f"{section}.options." + (f"{parent}." if parent else "")
        return ConfigError(
            f"unknown option '{section}.options.{leaf}' for backend '{backend}'."
            + (f" Did you mean '{at}{hint}'?" if hint else "")
            + f" Valid options{f' of {at[:-1]}' if parent else ''}: {', '.join(valid) or '(none)'}.",
            key=f"{section}.options.{leaf}",
        )
    return ConfigError(
        f"wrong value for '{section}.options.{leaf}' of backend '{backend}': "
        f"{str(getattr(err, 'msg', err)).splitlines()[0]}",
        key=f"{section}.options.{leaf}",
    )


def _post_init_error(err: ConfigError | ValueError, schema: type, *, section: str, backend: str) -> ConfigError:
    """A rule of the options dataclass's ``__post_init__`` broken: one line that names the
    key (``<section>.options.<field>``: the error's key, else the first field its message
    names, else ``<section>.options``) and the backend."""
    message = " ".join(str(err).split()) or type(err).__name__
    prefix = f"{section}.options"
    key = getattr(err, "key", None)
    fields = [f.name for f in dataclasses.fields(schema)]
    if key in fields:
        key = f"{prefix}.{key}"
    if not key:
        named = sorted(
            (m.start(), name)
            for name in fields
            if (m := re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", message))
        )
        key = f"{prefix}.{named[0][1]}" if named else prefix
    if isinstance(err, ConfigError) and key in message:
        return ConfigError(message if f"backend '{backend}'" in message else f"{message} (an option of backend '{backend}')", key=key)
    return ConfigError(f"wrong value for '{key}' of backend '{backend}': {message}", key=key)


def _option_names(schema: type, path: str) -> list[str]:
    """The field names of the options dataclass at dotted ``path`` inside ``schema``
    (an optional nested dataclass counts as that dataclass)."""
    import typing

    node: Any = schema
    for part in filter(None, path.split(".")):
        hints = typing.get_type_hints(node) if dataclasses.is_dataclass(node) else {}
        candidates = [node_type for node_type in typing.get_args(hints.get(part)) or (hints.get(part),)]
        node = next((c for c in candidates if dataclasses.is_dataclass(c)), None)
    return [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []


def to_plain(cfg: RunConfig) -> dict[str, Any]:
    """The config as plain dicts and lists (for logs and run directories)."""
    return dataclasses.asdict(cfg)


def cache_dir(cfg: RunConfig) -> Path:
    """Directory for shared artifacts (published atomically)."""
    import os

    if cfg.setup.cache_dir:
        return Path(cfg.setup.cache_dir).expanduser()
    env = os.environ.get("RLCORE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "rlcore"


#: The example `rlcore run` and `rlcore.open()` use when given no config.
DEFAULT_EXAMPLE = "quickstart.yaml"


def default_config_path() -> Path | None:
    """The default example: ``examples/quickstart.yaml`` beside the package or in the cwd."""
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "examples" / DEFAULT_EXAMPLE
        if candidate.is_file():
            return candidate
    return None
