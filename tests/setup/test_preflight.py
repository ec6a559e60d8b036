"""Every check that needs no cluster runs before the cluster starts (rlcore.setup.preflight).

Each bad input goes through the real ``rlcore run`` entry point: in-process for the
whole table (Ray's start is replaced by a trap, so a check that ran too late fails
the test), and through ``.venv/bin/rlcore`` in a subprocess for a representative
subset, where no Ray process (``raylet``, ``gcs_server``) may ever appear.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rlcore.app.cli import main
from rlcore.config import load_config
from rlcore.errors import ConfigError
from rlcore.setup.preflight import check_model, check_safetensors, host_cpus, one_line

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "examples" / "quickstart.yaml")
RLCORE = Path(sys.executable).with_name("rlcore")
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "dashboard", "RuntimeEnvAgent")


# ---------------------------------------------------------------- fixtures


def write_checkpoint(path: Path) -> Path:
    """A small, well-formed Hugging Face checkpoint directory (header checks need no torch)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    (path / "tokenizer.json").write_text("{}")
    save_file(
        {"embed.weight": np.ones((16, 8), np.float32), "norm.weight": np.ones(8, np.float32)},
        str(path / "model.safetensors"),
    )
    return path


def _truncated(base: Path) -> Path:
    ck = write_checkpoint(base / "truncated")
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    return ck


def _no_weights(base: Path) -> Path:
    ck = write_checkpoint(base / "noweights")
    (ck / "model.safetensors").unlink()
    return ck


def _bad_json(base: Path) -> Path:
    ck = write_checkpoint(base / "badjson")
    (ck / "config.json").write_text("{model_type: llama")
    return ck


def _no_model_type(base: Path) -> Path:
    ck = write_checkpoint(base / "nomodeltype")
    (ck / "config.json").write_text("{}")
    return ck


def _no_tokenizer(base: Path) -> Path:
    ck = write_checkpoint(base / "notok")
    (ck / "tokenizer.json").unlink()
    return ck


def _missing_shard(base: Path) -> Path:
    ck = write_checkpoint(base / "index")
    (ck / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"embed.weight": "model-00001.safetensors"}})
    )
    return ck


def _garbage_header(base: Path) -> Path:
    ck = write_checkpoint(base / "garbage")
    (ck / "model.safetensors").write_bytes(b"\xff" * 64)
    return ck


def _empty_dir(base: Path) -> Path:
    (base / "empty").mkdir()
    return base / "empty"


def _a_file(base: Path) -> Path:
    (base / "afile").write_text("x")
    return base / "afile"


def _non_empty_dir(base: Path) -> Path:
    (base / "used").mkdir()
    (base / "used" / "metrics.jsonl").write_text("{}\n")
    return base / "used"


