"""rlcore-fsdp: a policy backend for rlcore that trains a Hugging Face causal LM with FSDP.

The package is light on import: :mod:`rlcore_fsdp.plugin` (the entry point) imports
neither torch nor ray; :mod:`rlcore_fsdp.worker` (inside Ray actors) does.
"""
