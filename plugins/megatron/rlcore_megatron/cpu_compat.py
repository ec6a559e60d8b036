"""CPU-compatibility patches for megatron-core, applied only when CUDA is absent.

megatron-core is written for GPUs. With the local (non-Transformer-Engine) layer
spec and ``use_cpu_initialization=True`` almost all of it runs on CPU tensors
over gloo; a few code paths still call CUDA directly and fail with ``Torch not
compiled with CUDA enabled``. This module holds the patches for exactly those
paths (found by running them on a CPU-only torch, megatron-core 0.16.1), and
nothing else in rlcore-megatron patches megatron-core.

How the patches stay narrow:

* :func:`apply` does nothing when ``torch.cuda.is_available()``; it is
  idempotent and thread-safe.
* CUDA calls inside a megatron-core function (``torch.cuda.current_device()``,
  ``tensor.cuda()``, ``torch.cuda.Event``) are answered by *caller-scoped
  shims*: the torch attribute is replaced by a function that behaves like CPU
  (``cpu`` device, tensor unchanged, a wall-clock timing event) **only when its
  direct caller is one of the megatron-core functions registered for it**, and
  calls torch's own attribute, with its usual error, for every other caller.
  Registration is by code object, so a patch covers one function, not a module.
* The tensor-parallel RNG tracker class is replaced by a subclass that keeps its
  named states as CPU generator states.
* What can be avoided by calling megatron-core differently is not patched. The
  default causal mask (``transformer.utils.get_default_causal_mask``, used when
  ``attention_mask=None``) and the inference wrapper's mask
  (``inference.utils.get_attention_mask``) are built on CUDA: pass an explicit
  mask (:func:`causal_mask`; :class:`rlcore_megatron.inference` does this for the
  static inference engine).

Every patch in :data:`PATCHES` names the code path it covers and why, and has a
test (``tests/test_cpu_compat.py``) that runs that path in a subprocess with
only that patch disabled (``$RLCORE_MEGATRON_CPU_COMPAT_DISABLE``) and expects
the CUDA error.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: Comma-separated patch names to leave out (tests use it to show a patch is needed).
DISABLE_ENV = "RLCORE_MEGATRON_CPU_COMPAT_DISABLE"


@dataclass(frozen=True)
class Patch:
    """One CPU patch: the megatron-core code path it covers, why, and how it is installed."""

    name: str
    covers: str
    why: str
    install: Callable[[], None]


_lock = threading.RLock()
_applied: set[str] = set()


# ---------------------------------------------------------------------------
# Caller-scoped shims
# ---------------------------------------------------------------------------


class _CpuTimingEvent:
    """Stands in for ``torch.cuda.Event(enable_timing=True)``: wall-clock timestamps."""

    def __init__(self) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _CpuTimingEvent) -> float:
        """Milliseconds from this event to ``end``, as CUDA events report it."""
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time() of an event that was not recorded")
        return (end._t - self._t) * 1000.0


def _cpu_current_device() -> Any:
    import torch

    return torch.device("cpu")


def _tensor_unchanged(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@dataclass
class _Shim:
    """A torch attribute replaced by a dispatcher: CPU behaviour for registered callers only."""

    owner: Any
    attr: str
    original: Any
    callers: set[Any]


_shims: dict[str, _Shim] = {}


def _install_shim(key: str, owner: Any, attr: str, cpu_impl: Callable[..., Any]) -> _Shim:
    shim = _shims.get(key)
    if shim is not None:
        return shim
    original = getattr(owner, attr)
    callers: set[Any] = set()

    if isinstance(original, type):
        # Keep it a class (megatron-core uses torch.cuda.Event in annotations).
        class Dispatch:
            def __new__(cls, *args: Any, **kwargs: Any) -> Any:
                if sys._getframe(1).f_code in callers:
                    return cpu_impl(*args, **kwargs)
                return original(*args, **kwargs)

        Dispatch.__name__ = Dispatch.__qualname__ = original.__name__
        replacement: Any = Dispatch
    else:

        def dispatch(*args: Any, **kwargs: Any) -> Any:
            if sys._getframe(1).f_code in callers:
                return cpu_impl(*args, **kwargs)
            return original(*args, **kwargs)

        dispatch.__name__ = getattr(original, "__name__", attr)
        dispatch.__doc__ = (
            f"rlcore_megatron.cpu_compat: CPU behaviour for registered megatron-core callers, "
            f"else torch's {key}."
        )
        replacement = dispatch
    setattr(owner, attr, replacement)
    shim = _shims[key] = _Shim(owner, attr, original, callers)
    return shim


def _code_of(fn: Any) -> Any:
    return inspect.unwrap(fn).__code__


def _cpu_device_for(*fns: Any) -> None:
    """``torch.cuda.current_device()`` called directly in ``fns`` answers ``cpu``."""
    import torch

    shim = _install_shim(
        "torch.cuda.current_device", torch.cuda, "current_device", _cpu_current_device
    )
    shim.callers.update(_code_of(f) for f in fns)


def _tensor_cuda_noop_for(*fns: Any) -> None:
    """``tensor.cuda()`` called directly in ``fns`` returns the (CPU) tensor unchanged."""
    import torch

    shim = _install_shim("torch.Tensor.cuda", torch.Tensor, "cuda", _tensor_unchanged)
    shim.callers.update(_code_of(f) for f in fns)


def _cpu_event_for(*fns: Any) -> None:
    """``torch.cuda.Event(...)`` created directly in ``fns`` is a wall-clock timing event."""
    import torch

    shim = _install_shim("torch.cuda.Event", torch.cuda, "Event", lambda *a, **k: _CpuTimingEvent())
    shim.callers.update(_code_of(f) for f in fns)


# ---------------------------------------------------------------------------
# The patches
# ---------------------------------------------------------------------------


def _install_rng_tracker() -> None:
    # megatron.core.tensor_parallel.random.model_parallel_cuda_manual_seed adds
    # named states to CudaRNGStatesTracker, whose ``add`` and ``fork`` read and
    # set the CUDA generator (torch.cuda.get_rng_state, _set_cuda_rng_state).
    # DotProductAttention.forward always enters ``get_cuda_rng_tracker().fork()``
    # around attention dropout, so without a working tracker no forward runs.
    # On CPU, dropout draws from the CPU generator: keep the named states as CPU
    # generator states. initialize_rng_tracker instantiates the module-level
    # name ``CudaRNGStatesTracker``, so replacing that name is enough.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _cpu_rng_tracker_class(mrandom.CudaRNGStatesTracker)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    if tracker is not None and not isinstance(tracker, mrandom.CudaRNGStatesTracker):
        # Made before apply(): rebuild it as the CPU one.
        mrandom.initialize_rng_tracker(force_reset=True)


def _cpu_rng_tracker_class(base: type) -> type:
    import torch

    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """megatron-core's RNG tracker with its named states kept for the CPU generator."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer_state, outer_name = torch.get_rng_state(), self._current_state_name
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                self._current_state_name = outer_name
                torch.set_rng_state(outer_state)

    return CpuRNGStatesTracker