# (id, argv after `rlcore run QUICKSTART`, key the error names, extra text it must name)
# A callable in argv is called with tmp_path and replaced by the path it returns.
CASES: list[tuple[str, list, str, str]] = [
    ("steps-0", ["grpo.steps=0"], "grpo.steps", "at least 1"),
    ("dtype-undeclared", ["model.dtype=float16"], "model.dtype",
     "policy backend 'fsdp' runs in bfloat16, float32 only"),
    ("steps-neg", ["grpo.steps=-3"], "grpo.steps", "at least 1"),
    ("samples-0", ["grpo.samples_per_prompt=0"], "grpo.samples_per_prompt", "at least 1"),
    ("prompts-0", ["grpo.prompts_per_step=0"], "grpo.prompts_per_step", "at least 1"),
    ("max-new-tokens-0", ["grpo.max_new_tokens=0"], "grpo.max_new_tokens", "at least 1"),
    ("temperature-neg", ["grpo.temperature=-0.5"], "grpo.temperature", "at least 0"),
    ("clip-0", ["grpo.clip_eps=0"], "grpo.clip_eps", "greater than 0"),
    ("bucket-0", ["refit.bucket_mb=0"], "refit.bucket_mb", "greater than 0"),
    ("bucket-neg", ["refit.bucket_mb=-5"], "refit.bucket_mb", "greater than 0"),
    ("refit-timeout-0", ["refit.timeout_s=0"], "refit.timeout_s", "greater than 0"),
    ("probe-0", ["refit.probe_prompts=0"], "refit.probe_prompts", "at least 1"),
    ("deadline-0", ["setup.deadline_s=0"], "setup.deadline_s", "greater than 0"),
    ("shutdown-timeout-neg", ["setup.shutdown_timeout_s=-1"], "setup.shutdown_timeout_s", "greater than 0"),
    ("task-deadline-0", ["setup.task_deadline_s={init:policy: 0}"], "setup.task_deadline_s.init:policy", "greater than 0"),
    ("task-deadline-unknown", ["setup.task_deadline_s={init:polcy: 5}"], "setup.task_deadline_s.init:polcy", "init:policy"),
    ("workers-0", ["policy.workers=0"], "policy.workers", "at least 1"),
    ("devices-0", ["generation.devices_per_worker=0"], "generation.devices_per_worker", "greater than 0"),
    ("num-cpus-0", ["cluster.num_cpus=0"], "cluster.num_cpus", "at least 1"),
    ("dtype", ["model.dtype=float64"], "model.dtype", "bfloat16"),
    ("name-slash", ["name=a/b"], "name", "'/'"),
    ("unknown-backend", ["policy.backend=fdsp"], "policy.backend", "fsdp"),
    ("role-mismatch-env", ["env.backend=vllm"], "env.backend", "serves generation"),
    ("no-env", ["env.backend=null"], "env.backend", "needs an env"),
    ("role-mismatch-gen", ["generation.backend=fsdp"], "generation.backend", "serves policy"),
    ("transport-cuda-ipc", ["refit.transport=cuda_ipc"], "refit.transport", "cuda_ipc"),
    ("transport-http", ["refit.transport=http"], "refit.transport", "http"),
    ("unknown-option", ["policy.options.use_orig_param=true"], "policy.options.use_orig_param", "use_orig_params"),
    ("kv-cache-0", ["generation.options.kv_cache_gib=0"], "generation.options.kv_cache_gib", "at least 0.001"),
    ("refit-check", ["refit.check=prob"], "refit.check", "sampled"),
    ("model-preset", ["model.preset=llama1b"], "model.preset", "llama-1b"),
    ("gpu-colocated-shares", ["cluster.num_gpus=1", "placement.colocated=true"], "generation.devices_per_worker", "> 1"),
    ("gpu-fraction", ["cluster.num_gpus=4", "policy.devices_per_worker=1.5"], "policy.devices_per_worker", "whole GPUs"),
    ("too-few-gpus", ["cluster.num_gpus=1", "policy.devices_per_worker=1"], "policy.workers", "need 3 GPU"),
    ("model-missing", ["model.path=/nonexistent/model"], "model.path", "does not exist"),
    ("model-empty-string", ["model.path=''"], "model.path", "empty"),
    ("model-empty-dir", ["model.path={}", _empty_dir], "model.path", "config.json"),
    ("model-a-file", ["model.path={}", _a_file], "model.path", "not a directory"),
    ("model-no-weights", ["model.path={}", _no_weights], "model.path", "no weights"),
    ("model-truncated", ["model.path={}", _truncated], "model.path", "model.safetensors is truncated"),
    ("model-garbage", ["model.path={}", _garbage_header], "model.path", "model.safetensors"),
    ("model-bad-json", ["model.path={}", _bad_json], "model.path", "config.json"),
    ("model-no-model-type", ["model.path={}", _no_model_type], "model.path", "model_type"),
    ("model-no-tokenizer", ["model.path={}", _no_tokenizer], "model.path", "tokenizer"),
    ("model-missing-shard", ["model.path={}", _missing_shard], "model.path", "model-00001.safetensors"),
    ("too-many-workers", ["policy.workers=8"], "policy.workers", "embedded Ray cluster has 2"),
    ("env-max-workers", ["env.workers=2"], "env.workers", "env backend 'arithmetic' runs at most 1 worker"),
    ("cluster-too-small", ["cluster.num_cpus=1"], "workers", "has 1"),
    ("out-dir-is-file", ["output_dir={}", _a_file], "output_dir", "is a file"),
    ("out-dir-proc", ["output_dir=/proc/rlcore-runs"], "output_dir", "/proc"),
    ("out-dir-sys", ["output_dir=/sys/rlcore-runs"], "output_dir", "/sys"),
    ("out-is-file", ["--out", "{}", _a_file], "--out", "is a file"),
    ("out-non-empty", ["--out", "{}", _non_empty_dir], "--out", "--resume"),
    ("cache-dir-proc", ["setup.cache_dir=/proc/rlcore-cache"], "setup.cache_dir", "/proc"),
    ("override-bad-yaml", ["setup.task_deadline_s={init:env:"], "setup.task_deadline_s", "does not parse"),
]


