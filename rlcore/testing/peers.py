"""Reference peers: a transformers policy and generation in Ray actors, shipped with rlcore.

:data:`REFERENCE` is a plugin object (no entry point: register it yourself, or let
:class:`rlcore.testing.BackendConformance` use it as the default ``peer_plugin``) that
serves ``policy`` and ``generation`` with plain Hugging Face ``transformers`` on the
run's model (``model.path``, or the tiny model of :func:`rlcore.models.tiny.ensure_model`).
Each role is one worker (a :class:`rlcore.runtime.worker_group.WorkerGroup` of one Ray actor) and
follows every convention of :mod:`rlcore.handles`:

* :class:`ReferencePolicy` implements :class:`~rlcore.handles.PolicyHandle` (logprobs
  and the GRPO step of :mod:`rlcore.testing.reference`) and
  :class:`~rlcore.handles.RefitSender` over collective, disk and shared memory
  (:class:`rlcore.refit.worker.RefitSenderWorker`);
* :class:`ReferenceGeneration` implements :class:`~rlcore.handles.GenerationHandle`
  (sampling one token at a time: logprobs at temperature 1, EOS included and last,
  per-sample seeds derived from ``seed`` and the prompt's index) and
  :class:`~rlcore.handles.RefitReceiver`; started refit-fed it refuses to sample until
  its first refit.

A single-role backend's tests thus get real refit round trips without any other
plugin installed. The classes are small on purpose and open to subclassing: the
broken backends of rlcore's own tests each override one method.

Nothing heavy is imported at module level (torch, transformers and ray load in the
init hooks and in the workers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlcore.context import InitContext
from rlcore.declarations import (
    BackendDeclaration,
    CheckpointSupport,
    OverlapSafety,
    Role,
    Transport,
)
from rlcore.handles import SamplingParams
from rlcore.hookspecs import hookimpl
from rlcore.refit.worker import RefitChannels, RefitSenderWorker
from rlcore.runtime.group_handle import GroupHandle
from rlcore.runtime.policy_group import GroupPolicy
from rlcore.runtime.worker_group import DistributedWorker

#: The reference peer's backend name (``policy.backend`` / ``generation.backend``).
REFERENCE_NAME = "rlcore-reference"
#: Transports the reference peer sends and receives over (every one the core runs on CPU).
REFERENCE_TRANSPORTS = frozenset({Transport.COLLECTIVE, Transport.DISK, Transport.SHARED_MEMORY})


@dataclass
class ReferenceOptions:
    """``<role>.options`` of the reference peer."""

    #: Ray CPUs reserved per worker (small: the peer shares the host with the backend under test).
    num_cpus: float = 0.25


def sample_seed(seed: int, prompt: int, sample: int) -> int:
    """The RNG seed of sample ``sample`` of prompt ``prompt`` in a call made with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{prompt}:{sample}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


# -- workers (inside Ray actors) --------------------------------------------------------


