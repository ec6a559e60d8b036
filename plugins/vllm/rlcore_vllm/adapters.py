"""LoRA adapters served in place (refit content ``adapters``, contract 2.6), through vLLM's
own LoRA support: the engine starts with ``enable_lora`` sized for the run's adapters, each
refit reloads the one adapter in place (``LoRARequest(load_inplace=True)``; server mode:
``/v1/load_lora_adapter``), and every request names it, so the engine computes with base +
adapters as the policy does.

Light on import: vllm is imported inside the functions.
"""

from __future__ import annotations

from typing import Any

#: The adapter's id in the engine (vLLM wants ids from 1); there is only ever one.
ADAPTER_ID = 1
#: vLLM's allowed values of ``max_lora_rank``.
MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: What the base model is served as in server mode: the served name is the adapter's.
BASE_SUFFIX = "-base"


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM allows that holds adapters of ``rank``."""
    for allowed in MAX_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(
        f"policy.options.lora.rank={rank} is above vLLM's largest max_lora_rank ({MAX_RANKS[-1]}); "
        "lower the rank, or set refit.adapters=merged"
    )


def engine_args(adapters: Any) -> dict[str, Any]:
    """``vllm.LLM`` arguments that make room for the run's one adapter (none without)."""
    if adapters is None:
        return {}
    return {"enable_lora": True, "max_lora_rank": max_lora_rank(adapters.rank), "max_loras": 1}


def request(name: str, path: str, *, reload: bool = False) -> Any:
    """The adapter as vLLM's ``LoRARequest``: ``reload`` replaces the loaded one in place."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, ADAPTER_ID, path, load_inplace=reload)