def _install_rope() -> None:
    # megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb
    # moves ``inv_freq`` to torch.cuda.current_device() on the first forward
    # whenever it is a CPU tensor, i.e. always on CPU.
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    _cpu_device_for(RotaryEmbedding.get_emb)


def _install_memory_buffer() -> None:
    # megatron.core.utils.GlobalMemoryBuffer.get_tensor allocates its scratch
    # buffer on torch.cuda.current_device(); DotProductAttention.forward takes
    # the input of its ``baddbmm`` (attention scores) from it.
    from megatron.core.utils import GlobalMemoryBuffer

    _cpu_device_for(GlobalMemoryBuffer.get_tensor)


def _install_checkpoint_preload() -> None:
    # megatron.core.dist_checkpointing.strategies.filesystem_async:
    # FileSystemWriterAsync.get_save_function_and_args schedules
    # ``preload_tensors(write_buckets, non_blocking=True)``, which copies the
    # tensors to CPU with non_blocking and then calls torch.cuda.synchronize().
    # They are CPU tensors already: a blocking copy (a no-op) needs no sync.
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    original = FileSystemWriterAsync.preload_tensors

    def preload_tensors(write_buckets: Any, non_blocking: bool = True) -> Any:
        return original(write_buckets, non_blocking=False)

    FileSystemWriterAsync.preload_tensors = staticmethod(preload_tensors)


def _install_checkpoint_finalize() -> None:
    # megatron.core.dist_checkpointing.strategies.state_dict_saver.save_state_dict_async_finalize
    # (the end of every dist_checkpointing.save) broadcasts a "did any rank fail"
    # flag allocated on torch.cuda.current_device(); gloo broadcasts CPU tensors.
    from megatron.core.dist_checkpointing.strategies import state_dict_saver

    _cpu_device_for(state_dict_saver.save_state_dict_async_finalize)


def _install_kv_cache() -> None:
    # megatron.core.transformer.attention.Attention._allocate_memory allocates
    # the static inference KV cache on torch.cuda.current_device().
    from megatron.core.transformer.attention import Attention

    _cpu_device_for(Attention._allocate_memory)


def _install_text_generation() -> None:
    # megatron.core.inference.text_generation_controllers.text_generation_controller:
    # TextGenerationController.__init__ makes its sampling generator on
    # torch.cuda.current_device(); pad_input_prompt_tokens puts the prompt
    # tokens there; generate_all_output_tokens_static_batch (the static engine's
    # loop) allocates its bookkeeping tensors there, calls ``.cuda()`` on one of
    # them, and times every step with torch.cuda.Event.
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController as Controller,
    )

    _cpu_device_for(
        Controller.__init__,
        Controller.pad_input_prompt_tokens,
        Controller.generate_all_output_tokens_static_batch,
    )
    _tensor_cuda_noop_for(Controller.generate_all_output_tokens_static_batch)
    _cpu_event_for(Controller.generate_all_output_tokens_static_batch)


