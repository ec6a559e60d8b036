"""rlcore-vllm: vLLM as rlcore's generation backend."""
