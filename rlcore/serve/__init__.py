"""Serving: the OpenAI-compatible endpoint rlcore puts in front of a token-level engine."""
