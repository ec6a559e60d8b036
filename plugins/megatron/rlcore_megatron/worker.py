"""Megatron workers: plain classes that rlcore runs as Ray actors (or directly, without Ray).

* :class:`MegatronPolicyWorker` -- one rank of the policy: a local-spec ``GPTModel``
  split over tensor-parallel ranks (the rest of the group is data parallelism). It
  computes per-token logprobs, takes GRPO steps (AdamW) and streams its weights
  under Hugging Face names for refit.
* :class:`MegatronGenerationWorker` -- one rank of the generation engine
  ("MInf"): the same model served by megatron-core's dynamic inference engine on
  CUDA or its static engine on CPU (:mod:`rlcore_megatron.inference`), loaded from
  the published checkpoint or fed by refit.

Native-layout refit: the parameters of both roles are views of one buffer per dtype
(:meth:`MegatronWorker._flatten_parameters`). Over ``cuda_ipc``, when policy and
generation hold the same layout (same model, TP=1, same dtype: the fingerprint of
:meth:`MegatronWorker.layout_fingerprint`, agreed when the channel opens), a refit
moves the Megatron tensors themselves (fused QKV, fused gate/up, float32 norms)
from the policy's parameter storages into the generation's: no Hugging Face
conversion on either side, no staging, one copy per dtype buffer. Otherwise (vLLM
or SGLang on the other side, another TP, another dtype) it streams the Hugging
Face plan as before. The policy's ``send_weights`` says which ran.

Both are :class:`rlcore.runtime.worker_group.DistributedWorker` subclasses: a
:class:`rlcore.runtime.worker_group.WorkerGroup` gives them a torch.distributed default group
(gloo on CPU, NCCL on CUDA), over which they initialise megatron-core's parallel
state; ``bench/megatron_gpu.py`` drives the same classes from
``torch.multiprocessing`` processes, and tests drive one rank in-process.

Collective methods (``load``/``start``, ``logprobs``, ``train_step``,
``generate``, ``send_weights``, ``receive_weights``, ``export_*``) are called on
every rank with the same arguments. Ranks are laid out as megatron-core does
(tensor-parallel ranks adjacent): rank ``r`` is tensor-parallel rank ``r % tp`` of
data-parallel replica ``r // tp``. Batches are split over the data-parallel
replicas (contiguous shards); every rank of a replica returns its shard's
result, so the driver keeps tensor-parallel rank 0's of each replica.

Module import is light (the driver imports this module to name the actor classes):
torch and megatron-core are imported inside the methods, in the workers' processes.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rlcore.errors import NotServingError
from rlcore.handles import Sample, SamplingParams
from rlcore.refit import transports
from rlcore.refit.worker import RefitChannels, RefitSenderWorker
from rlcore.runtime.batches import Row, shard_range
from rlcore.runtime.losses import LogprobWorker, PolicyGradientWorker, right_padded
from rlcore.runtime.step_gate import StepGate
from rlcore.runtime.worker_group import DistributedWorker

if TYPE_CHECKING:
    import torch

    from rlcore.refit.channels import ChannelSpec
    from rlcore.refit.specs import TensorSpec
    from rlcore_megatron.options import MegatronOptions

log = logging.getLogger(__name__)

def sample_seed(seed: int, replica: int) -> int:
    """The sampling seed of data-parallel replica ``replica`` for a call made with ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{replica}".encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


def quiet_process() -> None:
    """Silence megatron-core in this worker's process, before it is imported: its static
    engine draws a tqdm bar per batch, and its import warns about missing Transformer
    Engine / Apex. Set here rather than as the actor's environment, so the actor can run
    in a worker Ray started ahead of time (:func:`rlcore.runtime.resources.actor_runtime_env`)."""
    import os
    import warnings

    os.environ["TQDM_DISABLE"] = "1"
    warnings.simplefilter("ignore")


def resolve_device(device: str) -> torch.device:
    """``cpu``, ``cuda`` (the current CUDA device) or ``cuda:N``."""
    import torch

    if device.startswith("cuda"):
        if device != "cuda":
            torch.cuda.set_device(torch.device(device))
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")
    return torch.device("cpu")


def _hf_config(model_dir: str) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list | tuple) else [value])]