class HFWorker(DistributedWorker):
    """One transformers causal LM in float32 on CPU (``empty``: random init, no checkpoint read)."""

    def __init__(self, rank: int, world_size: int, model_dir: str, empty: bool = False) -> None:
        super().__init__(rank, world_size)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        torch.set_num_threads(1)
        if empty:
            config = AutoConfig.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.ready = not empty
        eos = self.model.config.eos_token_id
        try:
            eos = GenerationConfig.from_pretrained(model_dir).eos_token_id or eos
        except OSError:  # no generation_config.json
            pass
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

    def weight_specs(self) -> list[Any]:
        from rlcore.refit.specs import spec_of

        return [spec_of(n, t) for n, t in self.model.state_dict().items()]

    def logprobs(self, rows: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Per-token logprobs at temperature 1 (:func:`rlcore.testing.reference.reference_logprobs`)."""
        from rlcore.testing.reference import reference_logprobs

        self._check_ready()
        return reference_logprobs(self.model, [(list(p), list(c)) for p, c in rows])

    def _check_ready(self) -> None:
        if not self.ready:
            from rlcore.errors import RefitError

            raise RefitError("the reference engine started refit-fed and has no weights yet")


class ReferencePolicyWorker(HFWorker, RefitSenderWorker):
    """The policy's worker: logprobs, the reference GRPO step, and the refit export."""

    def train_step(
        self, rows: list, advantages: list[float], old: list | None, clip_eps: float, lr: float
    ) -> dict[str, float]:
        from rlcore.testing.reference import reference_grpo_step

        self.model.zero_grad(set_to_none=True)
        old = old if old is not None else self.logprobs(rows)
        out = reference_grpo_step(self.model, rows, advantages, old, lr=lr, clip_eps=clip_eps)
        self.model.zero_grad(set_to_none=True)
        return {k: float(v) for k, v in out.items() if k != "state"}

    def export_stream(self) -> Any:
        """(name, tensor) of every weight in send order (what the refit sends)."""
        return iter(list(self.model.state_dict().items()))

    def save_checkpoint(self, directory: str) -> None:
        """Its whole training state: the weights (its step keeps no optimizer state) and
        torch's RNG state, with ``torch.save``."""
        import torch

        torch.save({"model": self.model.state_dict(), "rng": torch.get_rng_state()}, f"{directory}/policy.pt")

    def load_checkpoint(self, directory: str) -> None:
        import torch

        state = torch.load(f"{directory}/policy.pt", weights_only=True)
        self.model.load_state_dict(state["model"])
        torch.set_rng_state(state["rng"])


class ReferenceGenerationWorker(HFWorker, RefitChannels):
    """The generation's worker: token-by-token sampling and the receiving end of refit.
    Every sampled token carries the weight version (the step of the last refit loaded)."""

    #: The step of the last refit that succeeded (0 before any).
    loaded_version = 0

    def token_logprobs(self, logits: Any, temperature: float) -> Any:
        """The logprobs a sample reports: ``log_softmax`` of the raw logits (temperature 1)."""
        return logits.log_softmax(-1)

    def stop_tokens(self) -> frozenset[int]:
        """Ids that end a sample (kept as its last token)."""
        return self.eos_ids

    def pick(self, logits: Any, temperature: float, gen: Any) -> int:
        """The next token: argmax at temperature 0, else sampled from ``softmax(logits / T)``."""
        import torch

        if temperature <= 0:
            return int(logits.argmax())
        probs = (logits / temperature).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def sample_one(self, prompt: list[int], max_tokens: int, temperature: float, seed: int) -> dict[str, list]:
        import torch

        gen = torch.Generator().manual_seed(seed)
        tokens: list[int] = []
        logprobs: list[float] = []
        past, step_ids = None, torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(max_tokens):
                out = self.model(input_ids=step_ids, past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1].float()
                token = self.pick(logits, temperature, gen)
                tokens.append(token)
                logprobs.append(float(self.token_logprobs(logits, temperature)[token]))
                if token in self.stop_tokens():
                    break
                step_ids = torch.tensor([[token]])
        return {"token_ids": tokens, "logprobs": logprobs, "versions": [self.loaded_version] * len(tokens)}

    def generate(self, prompts: list[list[int]], first: int, params: SamplingParams) -> list[list[dict[str, list]]]:
        """Samples of ``prompts``, whose indices in the whole call start at ``first``."""
        self._check_ready()
        p = params
        return [
            [
                self.sample_one(list(prompt), p.max_tokens, p.temperature, sample_seed(p.seed, first + i, j))
                for j in range(p.n)
            ]
            for i, prompt in enumerate(prompts)
        ]

    def open_refit_channel(self, spec: Any) -> None:
        self.join_refit_channel(spec, 1 + self.rank)

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> int:
        """Receive every bucket, check names and shapes, then load all at once (no mixed weights)."""
        from rlcore.errors import RefitError
        from rlcore.refit import channels

        received = {
            n: t.clone() for n, t in channels.receive_weights(spec, 1 + self.rank, step, buckets)
        }
        state = self.model.state_dict()
        bad = sorted(set(state) ^ set(received)) + [
            n for n in received if n in state and received[n].shape != state[n].shape
        ]
        if bad:
            raise RefitError(f"reference generation: unexpected weights {bad[:5]}; old weights kept")
        self.load(received)
        self.ready, self.loaded_version = True, step
        return len(received)

    def weight_version(self) -> int:
        return self.loaded_version

    def load(self, state: dict[str, Any]) -> None:
        """Copy the received tensors into the model."""
        self.model.load_state_dict(state)


# -- handles (in the driver) --------------------------------------------------------------


class _Group(GroupHandle):
    """What both handles share: the specs and logprobs (lifecycle: :class:`GroupHandle`)."""

    role = ""

    def __init__(self, group: Any, specs: list[Any]) -> None:
        super().__init__(group, backend="reference", role=self.role)
        self._specs = specs

    def weight_specs(self) -> list[Any]:
        self._check_open()
        return list(self._specs)

    def logprobs(self, batch: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        from rlcore.runtime.batches import put_rows

        self._check_open()
        return list(self.group.call("logprobs", put_rows(batch), ranks=[0], what="logprobs")[0])


class ReferencePolicy(_Group, GroupPolicy):
    """The reference policy handle (PolicyHandle + RefitSender + Checkpointable); see the module doc."""

    role = "policy"
    device_type = "cpu"

    def save_checkpoint(self, directory: str) -> None:
        self._check_open()
        self.group.call("save_checkpoint", directory, ranks=[0], what="checkpoint save")

    def load_checkpoint(self, directory: str) -> None:
        self._check_open()
        self.group.call("load_checkpoint", directory, ranks=[0], what="checkpoint load")


class ReferenceGeneration(_Group):
    """The reference generation handle (GenerationHandle + RefitReceiver); see the module doc."""

    role = "generation"

    @property
    def refit_ranks(self) -> int:
        return int(self.group.world_size)

    def open_refit_channel(self, spec: Any) -> list[Any]:
        self._check_open()
        return list(self.group.call_async("open_refit_channel", spec))

    def receive_weights(self, spec: Any, step: int, buckets: list[list[Any]]) -> list[Any]:
        import ray

        self._check_open()
        return list(self.group.call_async("receive_weights", spec, step, ray.put(buckets)))

    def weight_versions(self) -> list[int]:
        """Each engine's weight version (:class:`rlcore.handles.WeightVersioned`)."""
        self._check_open()
        return [int(v) for v in self.group.call("weight_version", what="weight versions")]

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Any]]:
        from rlcore.runtime.batches import shard_range

        self._check_open()
        size = self.group.world_size
        refs = []
        for rank in range(size):
            a, b = shard_range(len(prompt_ids), size, rank)
            if b > a:
                prompts = [list(p) for p in prompt_ids[a:b]]
                refs += self.group.call_async("generate", prompts, a, params, ranks=[rank])
        return [group for part in self.group.get(refs, what="generate") for group in part]


