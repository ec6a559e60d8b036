"""rlcore's SGLang generation backend (see README.md)."""
