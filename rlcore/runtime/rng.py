"""A process's random-number states as a training checkpoint saves them.

:func:`capture` takes torch's CPU state, every CUDA device's (once CUDA is initialised),
Python's ``random`` and numpy's global state (where numpy is installed), as tensors, lists
and numbers only, so ``torch.load(..., weights_only=True)`` reads them back;
:func:`restore` sets them again. A policy backend's ``save_checkpoint`` stores one per rank
(and adds what is its own, such as Megatron's tensor-parallel tracker).
"""

from __future__ import annotations

import random
from typing import Any


def capture() -> dict[str, Any]:
    """This process's RNG states (copies)."""
    import torch

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = _numpy()
    if numpy is not None:
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return state


def restore(state: dict[str, Any]) -> None:
    """Set the states :func:`capture` took (CUDA's and numpy's where both sides have them)."""
    import torch

    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = _numpy()
    if numpy is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def _numpy() -> Any:
    """numpy where installed (transformers brings it); its global RNG is saved too."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