def _argv(args: list, tmp_path: Path) -> list[str]:
    out: list[str] = []
    pending: str | None = None
    for a in args:
        if callable(a):
            assert pending is not None
            out[-1] = pending.format(a(tmp_path))
            pending = None
        else:
            out.append(a)
            if "{}" in a:
                pending = a
    return out


def _with_out(args: list[str], tmp_path: Path) -> list[str]:
    """Point the run at a fresh ``--out`` (unless the case tests the run directory itself)."""
    if "--out" in args or any(a.startswith("output_dir=") for a in args):
        return args
    return [*args, "--out", str(tmp_path / "run")]


def test_table_has_every_input_of_the_issue() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("argv", "key", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_fails_before_start(argv, key, text, tmp_path, capsys, no_cluster) -> None:
    args = _with_out(_argv(argv, tmp_path), tmp_path)
    rc = main(["run", QUICKSTART, *args])
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert rc == 2, captured
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert key in lines[0], lines[0]
    assert text in lines[0], lines[0]
    assert not (tmp_path / "run").exists()  # nothing was written for a run that never started


def test_plan_fails_with_the_same_line_as_run(tmp_path, capsys) -> None:
    """``rlcore plan`` runs the same checks (the output-dir ones against output_dir)."""
    for argv in (["grpo.steps=0"], ["policy.workers=8"], ["model.path=/nonexistent/model"],
                 [f"output_dir={_a_file(tmp_path)}"]):
        assert main(["plan", QUICKSTART, *argv]) == 2
        plan_err = capsys.readouterr().err.strip()
        assert main(["run", QUICKSTART, *argv]) == 2
        assert capsys.readouterr().err.strip() == plan_err


# ---------------------------------------------------------------- subprocess


def _run_cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, set[str], float]:
    """Run ``.venv/bin/rlcore``; sample its process tree until it exits.

    Returns (exit code, stderr, names of every descendant seen, seconds).
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(RLCORE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **(env or {})}, cwd=REPO,
    )
    seen: set[str] = set()
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            for child in parent.children(recursive=True):
                try:
                    seen.add(" ".join(child.cmdline())[:200] or child.name())
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        time.sleep(0.01)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err, seen, time.monotonic() - t0


SUBPROCESS_CASES = [
    "steps-0", "bucket-neg", "samples-0", "unknown-backend", "transport-cuda-ipc",
    "model-truncated", "too-many-workers", "out-dir-proc", "out-non-empty",
]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_cli_subprocess_exits_2_without_starting_ray(case: str, tmp_path: Path) -> None:
    _, argv, key, text = next(c for c in CASES if c[0] == case)
    args = _with_out(_argv(argv, tmp_path), tmp_path)
    rc, err, seen, _ = _run_cli(["run", QUICKSTART, *args])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0] and text in lines[0], err
    ray = [p for p in seen if any(r in p for r in RAY_PROCESSES)]
    assert not ray, f"Ray processes started: {ray}"


# ---------------------------------------------------------------- units


def test_a_good_checkpoint_passes(tmp_path: Path) -> None:
    ck = write_checkpoint(tmp_path / "ck")
    config = load_config(QUICKSTART, [f"model.path={ck}"])
    check_model(config)  # no error
    check_safetensors(ck / "model.safetensors")


def test_truncation_is_found_by_size_not_by_loading(tmp_path: Path) -> None:
    ck = write_checkpoint(tmp_path / "ck")
    f = ck / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data + b"\0")  # longer than the header says: also damaged
    with pytest.raises(ConfigError, match="longer than its header"):
        check_safetensors(f)
    f.write_bytes(data[:7])
    with pytest.raises(ConfigError, match="no valid header"):
        check_safetensors(f)


def test_resume_accepts_a_non_empty_out_dir(tmp_path: Path, monkeypatch) -> None:
    from rlcore.app.rundir import check_run_dir

    used = _non_empty_dir(tmp_path)
    with pytest.raises(ConfigError, match="--resume"):
        check_run_dir(used, resume=False)
    check_run_dir(used, resume=True)
    check_run_dir(tmp_path / "new" / "run", resume=False)
    assert not (tmp_path / "new").exists()  # the check creates nothing


def test_resume_needs_out(capsys) -> None:
    assert main(["run", QUICKSTART, "--resume"]) == 2
    assert "--out" in capsys.readouterr().err


def test_host_cpus_is_what_the_embedded_cluster_would_count() -> None:
    assert 1 <= host_cpus() <= (os.cpu_count() or 1)


def test_one_line() -> None:
    assert one_line("a.\nb\n\n  c  ") == "a. b; c"


def _fields_without_a_range(cls: type, prefix: str = "") -> list[str]:
    """Numeric fields of dataclass ``cls`` (nested ones too) declared without
    :func:`rlcore.config.bounded`."""
    import dataclasses
    import typing

    def numeric(t: object) -> bool:
        args = typing.get_args(t) or (t,)
        return any(a in (int, float) for a in args) or (
            typing.get_origin(t) is dict and typing.get_args(t)[1] in (int, float)
        )

    missing = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        if dataclasses.is_dataclass(t):
            missing += _fields_without_a_range(t, f"{prefix}{f.name}.")
        elif numeric(t) and "bounds" not in f.metadata:
            missing.append(f"{prefix}{f.name}")
    return missing


def test_every_numeric_config_field_declares_its_range() -> None:
    """Ranges are declared once, beside the field (rlcore.config.bounded)."""
    from rlcore.config import RunConfig

    missing = _fields_without_a_range(RunConfig)
    assert not missing, f"numeric config keys without a declared range: {missing}"


def test_every_numeric_option_of_the_installed_backends_declares_its_range() -> None:
    """rlcore's own backends declare a range for every numeric option, so `rlcore plan`
    refuses a zero batch size or an out-of-range port before anything starts, naming the
    key, instead of the backend failing at start."""
    from rlcore.setup.registry import load_registry

    registry = load_registry()
    options = {name: info.declaration.options for name, info in registry.backends.items()
               if info.declaration is not None and info.declaration.options is not None}
    assert {"megatron", "fsdp", "vllm", "sglang", "nemo_gym", "arithmetic", "dataset"} <= set(options)
    missing = {name: gaps for name, schema in options.items() if (gaps := _fields_without_a_range(schema))}
    assert not missing, f"backend options without a declared range: {missing}"


def test_backend_options_declare_ranges_the_same_way() -> None:
    from dataclasses import dataclass

    from rlcore.config import bounded, resolve_options

    @dataclass
    class Options:
        timeout_s: float = bounded(300.0, gt=0)

    assert resolve_options({"timeout_s": 5}, Options, section="policy", backend="b").timeout_s == 5
    with pytest.raises(ConfigError, match=r"'policy.options.timeout_s' is 0.0.*backend 'b'") as info:
        resolve_options({"timeout_s": 0}, Options, section="policy", backend="b")
    assert info.value.key == "policy.options.timeout_s"


def test_a_rule_across_backend_options_is_checked_where_they_are_resolved() -> None:
    """A backend's options dataclass states a rule over several options in ``__post_init__``
    (docs/writing-a-backend.md): its ConfigError comes out of resolving the options, key
    and all, as `rlcore plan` resolves them."""
    from dataclasses import dataclass

    from rlcore.config import resolve_options

    @dataclass
    class Options:
        batch: int = 8
        micro_batch: int = 4

        def __post_init__(self) -> None:
            if self.batch % self.micro_batch:
                raise ConfigError(f"policy.options.batch ({self.batch}) must divide by micro_batch", key="policy.options.batch")

    assert resolve_options({"batch": 12}, Options, section="policy", backend="b").batch == 12
    with pytest.raises(ConfigError, match=r"batch \(10\) must divide by micro_batch") as info:
        resolve_options({"batch": 10}, Options, section="policy", backend="b")
    assert info.value.key == "policy.options.batch"


def test_a_value_error_from_post_init_names_its_key_and_backend() -> None:
    """An options dataclass's ``__post_init__`` that raises a plain ValueError (or a
    ConfigError without a key, or with the bare field name) comes out of resolving the
    options as one ConfigError naming ``<role>.options.<field>`` and the backend."""
    from dataclasses import dataclass

    from rlcore.config import resolve_options

    @dataclass
    class Options:
        batch: int = 8
        micro_batch: int = 4
        mode: str = "a"

        def __post_init__(self) -> None:
            if self.batch % self.micro_batch:
                raise ValueError(f"micro_batch ({self.micro_batch}) must divide batch ({self.batch})")
            if self.mode == "x":
                raise ConfigError("x is not a mode", key="mode")
            if self.mode == "y":
                raise ValueError("these options do not go together")

    def refused(**options: object) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            resolve_options(options, Options, section="policy", backend="toy")
        assert "\n" not in str(info.value)
        return info.value

    err = refused(batch=10)
    assert err.key == "policy.options.micro_batch"
    assert str(err) == "wrong value for 'policy.options.micro_batch' of backend 'toy': micro_batch (4) must divide batch (10)"
    err = refused(mode="x")
    assert err.key == "policy.options.mode" and "'policy.options.mode' of backend 'toy'" in str(err)
    err = refused(mode="y")
    assert err.key == "policy.options" and "'policy.options' of backend 'toy'" in str(err)


def test_a_post_init_error_is_one_error_line_of_plan(monkeypatch, capsys) -> None:
    """`rlcore plan` prints a ValueError of the options' ``__post_init__`` as one ``error:``
    line with its key, exit 2 (not a traceback)."""
    from dataclasses import dataclass

    from rlcore.hookspecs import hookimpl
    from rlcore_arithmetic import plugin as arithmetic

    @dataclass
    class StrictOptions:
        max_operand: int = 9
        ops: str = "+"
        seed: int = 0

        def __post_init__(self) -> None:
            if self.max_operand > 5:
                raise ValueError(f"max_operand must be at most 5, not {self.max_operand}")

    declare = arithmetic.rlcore_declare_backend

    @hookimpl
    def rlcore_declare_backend():
        return dataclasses.replace(declare(), options=StrictOptions)

    monkeypatch.setattr(arithmetic, "rlcore_declare_backend", rlcore_declare_backend)
    assert main(["plan", QUICKSTART, "env.options.max_operand=7"]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert lines == ["error: wrong value for 'env.options.max_operand' of backend 'arithmetic': "
                     "max_operand must be at most 5, not 7"], lines
