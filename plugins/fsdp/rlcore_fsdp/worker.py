"""One rank of the FSDP policy: a Hugging Face causal LM sharded with FSDP1.

:class:`FSDPWorker` is a plain class. :class:`rlcore.runtime.worker_group.WorkerGroup` runs N
of them as Ray actors that form a torch.distributed group (gloo on CPU, NCCL on
CUDA); a test can run one in-process after ``init_process_group`` with world
size 1.

Collective methods (``load``, ``logprobs``, ``train_step``, ``export_*``,
``send_weights``, ``save_checkpoint``, ``load_checkpoint``) must be called on every
rank, with the same arguments: FSDP all-gathers each unit's parameters in every
forward, backward and export, so the ranks work in lockstep.

Conventions:

* **Names.** Weights are exported under Hugging Face ``state_dict`` names (FSDP's
  ``_fsdp_wrapped_module.`` and similar wrapper prefixes removed); tied weights
  appear under every name the unwrapped model's ``state_dict`` has.
* **Export order.** One FSDP unit at a time, in ``FSDP.fsdp_modules`` order (the
  root unit, i.e. embeddings, final norm and head, then each decoder layer);
  within a unit, in the flat parameter's order. :meth:`FSDPWorker.weight_specs`
  describes exactly this order without gathering anything.
* **Eval mode.** The model stays in ``eval()`` mode (dropout off) for logprobs and
  for training, so the ratio of a training step compares like with like.

Module import is light (the driver imports this module to name the actor class, and
on a small host an import of torch there takes seconds from the cores the ranks start
on): torch and transformers are imported inside the methods, in the ranks' processes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcore.refit.specs import TensorSpec, plan_buckets
from rlcore.refit.worker import RefitSenderWorker
from rlcore.runtime.losses import PolicyGradientWorker, right_padded
from rlcore.runtime.worker_group import DistributedWorker

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rlcore_fsdp.options import FSDPOptions

log = logging.getLogger(__name__)


_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
#: Bucket size of the rank-0 -> all broadcast at load time.
_SYNC_BUCKET_BYTES = 64 << 20


def hf_name(name: str) -> str:
    """A parameter name inside the FSDP-wrapped model as the unwrapped model names it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def micro_batch_count(n: int, world_size: int, micro_batch_size: int) -> int:
    """Forward passes every rank runs for an ``n``-row batch (at least one: the ranks
    must run the same number of passes, so ranks with fewer rows run padding passes)."""
    return max(1, math.ceil(math.ceil(n / world_size) / micro_batch_size))


@dataclass(frozen=True)
class _Entry:
    """One exported weight: its HF name and where FSDP exposes it while summoned."""

    name: str
    module: nn.Module
    param_name: str
    shape: tuple[int, ...]
    dtype: str
    #: The peft LoRA layer whose adapters' product is added on export (None: exported as is).
    adapter: Any = None


