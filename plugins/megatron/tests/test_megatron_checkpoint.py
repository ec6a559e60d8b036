"""The converted checkpoint: cache key, atomic publish under SIGKILL and concurrency, loading."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from rlcore.context import InitContext
from rlcore_megatron.checkpoint import checkpoint_key, checkpoint_path, convert_to_directory
from rlcore_megatron.options import CHECKPOINT_ARTIFACT, MegatronOptions

LOGITS_TOL = 1e-4


def test_key_is_stable_and_changes_with_what_matters(
    llama_dir: Path, qwen2_dir: Path, tmp_path: Path
) -> None:
    base = checkpoint_key(llama_dir)
    assert base == checkpoint_key(str(llama_dir), MegatronOptions())
    assert base.startswith(f"{llama_dir.name}-tp1-float32-r1-")
    others = {
        checkpoint_key(llama_dir, MegatronOptions(tensor_model_parallel_size=2)),
        checkpoint_key(llama_dir, dtype="bfloat16"),
        checkpoint_key(llama_dir, MegatronOptions(make_vocab_size_divisible_by=64)),
        checkpoint_key(qwen2_dir),
    }
    assert base not in others and len(others) == 4
    # Options that do not change the converted weights do not change the key.
    assert checkpoint_key(llama_dir, MegatronOptions(seed=7, timeout_s=1.0)) == base
    # Touching the weights (a rewritten checkpoint) changes it.
    copy = tmp_path / llama_dir.name
    copy.mkdir()
    for f in llama_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    key = checkpoint_key(copy)
    assert key != base  # another path
    st = os.stat(copy / "model.safetensors")
    os.utime(copy / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert checkpoint_key(copy) != key


def test_path_agrees_with_the_init_context(tmp_path: Path) -> None:
    ctx = InitContext.__new__(InitContext)
    ctx.cache_dir = tmp_path
    assert ctx.artifact_path(CHECKPOINT_ARTIFACT, "k") == checkpoint_path(tmp_path, "k")


def _own_helpers(p) -> bool:
    """Processes of the test process itself that outlive any one test (not the converter's)."""
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except Exception:
        return False


def test_cancel_kills_the_converter_and_its_children(llama_dir: Path, tmp_path: Path) -> None:
    import threading

    import psutil

    from rlcore.errors import Cancelled, CancelToken

    cancel = CancelToken()
    out = tmp_path / "out"
    seen: list[psutil.Process] = []
    before = {p.pid for p in psutil.Process().children(recursive=True)}

    def cancel_while_writing() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if out.exists() and any(f.name.endswith(".distcp") for f in out.iterdir()):
                break
            time.sleep(0.002)
        seen.extend(
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in before and not _own_helpers(p)
        )
        cancel.cancel("test cancels")

    threading.Thread(target=cancel_while_writing, daemon=True).start()
    with pytest.raises(Cancelled, match="test cancels"):
        convert_to_directory(llama_dir, out, cancel=cancel)
    assert len(seen) > 1, "cancelled while megatron-core's writer processes run"
    end = time.monotonic() + 10
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in seen):
        assert time.monotonic() < end, [p.cmdline() for p in seen if p.is_running()]
        time.sleep(0.05)
    assert not (out / ".rlcore-convert").exists()


def test_deadline_kills_the_converter(llama_dir: Path, tmp_path: Path) -> None:
    import psutil

    from rlcore.errors import Deadline, DeadlineExceeded

    before = {p.pid for p in psutil.Process().children()}
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="conversion of"):
        convert_to_directory(llama_dir, tmp_path / "out", deadline=Deadline(0.3, "init:policy"))
    assert time.monotonic() - t0 < 10
    left = [
        p
        for p in psutil.Process().children()
        if p.pid not in before and not _own_helpers(p) and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert left == []


def test_bad_checkpoints_fail_fast_or_name_the_failing_rank(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from rlcore_megatron.convert import ConversionError

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, '
        '"num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 5}'
    )
    t0 = time.monotonic()
    with pytest.raises(ConversionError, match="no model.safetensors"):
        convert_to_directory(bad, tmp_path / "out0")
    with pytest.raises(ConversionError, match="not divisible by tensor_model_parallel_size = 4"):
        convert_to_directory(bad, tmp_path / "out1", MegatronOptions(tensor_model_parallel_size=4))
    assert time.monotonic() - t0 < 1, "checked before any process starts"
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(bad / "model.safetensors"))
    with pytest.raises(ConversionError, match=r"rank 0 exited with code 1(.|\n)*shape \[3, 3\]"):
        convert_to_directory(bad, tmp_path / "out2")


def test_sigkill_mid_write_leaves_nothing_complete(publish_runs: dict[str, Any]) -> None:
    rec = publish_runs["killed"]
    assert any(f.endswith(".distcp") for f in rec["staging_files_at_kill"]), rec
    assert rec["ranks_alive_at_kill"] == 2, ("the kill must land while both TP ranks convert", rec)
    assert not rec["destination_exists_after_kill"]
    assert not rec["complete_after_kill"]
    # The converter ranks die with the process that started them, and take megatron-core's
    # writer, Manager and resource-tracker processes along.
    assert rec["descendants_at_kill"] > 2
    assert rec["descendants_alive_after_kill"] == []


def test_rerun_after_kill_publishes_a_complete_checkpoint(publish_runs: dict[str, Any]) -> None:
    rec = publish_runs["killed"]
    assert rec["rerun_path"] == rec["destination"]
    assert rec["complete_after_rerun"]
    # The dead converter's staging directory was cleaned; only the published entry is left.
    assert rec["cache_entries"] == [Path(rec["destination"]).name]


def test_concurrent_converters_publish_one_checkpoint(publish_runs: dict[str, Any]) -> None:
    rec = publish_runs["concurrent"]
    assert rec["paths"][0] == rec["paths"][1]
    assert rec["complete"]
    assert rec["cache_entries"] == [Path(rec["paths"][0]).name]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["llama-tp1", "qwen2-tp2"])
def test_published_checkpoint_loads_with_the_same_logits(
    tp_report: Any, tp: int, name: str
) -> None:
    """Loads after the rename (the .metadata names the staging path) and at another TP size."""
    entry = tp_report(tp)[f"checkpoint/{name}"]
    assert "error" not in entry, entry["error"]
    assert entry["logits_max_abs_diff"] < LOGITS_TOL, entry
