"""Test-only helpers: an init context for the sglang hook, and the sending end of a
refit channel run in the test process (rank 0, with the core's channel code).

The in-process sender lets a test send what no real policy would (a tensor the
plan does not match), to see what the SGLang server does with it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from rlcore.config import GenerationConfig, ModelConfig, RunConfig, SetupConfig
from rlcore.context import InitContext
from rlcore.declarations import Role
from rlcore.testing import fixtures
from rlcore_sglang.options import SGLangOptions

PROMPTS = [[2, 5, 17, 6, 9, 25], [2, 12, 7, 14, 20], [2, 30, 31, 8]]


def make_config(model_dir: Path, cache_dir: Path, *, refit_fed: bool = True, **options: Any) -> RunConfig:
    return RunConfig(
        model=ModelConfig(path=str(model_dir)),
        generation=GenerationConfig(backend="sglang", refit_fed=refit_fed, workers=1, options=dict(options)),
        setup=SetupConfig(cache_dir=str(cache_dir)),
    )


def init_context(config: RunConfig, run_dir: Path, deadline_s: float = 300.0) -> InitContext:
    """An InitContext built as rlcore.setup.runner builds it for init:generation."""
    return fixtures.init_context(
        Role.GENERATION, "sglang", config, SGLangOptions, run_dir=run_dir, deadline_s=deadline_s
    )


def start(model_dir: Path, tmp: Path, *, refit_fed: bool = True, **options: Any) -> Any:
    """A generation handle (refit-fed unless told) through the real init hook."""
    from rlcore_sglang.plugin import rlcore_init_generation

    config = make_config(model_dir, tmp / "cache", refit_fed=refit_fed, **options)
    return rlcore_init_generation(init_context(config, tmp / "run"))


def hf_state(model_dir: Path, seed: int | None = None) -> dict[str, Any]:
    """The checkpoint's Hugging Face state dict, plus seeded noise (None: none)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    return state


def reference_logprobs(model_dir: Path, state: dict[str, Any], batch: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """Per-token completion logprobs of ``state`` under transformers (the truth to compare with)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.eval()
    rows = []
    with torch.no_grad():
        for prompt, completion in batch:
            ids = torch.tensor([prompt + completion])
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
            rows.append([float(lp[k - 1, ids[0, k]]) for k in range(len(prompt), ids.shape[1])])
    return rows


class ThreadSender:
    """Rank 0 of a refit channel in this process; each call runs in a thread (the receivers
    must act at the same time). ``run(fn)`` starts ``fn``; ``join()`` returns its result."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._result: list[Any] = [None, None]

    def run(self, fn: Callable[[], Any]) -> None:
        def body() -> None:
            try:
                self._result[0] = fn()
            except BaseException as err:  # handed to join()
                self._result[1] = err

        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()

    def join(self, timeout_s: float = 120.0) -> Any:
        assert self._thread is not None
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the sender did not finish"
        if self._result[1] is not None:
            raise self._result[1]
        return self._result[0]


def named(state: dict[str, Any], buckets: list[list[Any]]) -> Iterator[tuple[str, Any]]:
    return ((s.name, state[s.name]) for b in buckets for s in b)


def processes_mentioning(marker: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``marker``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or []):
                found.append(p.pid)
        except psutil.Error:
            pass
    return [pid for pid in found if pid != os.getpid()]