# -- the plugin object -----------------------------------------------------------------------


class ReferencePlugin:
    """The reference peer as a plugin object. Subclass and change the class attributes
    (name, worker and handle classes, transports) to make a variant."""

    name: str = REFERENCE_NAME
    roles: frozenset[Role] = frozenset({Role.POLICY, Role.GENERATION})
    send_transports: frozenset[Transport] = REFERENCE_TRANSPORTS
    receive_transports: frozenset[Transport] = REFERENCE_TRANSPORTS
    policy_worker: type = ReferencePolicyWorker
    generation_worker: type = ReferenceGenerationWorker
    policy_handle: type = ReferencePolicy
    generation_handle: type = ReferenceGeneration

    @hookimpl
    def rlcore_declare_backend(self) -> BackendDeclaration:
        from rlcore.declarations import CONTRACT_VERSION

        pol, gen = Role.POLICY in self.roles, Role.GENERATION in self.roles
        return BackendDeclaration(
            name=self.name,
            roles=set(self.roles),
            overlap=OverlapSafety(non_colocated=True, colocated=True),
            send_transports=set(self.send_transports) if pol else set(),
            receive_transports=set(self.receive_transports) if gen else set(),
            refit_fed=gen,
            options=ReferenceOptions,
            dtypes={"float32"},  # its workers load the checkpoint in float32 whatever model.dtype says
            checkpoint=CheckpointSupport("reference-torch-save", "1", overlap=True) if pol else None,
            contract_version=CONTRACT_VERSION,
            description="transformers reference peer of rlcore's conformance suite (one Ray actor)",
        )

    def _start(self, ctx: InitContext, worker: type, handle: type, empty: bool) -> Any:
        import ray

        from rlcore.models.tiny import ensure_model
        from rlcore.runtime.worker_group import WorkerGroup

        if not ray.is_initialized():
            from rlcore.errors import ConfigError

            raise ConfigError(
                f"backend '{self.name}' runs in Ray actors: start a cluster first "
                "(rlcore.runtime.cluster.Cluster(config.cluster).start(); `rlcore run` and the "
                "conformance suite do)"
            )
        ctx.cancel.raise_if_cancelled(ctx.task)
        ctx.deadline.raise_if_expired(ctx.task)
        model_dir = ensure_model(ctx.config.model, ctx.cache_dir, cancel=ctx.cancel, deadline=ctx.deadline)
        options = ctx.options if isinstance(ctx.options, ReferenceOptions) else ReferenceOptions()
        group = WorkerGroup(
            worker, 1, name=f"{self.name}-{ctx.role.value}", args=(str(model_dir), empty),
            num_cpus=options.num_cpus, dist_backend=None, cancel=ctx.cancel, deadline=ctx.deadline,
            placement=ctx.placement,
        )
        try:
            specs = group.call("weight_specs", what="weight specs", deadline=ctx.deadline)[0]
            return handle(group, specs)
        except BaseException:
            group.shutdown()
            raise

    @hookimpl
    def rlcore_init_policy(self, ctx: InitContext) -> Any:
        return self._start(ctx, self.policy_worker, self.policy_handle, empty=False)

    @hookimpl
    def rlcore_init_generation(self, ctx: InitContext) -> Any:
        empty = bool(ctx.config.generation.refit_fed)
        return self._start(ctx, self.generation_worker, self.generation_handle, empty=empty)


#: The reference peer (policy and generation); ``BackendConformance``'s default ``peer_plugin``.
REFERENCE = ReferencePlugin()