def eos_token_ids(model_dir: str) -> list[int]:
    """End-of-sequence ids of a Hugging Face model: ``config.json``'s, then
    ``generation_config.json``'s (chat models often list several there)."""
    eos = _token_ids(_hf_config(model_dir).get("eos_token_id"))
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        eos += _token_ids(json.loads(gen_cfg.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(eos))


def _maps_sender_storage(spec: ChannelSpec) -> bool:
    """Whether ``spec``'s receivers map the sender's own GPU storages (its transport's
    ``device_ipc``, today ``cuda_ipc``): the only channels a native layout can move over."""
    return transports.get(spec.transport).device_ipc


class MegatronWorker(LogprobWorker, RefitChannels, DistributedWorker):
    """What policy and generation ranks share: parallel state, the model, logprobs, channels.

    ``logprobs``: :class:`rlcore.runtime.losses.LogprobWorker`, over the data-parallel
    replicas (the tensor-parallel ranks of a replica take the same rows).
    """

    #: Offer the native layout on cuda_ipc channels (tests and benchmarks turn it off to
    #: run the Hugging Face path between two identical layouts).
    native_refit = True

    def __init__(self, rank: int, world_size: int) -> None:
        import torch

        super().__init__(rank, world_size)
        #: (name, parameter) in native order: dtype by dtype, each dtype's in model order
        self._native: list[tuple[str, torch.nn.Parameter]] = []
        self._native_plan: list[list[TensorSpec]] = []
        self._flat: list[torch.Tensor] = []
        self.model: Any = None
        self.spec: Any = None
        self.options: MegatronOptions | None = None
        self.dtype = "float32"
        self.device = torch.device("cpu")
        self.tp_rank, self.tp_size, self.dp_rank, self.dp_size = 0, 1, 0, 1
        self.divisible = 128
        self.pad_id = 0

    # ------------------------------------------------------------------ build

    def _build(
        self,
        model_dir: str,
        dtype: str,
        options: MegatronOptions,
        device: str,
        *,
        padded_vocab_size: int | None = None,
        init_weights: bool = False,
    ) -> None:
        """Parallel state (CPU patches first), then the model, unloaded unless ``init_weights``."""
        quiet_process()
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        from rlcore_megatron import convert, parallel

        self.options, self.dtype = options, dtype
        if options.threads_per_worker > 0:
            torch.set_num_threads(options.threads_per_worker)
        torch.manual_seed(options.seed)
        self.device = resolve_device(device)
        tp = int(options.tensor_model_parallel_size)
        if tp < 1 or self.world_size % tp:
            raise ValueError(
                f"{self.world_size} ranks cannot be split into tensor-parallel groups of {tp} "
                "(workers must be a multiple of tensor_model_parallel_size)"
            )
        if not dist.is_initialized():
            raise RuntimeError("init_process_group must be called before building the model")
        if parallel_state.model_parallel_is_initialized():
            # A test driving two workers in one process: they share the parallel state.
            if parallel_state.get_tensor_model_parallel_world_size() != tp:
                raise RuntimeError("megatron-core parallel state exists with another TP size")
        else:
            parallel.init_model_parallel(tp, seed=options.seed)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        cfg = _hf_config(model_dir)
        self.spec = convert.ModelSpec.from_hf(cfg)
        self.pad_id = int(cfg.get("pad_token_id") or 0)
        self.divisible = (
            int(options.make_vocab_size_divisible_by)
            if padded_vocab_size is None
            else convert.vocab_divisor(int(padded_vocab_size), tp)
        )
        self.model = convert.build_gpt_model(
            self.spec,
            tp,
            dtype=dtype,
            make_vocab_size_divisible_by=self.divisible,
            init_weights=init_weights,
        )
        self._flatten_parameters()  # onto the device, one buffer per dtype
        self.model.to(self.device)  # the buffers (the parameters are there already)
        self.model.eval()  # no dropout anywhere (dropout is 0 in the config as well)

    def _flatten_parameters(self) -> None:
        """Move every parameter onto the device as a view of one buffer per dtype, in
        native order (each dtype's parameters in model order, aligned to 128 bytes).

        Two workers built from the same model hold their native tensors at the same
        offsets of their buffers, so a native refit's copies, adjacent on both sides,
        merge into one copy per buffer (:func:`rlcore.refit.transports.cuda_ipc.copy_views`). Loading
        and training write the parameters in place and keep them views. Parameters that
        megatron-core built on the GPU go to host memory first: the device never holds
        two copies of the model (a colocated policy starts beside a generation's KV cache).
        """
        import torch

        from rlcore.refit.specs import TensorSpec

        groups: dict[torch.dtype, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in self.model.named_parameters():  # a tied weight once
            groups.setdefault(p.dtype, []).append((name, p))
        built_on_gpu = [p for items in groups.values() for _, p in items if p.is_cuda]
        if built_on_gpu:  # megatron-core initialises on the GPU: through host memory, one copy on the device
            with torch.no_grad():
                for p in built_on_gpu:
                    p.data = p.detach().cpu()
            torch.cuda.empty_cache()
        self._native, self._flat = [], []
        for dtype, items in groups.items():
            align = max(1, 128 // torch.empty(0, dtype=dtype).element_size())
            offsets, total = [], 0
            for _, p in items:
                offsets.append(total)
                total += -(-p.numel() // align) * align
            buf = torch.zeros(total, dtype=dtype, device=self.device)
            with torch.no_grad():
                for (_, p), off in zip(items, offsets, strict=True):
                    view = buf[off : off + p.numel()].view(p.shape)
                    view.copy_(p.detach())
                    p.data = view  # the same Parameter object: modules keep it
            self._flat.append(buf)
            self._native += items
        self._native_plan = [
            [TensorSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in self._native]
        ]

    def native_specs(self) -> list[TensorSpec]:
        """Every parameter of this rank (Megatron name, local shape, dtype) in native order."""
        self._require_model()
        return list(self._native_plan[0])

    def layout_fingerprint(self) -> str:
        """A digest of how this rank holds the weights: the model, the tensor-parallel size
        and rank, the run's dtype, megatron-core's version and every native tensor's name,
        shape (padded vocabulary included) and dtype. Equal digests: the same tensors, so
        a refit may copy them as they are."""
        import dataclasses

        from megatron.core import package_info

        doc = {
            "model": dataclasses.asdict(self.spec),
            "tp": [self.tp_size, self.tp_rank],
            "dtype": self.dtype,
            "megatron_core": package_info.__version__,
            "tensors": [[s.name, list(s.shape), s.dtype] for s in self.native_specs()],
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    def _offer_native_layout(self, spec: ChannelSpec) -> None:
        """Before joining ``spec``: offer this rank's native layout (cuda_ipc, TP=1: one
        sender holds the whole model, so only then can a receiver copy its tensors as
        they are). A channel that agrees on it at open runs the native path."""
        if _maps_sender_storage(spec) and self.native_refit and self.tp_size == 1:
            from rlcore.refit.transports import cuda_ipc

            self._require_model()
            cuda_ipc.offer_layout(spec, self.layout_fingerprint())

    def refit_path(self, spec: ChannelSpec) -> tuple[str, str]:
        """``("native", layout)`` when this rank's end of ``spec`` agreed on a native layout
        at open, else ``("hf", why not)``."""
        if not _maps_sender_storage(spec):
            return "hf", f"{spec.transport} moves the plan's Hugging Face tensors"
        from rlcore.refit.transports import cuda_ipc

        layout, why = cuda_ipc.agreed_layout(spec)
        return ("native", layout) if layout else ("hf", why)

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}: the model is not built yet")

    def layout(self) -> dict[str, int]:
        """This rank's place: ``rank``, ``tp_rank``, ``tp_size``, ``dp_rank``, ``dp_size``."""
        return {
            "rank": self.rank,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
        }

    def weight_specs(self) -> list[TensorSpec]:
        """Every refit tensor (Hugging Face name, full shape, dtype) in stream order.

        From the model's shapes alone (:func:`rlcore_megatron.convert.tensor_specs`).
        """
        from rlcore_megatron import convert

        self._require_model()
        return convert.tensor_specs(self.spec, self.dtype)

    # --------------------------------------------------------------- compute

    def _forward_logprobs(
        self, rows: Sequence[tuple[list[int], list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """Right-padded forward pass over ``rows`` with a causal mask.

        Right padding needs no attention mask beyond the causal one: padding comes
        after every real token. Returns ``token_lp`` [rows, columns] (float32, the
        logprob of each next token under the Hugging Face vocabulary), ``mask`` (the
        columns that are completion tokens) and each row's completion span. Columns
        start at the shortest prompt's last position.
        """
        import torch

        from rlcore_megatron.cpu_compat import causal_mask
        from rlcore_megatron.parallel import vocab_parallel_logprobs

        padded = right_padded(rows, self.pad_id)
        first, width = padded.first, padded.ids.shape[1]
        ids = padded.ids.to(self.device)
        positions = torch.arange(width, device=self.device).unsqueeze(0).expand(len(rows), -1)
        logits = self.model(ids, positions, causal_mask(width, device=self.device))
        token_lp = vocab_parallel_logprobs(
            logits[:, first:-1], ids[:, first + 1 :], self.spec.vocab_size
        )
        return token_lp, padded.mask.to(self.device), padded.spans

    def _data_parallel(self) -> tuple[int, int]:
        return self.dp_size, self.dp_rank

    def _micro_batches(self, local: list[Any], n_rows: int) -> Iterator[list[Any]]:
        """``local`` in micro-batches (the replicas need not run as many: no collective
        of a forward pass spans them)."""
        assert self.options is not None
        size = max(1, int(self.options.micro_batch_size))
        for i in range(0, len(local), size):
            yield local[i : i + size]

    # ------------------------------------------------------------- channels

    def teardown(self) -> None:
        """Close refit channels, drop the model, destroy megatron-core's and torch's groups."""
        self.close_refit_channels()
        self.model = None
        try:
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                parallel_state.destroy_model_parallel()
        except Exception as err:  # teardown must not raise
            log.warning("rank %d: destroying megatron parallel state failed: %s", self.rank, err)
        super().teardown()


class MegatronPolicyWorker(PolicyGradientWorker, RefitSenderWorker, MegatronWorker):
    """One rank of the Megatron policy (see the module docstring).

    ``train_step``: :class:`rlcore.runtime.losses.PolicyGradientWorker` (the fsdp
    backend's as well), the gradients summed over the data-parallel group here
    (:meth:`_finish_gradients`); a sleeping (colocated) rank wakes first.
    """

    def __init__(self, rank: int, world_size: int) -> None:

        super().__init__(rank, world_size)
        self.optimizer: torch.optim.Optimizer | None = None
        #: True while the optimizer state is in host memory (:meth:`sleep`).
        self.asleep = False
        self._host_state: dict[tuple[int, str], torch.Tensor] = {}

    def load(
        self,
        model_dir: str,
        dtype: str,
        options: MegatronOptions,
        device: str = "cpu",
        *,
        random_init: bool = False,
    ) -> dict[str, Any]:
        """Build this rank's shard of the model and load it from the Hugging Face checkpoint.

        Every rank reads only its own slices (memory-mapped safetensors, one layer
        of Hugging Face tensors at a time). ``random_init`` (benchmarks) skips the
        checkpoint: megatron-core initialises the weights from ``options.seed``.
        Returns timings (seconds) and sizes.
        """
        import torch

        from rlcore_megatron import convert

        t0 = time.monotonic()
        self._build(model_dir, dtype, options, device, init_weights=random_init)
        build_s = time.monotonic() - t0
        t0 = time.monotonic()
        if not random_init:
            with convert.HFCheckpoint(model_dir) as ckpt:
                convert.load_hf_weights(
                    self.model,
                    ckpt.get,
                    self.spec,
                    tp_rank=self.tp_rank,
                    tp_size=self.tp_size,
                    make_vocab_size_divisible_by=self.divisible,
                )
        load_s = time.monotonic() - t0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=0.0, weight_decay=options.weight_decay
        )
        local = sum(p.numel() for p in self.model.parameters())
        return {
            **self.layout(),
            "device": self.device.type,
            "build_s": build_s,
            "load_s": load_s,
            "local_numel": local,
        }

    def _before_step(self) -> None:
        if self.asleep:  # colocated: the loop normally wakes the policy before training
            self.wake()

    def _replica_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def _finish_gradients(self) -> float:
        """Sum the gradients over the data-parallel group (each rank scaled its loss by
        ``1 / total_tokens``) and clip them to ``options.max_grad_norm``.

        Tensor-parallel ranks of a replica see the same rows and hold different shards
        of the weights; replicated weights (norms) get identical gradients. The norm is
        global: shards summed over the tensor-parallel group, replicated weights once.
        """
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        assert self.options is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.dp_size > 1:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._replica_group())
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, g in zip(params, grads, strict=True):
            if param_is_not_tensor_parallel_duplicate(p):
                sq += g.detach().float().pow(2).sum()
        if self.tp_size > 1:
            dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        grad_norm = float(sq.sqrt())
        max_norm = self.options.max_grad_norm
        coef = max_norm / (grad_norm + 1e-6) if max_norm > 0 else 1.0
        for p, g in zip(params, grads, strict=True):
            if coef < 1.0:
                g.mul_(coef)
            p.grad = g
        return grad_norm

    # ------------------------------------------------------------- colocated

    def sleep(self) -> dict[str, float]:
        """Colocated: move the optimizer state (AdamW moments) to pinned host memory and
        hand the freed GPU memory back to the device, for the generation that samples on
        the same GPU. The weights stay (refit and logprobs read them). Host buffers are
        kept for the next sleep. Idempotent; a no-op off CUDA. Returns ``bytes`` moved and
        ``seconds``. :meth:`train_step` wakes a sleeping policy itself."""
        import torch

        t0 = time.monotonic()
        moved = 0
        if self.optimizer is not None and self.device.type == "cuda" and not self.asleep:
            for p, state in self.optimizer.state.items():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device.type == "cuda":
                        host = self._host_state.get((id(p), key))
                        if host is None or host.shape != value.shape or host.dtype != value.dtype:
                            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                            self._host_state[(id(p), key)] = host
                        host.copy_(value, non_blocking=True)
                        state[key] = host
                        moved += value.numel() * value.element_size()
            for p in self.model.parameters():
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.asleep = self.device.type == "cuda"
        return {"bytes": float(moved), "seconds": time.monotonic() - t0}

    def wake(self) -> dict[str, float]:
        """Bring the optimizer state back to the GPU (the inverse of :meth:`sleep`). Idempotent."""
        import torch

        t0 = time.monotonic()
        moved = 0
        if self.optimizer is not None and self.asleep:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.is_pinned():
                        state[key] = value.to(self.device, non_blocking=True)
                        moved += value.numel() * value.element_size()
            torch.cuda.synchronize()
        self.asleep = False
        return {"bytes": float(moved), "seconds": time.monotonic() - t0}

    def open_refit_channel(self, spec: ChannelSpec) -> None:
        """Join ``spec`` as its sender on rank 0. Over ``cuda_ipc`` the parameters are the
        channel's persistent storages: the exported tensors that are views of them (every
        weight at tensor-parallel size 1 but q/k/v and the cast norms) are shared once and
        read in place by the receiver, never copied on this side."""
        if self.rank == 0:
            self._offer_native_layout(spec)
        super().open_refit_channel(spec)
        if _maps_sender_storage(spec) and self.rank == 0:
            from rlcore.refit.transports import cuda_ipc

            self._require_model()
            cuda_ipc.register_persistent(spec, self.model.parameters())

    def send_weights(self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]) -> Any:
        """Send the weights over ``spec``: the native path when the channel agreed on this
        rank's layout at open (rank 0 returns ``{"bytes": n, "path": "native"}``; only rank 0
        takes part: the native layout is offered at TP=1 alone, where other ranks are
        other data-parallel replicas), else the plan ``buckets`` (Hugging Face tensors,
        bytes as before)."""
        if self.rank == 0 and _maps_sender_storage(spec):
            path, layout = self.refit_path(spec)
            if path == "native":
                from rlcore.refit.transports import cuda_ipc

                sent = cuda_ipc.send_weights(spec, self.native_stream(), self._native_plan, layout)
                return {"bytes": sent, "path": "native"}
        return super().send_weights(spec, step, buckets)

    def native_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(megatron_name, parameter)`` in native order: the tensors a native refit moves
        (views of the parameter buffers, shared in place over cuda_ipc)."""
        self._require_model()
        yield from self._native

    # ------------------------------------------------------------ checkpoints

    def save_train_state(self, directory: str) -> dict[str, float]:
        """Write this rank's part of a training checkpoint into ``directory``: weights and
        AdamW state (megatron-core's distributed checkpoint), RNG states. Collective; reads
        the state only. See :mod:`rlcore_megatron.train_state`."""
        from rlcore_megatron import train_state

        self._require_model()
        return train_state.save(self, directory)

    def load_train_state(self, directory: str) -> dict[str, Any]:
        """Restore what :meth:`save_train_state` wrote (resharded from another layout where
        megatron-core can). Collective; raises :class:`rlcore.errors.CheckpointError` on
        every rank when any rank cannot take the checkpoint."""
        from rlcore_megatron import train_state

        self._require_model()
        return train_state.load(self, directory)

    # ---------------------------------------------------------------- export

    def export_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream ``(hf_name, full tensor)`` in :meth:`weight_specs` order. Collective.

        The ranks of data-parallel replica 0 gather each tensor over their
        tensor-parallel group (:func:`rlcore_megatron.convert.export_hf_state_dict`)
        and must all iterate to the end; only rank 0 yields. Other replicas hold
        the same weights and take no part. Tensors are gathered copies or views of
        the live parameters (consume them before the next optimizer step), in the
        run's dtype as the specs say (megatron-core's float32 norm weights are cast).
        """
        import torch

        from rlcore_megatron import convert

        self._require_model()
        if self.dp_rank != 0:
            return
        # megatron-core keeps norm weights in float32 whatever params_dtype is; the
        # Hugging Face state_dict (and the refit specs) hold every tensor in the run's dtype.
        want = getattr(torch, self.dtype)
        with torch.no_grad():
            for name, tensor in convert.export_hf_state_dict(self.model, self.spec):
                if self.rank == 0:
                    yield name, tensor if tensor.dtype == want else tensor.to(want)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole stream as a dict of CPU copies on rank 0 (``{}`` elsewhere). Tests only."""
        return {name: t.detach().cpu().clone() for name, t in self.export_stream()}

    def teardown(self) -> None:
        from rlcore_megatron import train_state

        self.optimizer = None
        self._host_state.clear()
        train_state.release()
        super().teardown()


T = TypeVar("T")


def _drives(method: Callable[..., T]) -> Callable[..., T]:
    """The generation method holds the engine (:meth:`StepGate.driving`): a refit waits
    for it, or lands between two of its engine steps."""

    @functools.wraps(method)
    def held(self: MegatronGenerationWorker, *args: Any, **kwargs: Any) -> T:
        with self.gate.driving():
            return method(self, *args, **kwargs)

    return held


def _lands(method: Callable[..., T]) -> Callable[..., T]:
    """The refit-side method runs as a gate job (:meth:`StepGate.run`): between two engine
    steps of the call in flight, on its thread, or at once when none is."""

    @functools.wraps(method)
    def job(self: MegatronGenerationWorker, *args: Any, **kwargs: Any) -> T:
        return self.gate.run(lambda: method(self, *args, **kwargs))

    return job


class MegatronGenerationWorker(MegatronWorker):
    """One rank of the Megatron generation engine (megatron-core's dynamic engine on CUDA,
    its static engine on CPU: ``generation.options.engine``)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size)
        self.engine: Any = None
        #: ``static`` or ``dynamic`` (:func:`rlcore_megatron.inference.resolve_engine`).
        self.engine_kind = "static"
        self.eos_ids: set[int] = set()
        #: False until weights are loaded (refit-fed: until the first refit).
        self.serving = False
        #: Why the weights cannot be trusted (a refit failed half-way), or None.
        self.stale: str | None = None
        #: True while the engine's inference memory is released (:meth:`sleep`).
        self.asleep = False
        #: The step of the last refit that succeeded (0 before any, and for the checkpoint
        #: it starts from): the version of the weights, which every sample carries.
        self.loaded_version = 0
        self._channel_ranks: dict[str, int] = {}
        #: Arbitrates the engine between the call that steps it and refit jobs from the refit
        #: thread (:class:`MegatronInflightGenerationWorker`); uncontended otherwise.
        self.gate = StepGate()
        #: Where refits landed in the requests of the call in flight: request id ->
        #: ``[(tokens generated before, version)]`` (:meth:`_new_weights`).
        self._landed: dict[int, list[tuple[int, int]]] = {}
        #: Refits that failed while they held a call's requests (the call then fails).
        self.refit_aborts = 0

    def start(
        self,
        model_dir: str,
        dtype: str,
        options: MegatronOptions,
        device: str = "cpu",
        *,
        padded_vocab_size: int | None = None,
    ) -> dict[str, Any]:
        """Build the model without weights and the inference engine around it.

        ``padded_vocab_size``: the padded vocabulary of the checkpoint this engine
        will load (written at the policy's tensor-parallel size); None pads with this
        engine's own options (refit-fed: refit moves unpadded Hugging Face tensors).
        The engine is ``options.engine`` resolved for ``device`` (reported as ``engine``).
        """
        from rlcore_megatron import inference

        t0 = time.monotonic()
        self.engine_kind = inference.resolve_engine(
            options.engine, "cuda" if device.startswith("cuda") else "cpu"
        )
        self._build(model_dir, dtype, options, device, padded_vocab_size=padded_vocab_size)
        self.model.requires_grad_(False)
        cfg = _hf_config(model_dir)
        eos = eos_token_ids(model_dir)
        self.eos_ids = set(eos)
        bos = _token_ids(cfg.get("bos_token_id"))
        adapter = inference.TokenIdAdapter(
            eod=eos[0] if eos else -1, bos=bos[0] if bos else None, vocab_size=self.spec.vocab_size
        )
        common = {
            "tp": self.tp_size,
            "make_vocab_size_divisible_by": self.divisible,
            "max_batch_size": options.max_batch_size,
            "max_sequence_length": options.max_sequence_length,
            "seed": options.seed + 1,
        }
        if self.engine_kind == "dynamic":
            self.engine = inference.build_dynamic_engine(
                self.model,
                adapter,
                self.spec,
                kv_cache_gib_requested=options.kv_cache_gib,
                attention=options.attention,
                cuda_graphs=options.cuda_graphs,
                **common,
            )
        else:
            self.engine = inference.build_static_engine(self.model, adapter, self.spec, **common)
        return {
            **self.layout(),
            "device": self.device.type,
            "engine": self.engine_kind,
            "start_s": time.monotonic() - t0,
        }

    def _forget_requests(self) -> None:
        """The weights are about to change: the dynamic engine drops every request and KV block."""
        if self.engine_kind == "dynamic" and self.engine is not None and not self.asleep:
            # (a sleeping engine holds no request; waking it resets its state)
            from rlcore_megatron.inference import reset_dynamic_engine

            reset_dynamic_engine(self.engine)

    @_drives
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Load a published Megatron checkpoint (any tensor-parallel size) and serve it."""
        from rlcore_megatron.checkpoint import load_checkpoint, read_info
        from rlcore_megatron.convert import ConversionError, ModelSpec

        self._require_model()
        t0 = time.monotonic()
        info = read_info(path)
        if ModelSpec.from_hf(info["hf_config"]) != self.spec:
            raise ConversionError(f"{path} was converted from another model than this engine's")
        self._forget_requests()
        load_checkpoint(self.model, path)
        self.serving, self.stale = True, None
        return {"checkpoint_load_s": time.monotonic() - t0, "written_at_tp": info["tp"]}

    def _check_serving(self) -> None:
        self._require_model()
        if self.stale is not None:
            raise NotServingError(
                f"megatron generation rank {self.rank}: {self.stale}; its weights may mix two "
                "versions, so it refuses to serve until a refit succeeds"
            )
        if not self.serving:
            raise NotServingError(
                f"megatron generation rank {self.rank} has no weights yet (refit-fed: it "
                "serves after the first refit)"
            )

    @_drives
    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Sample]]:
        """``params.n`` samples per prompt of this rank's data-parallel shard. Collective.

        megatron-core's engines sample over the padded vocabulary: the inference
        wrapper sets the padded entries' logits to ``-inf`` first
        (:class:`rlcore_megatron.inference.MaskedGPTInferenceWrapper`), so they are
        never drawn and the returned logprobs are normalised over the Hugging Face
        vocabulary. ``logprobs`` are the sampled tokens' logprobs under the model
        (before temperature, as vLLM reports them). Every sample is cut after its
        first end-of-sequence token, which is kept, as vLLM does (the static engine
        runs ``max_tokens`` steps for every sample; the dynamic engine ends a sample
        at the first end-of-sequence id). ``temperature <= 0`` is greedy. The
        replica's sampling generator is seeded from ``(seed, replica)`` at every call.

        ``versions``: each token's weight version. A refit that lands during the call
        (:class:`MegatronInflightGenerationWorker`: between two steps of the dynamic
        engine) changes the version of the tokens sampled after it; otherwise every
        token has :attr:`loaded_version`.
        """
        self._check_serving()
        n, max_tokens, temperature = params.n, params.max_tokens, params.temperature
        if self.asleep:  # colocated: the loop normally wakes the engine before sampling
            self.wake()
        start, end = shard_range(len(prompt_ids), self.dp_size, self.dp_rank)
        local = [[int(t) for t in p] for p in prompt_ids[start:end]]
        if not local:
            return []
        if any(not p for p in local):
            raise ValueError("empty prompt")
        self.engine.controller.sampling_rng.manual_seed(sample_seed(params.seed, self.dp_rank))
        version = self.loaded_version
        if self.engine_kind != "dynamic":
            raw = self._generate_static(local, n, max_tokens, temperature)
            return [[self._cut_at_eos(t, lps, [version] * len(t)) for t, lps in group] for group in raw]
        from rlcore_megatron.inference import generate_dynamic

        self._landed, aborts = {}, self.refit_aborts
        try:
            groups = generate_dynamic(self.engine, local, n, max_tokens, temperature, self.gate.between_steps)
        except RuntimeError as err:
            if self.refit_aborts != aborts:
                raise RuntimeError(
                    f"megatron generation rank {self.rank}: a refit failed half-way during this call and "
                    f"dropped its requests ({self.stale})"
                ) from err
            raise
        return [
            [self._cut_at_eos(s.token_ids, s.logprobs, self._versions(s.request_id, len(s.token_ids), version))
             for s in group]
            for group in groups
        ]

    def _versions(self, request_id: int, length: int, first: int) -> list[int]:
        """Each token's weight version: ``first``, then that of each refit that landed."""
        versions = [first] * length
        for at, version in self._landed.get(request_id, []):
            versions[at:] = [version] * (length - at)
        return versions

    def _cut_at_eos(self, tokens: list[int], logprobs: list[float], versions: list[int]) -> Sample:
        cut = next((i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), len(tokens))
        return {"token_ids": tokens[:cut], "logprobs": logprobs[:cut], "versions": versions[:cut]}

    def weight_version(self) -> int:
        """The version of the weights this rank serves (:attr:`loaded_version`)."""
        return self.loaded_version

    def _generate_static(
        self, local: list[list[int]], n: int, max_tokens: int, temperature: float
    ) -> list[list[tuple[list[int], list[float]]]]:
        """The static engine: ``(token_ids, logprobs)`` of ``max_tokens`` steps per sample."""
        from rlcore_megatron.inference import sampling_params

        params = sampling_params(temperature, max_tokens)
        params.add_attributes({"no_early_termination": True})
        scheduler = self.engine.scheduler
        ids = [
            [
                scheduler.add_request(prompt="", prompt_tokens=list(p), sampling_params=params)
                for _ in range(n)
            ]
            for p in local
        ]
        try:
            self.engine.run_engine()
            done = scheduler.completed_request_pool
            return [
                [
                    (
                        [int(t) for t in done[rid].generated_tokens.tolist()],
                        [float(x) for x in done[rid].generated_log_probs],
                    )
                    for rid in group
                ]
                for group in ids
            ]
        finally:
            for group in ids:
                for rid in group:
                    scheduler.completed_request_pool.pop(rid, None)

    @_drives
    def logprobs(self, batch: Sequence[Row]) -> list[list[float]]:
        """Per-token logprobs of each completion (a forward pass over prompt + completion)."""
        self._check_serving()
        return super().logprobs(batch)

    # ------------------------------------------------------------- colocated

    @_drives
    def sleep(self) -> dict[str, float]:
        """Colocated: release the inference memory (the dynamic engine's KV cache and
        request buffers, megatron-core's ``suspend``) and hand it back to the device, for
        the policy that trains on the same GPU. The weights stay (refit writes into them,
        logprobs read them). Every request is dropped first. Idempotent; the static engine
        (CPU) has nothing to release. Returns ``bytes`` released and ``seconds``."""
        import torch

        t0 = time.monotonic()
        released = 0
        if self.engine_kind == "dynamic" and self.engine is not None and not self.asleep:
            self._forget_requests()
            from rlcore_megatron.inference import suspend_dynamic_engine

            before = torch.cuda.memory_allocated()
            suspend_dynamic_engine(self.engine)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            released = before - torch.cuda.memory_allocated()
            self.asleep = True
        return {"bytes": float(released), "seconds": time.monotonic() - t0}

    @_drives
    def wake(self) -> dict[str, float]:
        """Allocate the inference memory again (megatron-core's ``resume``; fresh KV cache,
        no request). Idempotent. Returns ``bytes`` allocated and ``seconds``."""
        import torch

        t0 = time.monotonic()
        allocated = 0
        if self.asleep:
            from rlcore_megatron.inference import resume_dynamic_engine

            before = torch.cuda.memory_allocated()
            resume_dynamic_engine(self.engine)
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated() - before
            self.asleep = False
        return {"bytes": float(allocated), "seconds": time.monotonic() - t0}

    # ----------------------------------------------------------------- refit

    @_lands
    def open_refit_channel(self, spec: ChannelSpec, rank: int) -> None:
        """Join refit channel ``spec`` as ``rank`` (1 + this worker's rank), offering this
        rank's native layout on cuda_ipc."""
        self._offer_native_layout(spec)
        self.join_refit_channel(spec, rank)
        self._channel_ranks[spec.key] = rank

    @_lands
    def refit_ceiling(self, spec: ChannelSpec, step: int, nbytes: int) -> float:
        """Receive ``nbytes`` raw over the channel (the transport's ceiling)."""
        from rlcore.refit import channels

        return channels.ceiling(spec, self._channel_ranks.get(spec.key, 1 + self.rank), step, nbytes)

    @_lands
    def receive_weights(
        self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]
    ) -> float:
        """Receive the buckets of ``step`` over ``spec`` into the live model; seconds taken.

        Every rank receives the full Hugging Face tensors (a broadcast) and copies
        its own tensor-parallel slices into the model as they arrive
        (:func:`rlcore_megatron.convert.load_hf_stream`), so no full second copy of
        the model is ever held. If loading fails half-way, the rest of a collective
        stream is drained (the sender is not left blocked) and the engine refuses
        to serve until a later refit succeeds. If the channel fails before its first
        tensor (``cuda_ipc`` checks every tensor of a refit before it yields one, and a
        sender that fails mid-way sends nothing), nothing was written and the engine
        keeps serving its previous weights.

        A refit that reaches a dynamic engine while a call samples
        (:class:`MegatronInflightGenerationWorker`) loads between two engine steps with the
        call's requests held (:meth:`_new_weights`); a failure then also drops them, and
        that call fails.
        """
        self._require_model()
        t0 = time.monotonic()
        path, layout = self.refit_path(spec)
        with self._new_weights(step):
            if path == "native":
                self._receive_native(spec, step, layout)
            else:
                self._receive_hf(spec, step, buckets)
            self.stale, self.serving, self.loaded_version = None, True, step
        return time.monotonic() - t0

    @contextlib.contextmanager
    def _new_weights(self, step: int) -> Iterator[None]:
        """Around a load of new weights: with requests of a call in flight on the dynamic
        engine, they are held (:func:`rlcore_megatron.inference.requests_held`) and go on
        with the new weights, whose version the tokens after this point carry; else the
        engine's requests and KV blocks are dropped."""
        engine = self.engine
        if not (self.engine_kind == "dynamic" and engine is not None and not self.asleep
                and engine.has_unfinished_requests()):
            self._forget_requests()
            yield
            return
        from rlcore_megatron.inference import requests_held

        try:
            with requests_held(engine) as counts:
                yield
        except BaseException:
            self.refit_aborts += 1
            raise
        for request_id, at in counts.items():
            self._landed.setdefault(request_id, []).append((at, step))

    def _receive_hf(self, spec: ChannelSpec, step: int, buckets: list[list[TensorSpec]]) -> None:
        """The Hugging Face path: tensors streamed in, this rank's slices copied as they come."""
        import torch

        from rlcore.refit import channels
        from rlcore_megatron import convert

        rank = self._channel_ranks.get(spec.key, 1 + self.rank)
        stream = channels.receive_weights(spec, rank, step, buckets, device=self.device)
        before = self.stale
        self.stale = f"refit step {step} over {spec.transport} did not complete"
        pulled = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal pulled
            for item in stream:
                pulled += 1
                yield item

        try:
            with torch.no_grad():
                convert.load_hf_stream(
                    self.model,
                    counted(),
                    self.spec,
                    tp_rank=self.tp_rank,
                    tp_size=self.tp_size,
                    make_vocab_size_divisible_by=self.divisible,
                )
        except BaseException:
            if pulled == 0:  # the channel failed before its first tensor: nothing was written
                self.stale = before
            _drain(stream, self.rank, step)
            raise

    def _receive_native(self, spec: ChannelSpec, step: int, layout: str) -> None:
        """The native path: the sender's parameters, checked against this rank's own native
        plan (names, shapes, dtypes, bounds) before the first is yielded, copied into the
        parameters once all arrived (copies adjacent on both sides merged: one per dtype
        buffer). Nothing is written before every view is checked, so a refit that fails
        on either side before that leaves the old weights serving."""
        import torch

        from rlcore.refit.transports import cuda_ipc

        stream = cuda_ipc.receive_weights(spec, self._native_plan, layout)
        dsts = [p for _, p in self._native]
        before = self.stale
        self.stale = f"refit step {step} over {spec.transport} (native layout) did not complete"
        views: list[torch.Tensor] = []
        copied = False
        try:
            with torch.no_grad():
                for _, view in stream:
                    views.append(view)
                    if len(views) == len(dsts):  # before the stream ends: the views die then
                        copied = True
                        cuda_ipc.copy_views(dsts, views)
                        views.clear()
        except BaseException:
            views.clear()
            if not copied:  # nothing was written
                self.stale = before
            raise

    def teardown(self) -> None:
        self.engine = None
        super().teardown()


class MegatronInflightGenerationWorker(MegatronGenerationWorker):
    """A generation rank that takes refits while a call samples: megatron-core's dynamic
    engine (CUDA) at tensor-parallel size 1. Its refit calls run on the actor's refit
    thread (``inflight_refit``: :attr:`rlcore.runtime.worker_group.WorkerGroup.refit_group`)
    and land between two engine steps of the call in flight (:attr:`gate`). Tensor-parallel
    ranks would each land at their own step boundary and deadlock their collectives, and the
    static engine has no steps to land between; those keep :class:`MegatronGenerationWorker`
    (refits between calls)."""

    inflight_refit = True


def _drain(stream: Iterator[Any], rank: int, step: int) -> None:
    """The rest of a collective refit stream whose load failed, read and dropped: its sender
    is not left blocked on a receiver that stopped reading."""
    try:
        for _ in stream:
            pass
    except Exception as err:  # the channel itself is broken: nothing left to drain
        log.debug("rank %d: draining refit step %d failed: %s", rank, step, err)