class FSDPWorker(PolicyGradientWorker, RefitSenderWorker, DistributedWorker):
    """One FSDP rank. See the module docstring for the lockstep rule and conventions.

    ``logprobs`` and ``train_step``: :class:`rlcore.runtime.losses.PolicyGradientWorker`,
    with every rank a replica of its own, in lockstep (ranks with fewer rows run padding
    passes), and FSDP averaging the gradients.
    """

    averages_gradients = True

    def __init__(self, rank: int, world_size: int) -> None:
        import torch

        super().__init__(rank, world_size)
        self.model: Any = None  # the FSDP root module
        self.optimizer: torch.optim.Optimizer | None = None
        self.options: FSDPOptions | None = None
        self.device = torch.device("cpu")
        self.pad_id = 0
        self._layout: list[tuple[Any, list[_Entry]]] = []
        self._specs: list[TensorSpec] = []
        # Units whose parameters are all frozen, on one rank, with their parameter objects
        # (:meth:`_restore_frozen_views`).
        self._frozen_units: list[tuple[Any, list[Any]]] = []
        # A staged checkpoint save (rlcore_fsdp.checkpoint.stage): its DCP future, the stager
        # that keeps the host copy across saves, and the gloo group of its collectives.
        self.staged_save: Any = None
        self.stager: Any = None
        self.io_group: Any = None

    # ------------------------------------------------------------------ load

    def load(
        self, model_dir: str, dtype: str, options: FSDPOptions, device: str = "cpu"
    ) -> dict[str, Any]:
        """Load the checkpoint on rank 0, copy it to every rank, shard it with FSDP.

        Rank 0 reads the weights; the other ranks build the model on the meta device,
        materialise it empty and receive every parameter and buffer (non-persistent
        ones such as rotary ``inv_freq`` included) by broadcast, so only one process
        reads the checkpoint. A failure on any rank fails every rank promptly.
        Returns timings (seconds) and sizes.
        """
        import torch
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # no per-rank progress bars in the driver's log
        self.options = options
        self.model_dir = model_dir  # the base an adapters-only checkpoint is written on
        self._set_up_device(options, device)

        t0 = time.monotonic()
        model, error = self._build_model(model_dir, getattr(torch, dtype))
        load_s = time.monotonic() - t0

        t0 = time.monotonic()
        self._sync_from_rank0(model, error)
        assert model is not None
        sync_s = time.monotonic() - t0
        self.pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
        params = sum(p.numel() for p in model.parameters())

        t0 = time.monotonic()
        self._shard(model, options)
        wrap_s = time.monotonic() - t0
        return {
            "rank": self.rank,
            "device": self.device.type,
            "lora": dataclasses.asdict(options.lora) if options.lora is not None else None,
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "load_s": load_s,
            "sync_s": sync_s,
            "wrap_s": wrap_s,
            "units": len(self._layout),
            "params": params,
            "local_numel": sum(p.numel() for p in self.model.parameters()),
        }

    def _set_up_device(self, options: FSDPOptions, device: str) -> None:
        """Threads, seed and this rank's device (Ray exposes one GPU per rank)."""
        import torch

        if options.threads_per_worker > 0:
            torch.set_num_threads(options.threads_per_worker)
        torch.manual_seed(options.seed)
        if device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes one GPU per rank
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def _build_model(
        self, model_dir: str, torch_dtype: torch.dtype
    ) -> tuple[Any, BaseException | None]:
        """Rank 0: the checkpoint's model; the others: the same model, empty. A failure is
        returned, not raised, so that :meth:`_sync_from_rank0` reports it to every rank."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        model, error = None, None
        assert self.options is not None
        try:
            if self.rank == 0:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
                model.to(self.device)
            else:
                config = AutoConfig.from_pretrained(model_dir)
                with torch.device("meta"):
                    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
                model.to_empty(device=self.device)
                # to_empty gives each module its own new tensor: restore tied weights.
                model.tie_weights()
            if self.options.lora is not None:
                # Before the broadcast from rank 0: every rank starts from rank 0's adapters.
                from rlcore_fsdp import adapters

                model = adapters.attach(model, self.options.lora)
        except Exception as err:  # reported to every rank by _sync_from_rank0
            error = err
        return model, error

    def _shard(self, model: Any, options: FSDPOptions) -> None:
        """Wrap the model with FSDP; its optimizer, unit layout and weight specs."""

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self.model = self._wrap(model, options)
        self.model.eval()
        handles = [u._handle for u in FSDP.fsdp_modules(self.model) if u._handle is not None]
        self._frozen_units = [
            (h, list(h.flat_param._params))
            for h in handles
            if not h.flat_param.requires_grad and not h.uses_sharded_strategy and h.flat_param._params
        ]
        self.reset_optimizer()
        self._layout = self._unit_layout()
        self._specs = [
            TensorSpec(e.name, e.shape, e.dtype) for _, entries in self._layout for e in entries
        ]

    def reset_optimizer(self) -> None:
        """A fresh AdamW over the trained parameters (every one, or the adapters alone under
        ``options.lora``; no state: moments and step counts start on the first step). The
        learning rate comes with every ``train_step``."""
        import torch

        assert self.options is not None
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad], lr=0.0, weight_decay=self.options.weight_decay
        )

    def _sync_from_rank0(self, model: Any, error: BaseException | None) -> None:
        """Agree that every rank built the same model, then broadcast rank 0's tensors."""
        tensors: list[tuple[str, torch.Tensor]] = []
        if model is not None:
            tensors = list(model.named_parameters()) + list(model.named_buffers())
        self._agree_on_model(tensors, error)
        if self.world_size == 1:
            return
        self._broadcast_from_rank0([t for _, t in tensors])

    def _agree_on_model(
        self, tensors: list[tuple[str, torch.Tensor]], error: BaseException | None
    ) -> None:
        """Raise on every rank when any rank failed to build the model or built another one."""
        import torch.distributed as dist

        layout = (
            None if error is not None else [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
        )
        if self.world_size > 1:
            status = [None] * self.world_size
            dist.all_gather_object(status, (repr(error) if error is not None else None, layout))
        else:
            status = [(repr(error) if error is not None else None, layout)]
        if error is not None:
            raise error
        for rank, (other_error, other_layout) in enumerate(status):
            if other_error is not None:
                raise RuntimeError(
                    f"rank {rank} of the fsdp policy failed to build the model: {other_error}"
                )
            if other_layout != status[0][1]:
                diff = (
                    next(
                        (a, b)
                        for a, b in zip(status[0][1], other_layout or [], strict=False)
                        if a != b
                    )
                    if other_layout
                    else ("?", "?")
                )
                raise RuntimeError(
                    f"rank {rank} built a different model than rank 0 "
                    f"({len(other_layout or [])} vs {len(status[0][1])} tensors; first difference {diff})"
                )

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        """Coalesced broadcast: one collective per <= 64 MiB of raw bytes, any dtype mix."""
        from torch import nn

        bucket: list[torch.Tensor] = []
        size = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > _SYNC_BUCKET_BYTES:
                self._broadcast_bucket(bucket)
                bucket, size = [], 0
            bucket.append(t.data if isinstance(t, nn.Parameter) else t)
            size += nbytes
        if bucket:
            self._broadcast_bucket(bucket)

    def _broadcast_bucket(self, bucket: list[torch.Tensor]) -> None:
        """One broadcast of ``bucket``'s bytes from rank 0, copied into the others' tensors."""
        import torch
        import torch.distributed as dist

        total = sum(t.numel() * t.element_size() for t in bucket)
        if self.rank == 0:
            flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in bucket])
        else:
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        dist.broadcast(flat, src=0)
        if self.rank != 0:
            off = 0
            with torch.no_grad():
                for t in bucket:
                    n = t.numel() * t.element_size()
                    t.copy_(flat[off : off + n].view(t.dtype).view(t.shape))
                    off += n

    def _wrap(self, model: Any, options: FSDPOptions) -> Any:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        layer_classes = decoder_layer_classes(model)
        if not layer_classes:
            log.warning(
                "fsdp: found no decoder layer class in %s (no _no_split_modules, no model.layers); "
                "wrapping the whole model as one FSDP unit",
                type(model).__name__,
            )
        policy = (
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=layer_classes)
            if layer_classes
            else None
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # FSDP1 deprecation notice
            # world size 1: FSDP says it uses NO_SHARD instead, which is what we want
            warnings.filterwarnings("ignore", message=".*switching to use `NO_SHARD`")
            return FSDP(
                model,
                auto_wrap_policy=policy,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                device_id=self.device,
                use_orig_params=options.use_orig_params,
                limit_all_gathers=True,
            )

    def _unit_layout(self) -> list[tuple[Any, list[_Entry]]]:
        """Every FSDP unit with the weights it owns, from FSDP1's flat-parameter metadata.

        ``flat_param._fqns``/``_param_infos``/``_shapes`` list the unit's own parameters
        (nested units excluded) with full shapes; ``_shared_param_infos`` lists further
        names of tied parameters. Nothing is gathered.
        """
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        module_names = {id(m): n for n, m in self.model.named_modules()}
        adapted, skipped, name = self._adapter_layout()
        layout = []
        for unit in FSDP.fsdp_modules(self.model):
            handle = unit._handle
            if handle is None:  # a unit without parameters of its own
                continue
            flat = handle.flat_param
            dtype = str(flat.dtype).removeprefix("torch.")
            unit_name = module_names[id(unit)]
            prefix = hf_name(unit_name + ".") if unit_name else ""
            entries, shapes = [], {}
            for fqn, info, shape in zip(flat._fqns, flat._param_infos, flat._shapes, strict=True):
                shapes[(id(info.module), info.param_name)] = tuple(shape)
                if id(info.module) in skipped:
                    continue
                adapter = adapted.get(id(info.module)) if info.param_name == "weight" else None
                entries.append(
                    _Entry(name(prefix + hf_name(fqn)), info.module, info.param_name, tuple(shape), dtype, adapter)
                )
            for shared in flat._shared_param_infos:
                fqn = (
                    f"{shared.module_name}.{shared.param_name}"
                    if shared.module_name
                    else shared.param_name
                )
                shape = shapes[(id(shared.prim_module), shared.prim_param_name)]
                entries.append(
                    _Entry(name(prefix + hf_name(fqn)), shared.module, shared.param_name, shape, dtype)
                )
            layout.append((unit, entries))
        return layout

    def _adapter_layout(self) -> tuple[dict[int, Any], set[int], Any]:
        """Under ``options.lora``: the adapted layers (base layer id -> peft layer), the
        adapter matrices (not exported) and the renaming to the base model's names;
        without adapters, nothing and the identity."""
        assert self.options is not None
        if self.options.lora is None:
            return {}, set(), lambda name: name
        from rlcore_fsdp import adapters

        return adapters.adapted_layers(self.model), adapters.adapter_modules(self.model), adapters.merged_name

    # ---------------------------------------------------------------- export

    def weight_specs(self) -> list[TensorSpec]:
        """Every exported weight (HF name, full shape, dtype) in export order. No collective."""
        self._require_model()
        return list(self._specs)

    def export_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Stream (HF name, full tensor) pairs in :meth:`weight_specs` order. Collective.

        Every rank must iterate it to the end (each FSDP unit is all-gathered by all
        ranks); only rank 0 yields, the others yield nothing. Rank 0 holds at most one
        gathered unit plus the tensors its consumer keeps: each yielded tensor is a
        fresh copy, valid after the unit is resharded. Under ``options.lora`` an adapted
        weight is yielded merged (base + the adapters' product) under the base model's
        name, and the adapter matrices are not yielded.
        """
        import torch
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self._require_model()
        for unit, entries in self._layout:
            with FSDP.summon_full_params(unit, recurse=False, writeback=False, rank0_only=True):
                if self.rank != 0:
                    continue
                for e in entries:
                    full = getattr(e.module, e.param_name)
                    if tuple(full.shape) != e.shape:
                        raise RuntimeError(
                            f"fsdp export: {e.name} has shape {tuple(full.shape)} while summoned, "
                            f"expected {e.shape} (FSDP internals changed?)"
                        )
                    if e.adapter is not None:  # merged: the weight the policy computes with
                        from rlcore_fsdp import adapters

                        with torch.no_grad():  # not around the yield: the consumer's grad mode is its own
                            merged = full.detach() + adapters.delta(e.adapter)
                        yield e.name, merged
                        continue
                    # Copy first: a view would pin the unsharded storage past the reshard.
                    yield e.name, full.detach().clone()

    def export_buckets(self, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """:meth:`export_stream` grouped like the core's refit plan
        (:func:`rlcore.refit.specs.plan_buckets`): each bucket holds at most
        ``bucket_bytes``, except a single larger tensor, which goes alone. Collective."""
        plan = plan_buckets(self.weight_specs(), bucket_bytes)
        stream = self.export_stream()
        try:
            if self.rank == 0:
                for bucket in plan:
                    yield [next(stream) for _ in bucket]
        finally:
            for _ in stream:  # keep the ranks in lockstep whatever the consumer did
                pass

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Under ``options.lora``: the adapter matrices by the names peft saves them under
        (``...q_proj.lora_A.weight``), CPU tensors, and peft's adapter config, on rank 0
        (empty on the others). Collective, and moves the adapters' bytes only: each rank
        sends rank 0 the parts of them its shards hold (:func:`rlcore_fsdp.adapters.assemble`),
        where gathering the FSDP units would move the frozen base weights beside them."""
        import torch.distributed as dist

        from rlcore_fsdp import adapters

        self._require_model()
        assert self.options is not None
        if self.options.lora is None:
            raise RuntimeError("adapter_state: this policy trains every weight (policy.options.lora is not set)")
        module_names = {id(m): n for n, m in self.model.named_modules()}
        wanted = adapters.adapter_modules(self.model)
        local: list[adapters.Part] = []
        for unit, _ in self._layout:
            flat = unit._handle.flat_param
            # The rank's own shard (full precision); before FSDP's lazy init (no forward yet)
            # the flat parameter's data is that shard.
            local_shard = getattr(flat, "_local_shard", flat.data)
            unit_name = module_names[id(unit)]
            prefix = hf_name(unit_name + ".") if unit_name else ""
            shards = zip(flat._fqns, flat._param_infos, flat._shard_param_infos, flat._shapes, strict=True)
            for fqn, info, shard, shape in shards:
                if id(info.module) in wanted and shard.in_shard:
                    values = local_shard[shard.offset_in_shard : shard.offset_in_shard + shard.numel_in_shard]
                    name = adapters.saved_name(prefix + hf_name(fqn))
                    local.append(adapters.Part(name, tuple(shape), shard.intra_param_start_idx, values.detach().cpu().clone()))
        parts: list[Any] = [None] * self.world_size
        if self.world_size > 1:
            dist.gather_object(local, parts if self.rank == 0 else None, dst=0)
        else:
            parts = [local]
        if self.rank != 0:
            return {}, {}
        return adapters.assemble([p for rank_parts in parts for p in rank_parts]), adapters.saved_config(self.model)

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole stream collected into a dict on rank 0 (CPU; ``{}`` on other ranks).
        O(model) memory: for tests and small models. Collective."""
        return {name: t.cpu() for name, t in self.export_stream()}

    def reference_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters gathered on every rank by summoning the whole model at once,
        independently of the streaming export. O(model) memory per rank: for tests and
        debugging only. Collective."""
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        self._require_model()
        with FSDP.summon_full_params(self.model, writeback=False, rank0_only=False):
            return {
                hf_name(n): p.detach().clone().cpu()
                for n, p in self.model.named_parameters(remove_duplicate=False)
            }

    # ------------------------------------------------------------- compute

    def _forward_logprobs(
        self, rows: Sequence[tuple[list[int], list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
        """Right-padded forward pass over ``rows`` (explicit attention mask).

        Returns ``token_lp`` [rows, columns] (float32), ``mask`` [rows, columns] (the
        columns that hold a completion token's logprob) and, per row, the column span
        ``(start, end)`` of its completion tokens. Logits are computed only from the
        shortest prompt's last position on (``logits_to_keep``): prompt positions that
        predict no completion token cost no vocabulary-sized memory.
        """
        import torch

        padded = right_padded(rows, self.pad_id)
        first, width = padded.first, padded.ids.shape[1]
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, length in enumerate(padded.lengths):
            attention[i, :length] = 1
        ids, attention = padded.ids.to(self.device), attention.to(self.device)
        out = self.model(
            input_ids=ids, attention_mask=attention, use_cache=False, logits_to_keep=width - first
        )
        logits = out.logits[:, :-1].float()  # positions first .. width - 2
        target = ids[:, first + 1 :].unsqueeze(-1)
        token_lp = logits.gather(-1, target).squeeze(-1) - torch.logsumexp(logits, dim=-1)
        return token_lp, padded.mask.to(self.device), padded.spans

    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """:meth:`PolicyGradientWorker.train_step`, with the adapters' dropout on during it
        (``options.lora.dropout``; the logprobs of the loss's ratio are computed without)."""
        from rlcore_fsdp import adapters

        self._require_model()
        lora = getattr(self.options, "lora", None)
        try:
            with adapters.dropout_on(self.model, lora):
                return super().train_step(*args, **kwargs)
        finally:
            if lora is not None:
                self._restore_frozen_views()

    def _restore_frozen_views(self) -> None:
        """Register the frozen units' parameters again after a training step.

        A training forward turns an FSDP unit's parameters into plain tensor views and its
        post-backward hook makes them parameters again; a unit whose parameters are all
        frozen (the root under LoRA: embeddings, final norm, head) gets no such hook, and
        with one rank (``NO_SHARD``) nothing else resets them: the next forward would take
        the tensors for its parameters, and they would vanish from ``named_parameters`` and
        the state dict (torch 2.13's FSDP1). The parameter objects kept at :meth:`_shard`
        are put back and viewed into the unit's storage again."""
        for handle, params in self._frozen_units:
            handle.flat_param._params[:] = params
            handle._use_unsharded_views(as_params=True)

    def _data_parallel(self) -> tuple[int, int]:
        """Every rank takes its own rows (FSDP shards the weights over the same ranks)."""
        return self.world_size, self.rank

    def _micro_batches(self, local: list[Any], n_rows: int) -> Iterator[list[Any]]:
        """This rank's rows in micro-batches; every rank yields the same number of them
        (trailing ones may be empty)."""
        assert self.options is not None
        size = self.options.micro_batch_size
        for i in range(micro_batch_count(n_rows, self.world_size, size)):
            yield local[i * size : (i + 1) * size]

    def _finish_gradients(self) -> float:
        """FSDP averaged the gradients over the ranks: clip the global norm."""
        assert self.options is not None
        max_norm = self.options.max_grad_norm if self.options.max_grad_norm > 0 else math.inf
        return float(self.model.clip_grad_norm_(max_norm))

    # ---------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """This rank's part of a training checkpoint (:func:`rlcore_fsdp.checkpoint.save`);
        its seconds and bytes. Collective; reads the state only."""
        from rlcore_fsdp import checkpoint

        self._require_model()
        return checkpoint.save(self, directory)

    def stage_checkpoint(self, directory: str) -> dict[str, float]:
        """This rank's part of a staged save (:func:`rlcore_fsdp.checkpoint.stage`): returns
        once its state is in host memory; DCP writes it in the background. Collective."""
        from rlcore_fsdp import checkpoint

        self._require_model()
        return checkpoint.stage(self, directory)

    def checkpoint_written(self) -> bool:
        """Whether this rank's staged save is written (:func:`rlcore_fsdp.checkpoint.written`)."""
        from rlcore_fsdp import checkpoint

        return checkpoint.written(self)

    def load_checkpoint(self, directory: str, meta: dict[str, Any]) -> dict[str, Any]:
        """Restore weights, optimizer and RNG states from ``directory``
        (:func:`rlcore_fsdp.checkpoint.load`); its seconds. Collective."""
        from rlcore_fsdp import checkpoint

        self._require_model()
        return checkpoint.load(self, directory, meta)

    # ------------------------------------------------------------ lifecycle

    def _require_model(self) -> None:
        if self.model is None:
            raise RuntimeError("FSDPWorker.load must be called first")

    def teardown(self) -> None:
        """Close refit channels, drop the model, destroy the process group."""
        self.close_refit_channels()
        self._layout, self.model, self.optimizer = [], None, None
        super().teardown()


def decoder_layer_classes(model: nn.Module) -> set[type[nn.Module]]:
    """The model's decoder layer class(es), the unit of FSDP wrapping.

    From ``model._no_split_modules`` (class names transformers keeps whole), else
    the class of ``model.model.layers[0]``; empty if neither exists.
    """
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            classes = {type(layers[0])}
    return classes
