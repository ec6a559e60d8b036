"""rlcore backend plugin for megatron-core (policy and generation).

Modules:

* :mod:`rlcore_megatron.plugin` -- the declaration (entry point ``rlcore.backends: megatron``);
  light: no torch or megatron import.
* :mod:`rlcore_megatron.cpu_compat` -- the only patches of megatron-core, for CPU-only torch.
* :mod:`rlcore_megatron.convert` -- Hugging Face <-> Megatron weight mapping, config and model.
* :mod:`rlcore_megatron.checkpoint` -- the converted checkpoint: key, atomic publish, load.
* :mod:`rlcore_megatron.parallel` -- megatron-core parallel state in one process.
* :mod:`rlcore_megatron.inference` -- megatron-core's static inference engine, CPU-safe.
"""
