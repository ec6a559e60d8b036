"""megatron-core's parallel state in one process: set up, tear down, and a forward helper.

A process that builds a megatron-core model (a policy worker, a converter, a
test) first needs a torch.distributed default group and megatron-core's
parallel state. These helpers do that the same way everywhere: CPU patches
first (:mod:`rlcore_megatron.cpu_compat`, a no-op with CUDA), then model
parallel groups, then the tensor-parallel RNG states.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def init_process_group(
    rank: int, world_size: int, init_method: str, *, timeout_s: float = 300.0
) -> None:
    """The default torch.distributed group: gloo on CPU, NCCL on CUDA, with a timeout.

    ``init_method`` is ``tcp://host:port`` or, for ranks of one host,
    ``file:///path/to/new/file`` (no port to pick, so no port race).
    """
    import torch
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def init_model_parallel(tp: int = 1, *, seed: int = 0) -> None:
    """megatron-core's parallel state with tensor parallelism ``tp`` over the default group.

    The default group's world size must be a multiple of ``tp`` (the rest is data
    parallelism). Applies the CPU patches when CUDA is absent.
    """
    from megatron.core import parallel_state, tensor_parallel

    from rlcore_megatron import cpu_compat

    cpu_compat.apply()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Undo :func:`init_model_parallel` and destroy the default group, if any."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def causal_logits(model: Any, input_ids: torch.Tensor, *, gather: bool = True) -> torch.Tensor:
    """Logits ``[batch, seq, vocab]`` of a local-spec ``GPTModel`` with an explicit causal mask.

    ``input_ids`` are moved to the model's device; the logits stay there.

    With ``gather`` the vocab-parallel logits are all-gathered over the
    tensor-parallel group (every rank must call); they are still padded
    (slice to the Hugging Face vocabulary size).
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlcore_megatron.cpu_compat import causal_mask

    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    batch, seq = input_ids.shape
    position_ids = torch.arange(seq, device=device).unsqueeze(0).expand(batch, -1)
    logits = model(input_ids, position_ids, causal_mask(seq, device=device))
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not gather or tp == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(
        parts, logits.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=-1)


def vocab_parallel_logprobs(
    logits: torch.Tensor, target: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """``log p(target)`` from this rank's vocab-parallel logits, padded vocabulary masked.

    ``logits`` ``[..., Vp / tp]`` is this tensor-parallel rank's slice of the padded
    vocabulary (``parallel_output=True``), ``target`` ``[...]`` holds token ids.
    Entries at ids ``>= vocab_size`` (Megatron's vocabulary padding) are set to
    ``-inf`` first, so the normaliser covers exactly the Hugging Face vocabulary.
    The logits are never gathered: megatron-core's ``vocab_parallel_cross_entropy``
    all-reduces the max, the sum of exponentials and the target logit over the
    tensor-parallel group (every rank must call). Differentiable; float32 result.
    """
    import torch
    from megatron.core import parallel_state, tensor_parallel

    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    x = logits.float()
    if start + part > vocab_size:
        ids = torch.arange(start, start + part, device=logits.device)
        x = x.masked_fill(ids >= vocab_size, float("-inf"))
    else:
        # vocab_parallel_cross_entropy works in place on its input: never on the caller's.
        x = x.clone()
    return -tensor_parallel.vocab_parallel_cross_entropy(x.contiguous(), target)