def _install_gather_last_dim() -> None:
    # megatron.core.tensor_parallel.mappings._gather_along_last_dim allocates the
    # all-gather output on torch.cuda.current_device(). Inference gathers the
    # vocab-parallel logits with it (GPTModel's output layer, runtime_gather_output=True)
    # whenever tensor parallelism is > 1: the static engine at TP=2.
    from megatron.core.tensor_parallel import mappings

    _cpu_device_for(mappings._gather_along_last_dim)


PATCHES: tuple[Patch, ...] = (
    Patch(
        "rng_tracker",
        "megatron.core.tensor_parallel.random: CudaRNGStatesTracker.add/fork "
        "(model_parallel_cuda_manual_seed; forked in DotProductAttention.forward)",
        "reads and sets the CUDA generator's state",
        _install_rng_tracker,
    ),
    Patch(
        "rope_device",
        "megatron.core.models.common.embeddings.rotary_pos_embedding: RotaryEmbedding.get_emb",
        "moves inv_freq to torch.cuda.current_device() on the first forward",
        _install_rope,
    ),
    Patch(
        "memory_buffer_device",
        "megatron.core.utils: GlobalMemoryBuffer.get_tensor (DotProductAttention.forward)",
        "allocates its scratch buffer on torch.cuda.current_device()",
        _install_memory_buffer,
    ),
    Patch(
        "checkpoint_preload_sync",
        "megatron.core.dist_checkpointing.strategies.filesystem_async: "
        "FileSystemWriterAsync.preload_tensors (dist_checkpointing.save)",
        "calls torch.cuda.synchronize() after a non-blocking copy to CPU",
        _install_checkpoint_preload,
    ),
    Patch(
        "checkpoint_finalize_device",
        "megatron.core.dist_checkpointing.strategies.state_dict_saver: "
        "save_state_dict_async_finalize (dist_checkpointing.save)",
        "allocates the failure flag it broadcasts on torch.cuda.current_device()",
        _install_checkpoint_finalize,
    ),
    Patch(
        "kv_cache_device",
        "megatron.core.transformer.attention: Attention._allocate_memory (static inference)",
        "allocates the KV cache on torch.cuda.current_device()",
        _install_kv_cache,
    ),
    Patch(
        "static_generation",
        "megatron.core.inference.text_generation_controllers.text_generation_controller: "
        "TextGenerationController.__init__, pad_input_prompt_tokens, "
        "generate_all_output_tokens_static_batch (static inference engine)",
        "sampling generator, prompt tokens and bookkeeping on torch.cuda.current_device(), "
        "a .cuda() call and torch.cuda.Event timing",
        _install_text_generation,
    ),
    Patch(
        "gather_last_dim",
        "megatron.core.tensor_parallel.mappings: _gather_along_last_dim "
        "(logits gathered over TP ranks for inference, TP > 1)",
        "allocates the all-gather output on torch.cuda.current_device()",
        _install_gather_last_dim,
    ),
)


def names() -> list[str]:
    """Names of all patches, in the order they are applied."""
    return [p.name for p in PATCHES]


def _disabled_from_env() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}


def apply(disable: Iterable[str] = ()) -> list[str]:
    """Apply the CPU patches (a no-op with CUDA; idempotent). Returns the names applied now.

    Args:
        disable: patch names to leave out, added to ``$RLCORE_MEGATRON_CPU_COMPAT_DISABLE``;
            only tests use this, to show that a patch is needed.
    """
    import torch

    if torch.cuda.is_available():
        return []
    skip = set(disable) | _disabled_from_env()
    unknown = skip - set(names())
    if unknown:
        raise ValueError(f"unknown cpu_compat patch(es) {sorted(unknown)}; known: {names()}")
    done: list[str] = []
    with _lock:
        for patch in PATCHES:
            if patch.name in _applied or patch.name in skip:
                continue
            patch.install()
            _applied.add(patch.name)
            done.append(patch.name)
            log.debug("megatron cpu_compat: patched %s (%s)", patch.covers, patch.why)
    return done


def applied() -> list[str]:
    """Names of the patches applied in this process."""
    return sorted(_applied)


def causal_mask(seq_len: int, device: Any = None) -> Any:
    """The causal attention mask megatron-core's local attention expects (True = masked).

    Shape ``[1, 1, s, s]``. Pass it instead of ``attention_mask=None``:
    megatron-core's default mask (``transformer.utils.get_default_causal_mask``)
    is built with ``device="cuda"``.
    """
    import torch

    return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device).triu(diagonal=1)
