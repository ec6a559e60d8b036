"""rlcore: the setup-and-weight-sync core for RL post-training of LLMs.

``import rlcore`` is light: it imports no torch, ray, vllm, megatron or
transformers. Heavy imports happen inside the backends when they start.
"""

from rlcore.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["hookimpl", "__version__"]
