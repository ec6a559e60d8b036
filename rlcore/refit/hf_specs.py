"""The weight specs of a Hugging Face checkpoint, worked out once per model and dtype.

An engine that receives refits by Hugging Face name needs the names, shapes and dtypes of
the checkpoint's ``state_dict``. Building them means importing torch and transformers and
instantiating the model on the meta device: about 3 CPU-seconds, on the cores the engine's
server starts on. The result depends only on ``config.json``, the dtype and the
transformers release, so it is kept in the run's cache (one JSON file per key, written
through a temporary file and ``os.replace``: a reader sees a whole file or none) and a
second run reads it without importing torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from importlib import metadata
from pathlib import Path

from rlcore.refit.specs import TensorSpec, spec_of

log = logging.getLogger(__name__)

#: The cache's subdirectory (under the run's ``setup.cache_dir``).
CACHE_NAME = "weight-specs"

# transformers builds a model in a dtype by switching torch's process-wide default dtype
# for the duration: two builds at once would give one of them some weights in the other's.
_build_lock = threading.Lock()


def specs_key(model_dir: str | Path, dtype: str) -> str:
    """What the specs of ``model_dir`` in ``dtype`` depend on, hashed: its ``config.json``,
    the dtype, and the transformers release that maps the config to a model."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    digest.update(f"\0{dtype}\0{metadata.version('transformers')}".encode())
    return digest.hexdigest()[:32]


def hf_weight_specs(model_dir: str | Path, dtype: str, cache_dir: str | Path | None = None) -> list[TensorSpec]:
    """``TensorSpec`` of every weight of the checkpoint's Hugging Face ``state_dict`` (tied
    weights under every name) in ``dtype``, built from ``config.json`` on the meta device
    (no weight is read, so it works for a refit-fed engine).

    With ``cache_dir``, read from ``cache_dir/weight-specs/<key>.json`` when an earlier
    call stored them there (:func:`specs_key`), else built and stored; a file that cannot
    be read is built again (and replaced), one that cannot be written is only logged.
    """
    path = Path(cache_dir) / CACHE_NAME / f"{specs_key(model_dir, dtype)}.json" if cache_dir else None
    if path is not None and path.is_file():
        try:
            return [TensorSpec(e["name"], tuple(e["shape"]), e["dtype"]) for e in json.loads(path.read_text())]
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("weight specs cache %s unreadable (%s): building them again", path, err)
    specs = _build(model_dir, dtype)
    if path is not None:
        try:
            _store(path, specs)
        except OSError as err:
            log.warning("cannot cache the weight specs at %s: %s", path, err)
    return specs


def _build(model_dir: str | Path, dtype: str) -> list[TensorSpec]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with _build_lock, torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return [spec_of(name, t) for name, t in model.state_dict().items()]


def _store(path: Path, specs: list[TensorSpec]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in specs]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
