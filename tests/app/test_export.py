"""``rlcore export`` without Ray: which checkpoint it takes, what it refuses, what it writes.

The checkpoints are written by the core's own writer around a stand-in policy that writes
files; the real export (FSDP policy, transformers loading the result) is tests/e2e/test_e2e_export.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.app.checkpoints import POLICY_DIR, step_dir, write_checkpoint
from rlcore.app.cli import EXIT_BAD_INPUT, main
from rlcore.app.export import check_target, checkpoint_root, find_checkpoint, write_model
from rlcore.errors import ConfigError
from rlcore.publish import publish_dir

REPO = Path(__file__).resolve().parents[2]


def save(root: Path, step: int) -> Path:
    """A complete checkpoint of ``step`` under ``root``, as a run publishes it."""

    def policy(directory: str) -> None:
        Path(directory, "shard-0.bin").write_bytes(bytes([step]) * 64)

    def write(staging: Path) -> None:
        write_checkpoint(staging, step=step, save_policy=policy, manifest={}, config_yaml="name: x\n")

    return publish_dir(step_dir(root, step), write)


def corrupt(path: Path) -> None:
    shard = path / POLICY_DIR / "shard-0.bin"
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    for step in (2, 4, 6):
        save(run / "checkpoints", step)
    return run


def test_the_newest_checkpoint_that_verifies_is_taken_naming_each_newer_one_skipped(run_dir: Path) -> None:
    assert find_checkpoint(run_dir).step == 6
    corrupt(step_dir(run_dir / "checkpoints", 6))
    (step_dir(run_dir / "checkpoints", 4) / POLICY_DIR / "shard-0.bin").unlink()
    chosen = find_checkpoint(run_dir)
    assert chosen.step == 2
    assert chosen.skipped == [
        "step-00000006 (corrupt: policy/shard-0.bin does not match its SHA-256 digest)",
        "step-00000004 (corrupt: policy/shard-0.bin is missing)",
    ]


def test_dir_may_be_the_run_its_checkpoints_or_one_step(run_dir: Path) -> None:
    root = run_dir / "checkpoints"
    assert checkpoint_root(run_dir) == (root, None)
    assert checkpoint_root(root) == (root, None)
    assert checkpoint_root(step_dir(root, 4)) == (root, 4)
    assert find_checkpoint(step_dir(root, 4)).step == 4
    assert find_checkpoint(root, step=2).step == 2
    with pytest.raises(ConfigError, match="--step 2 but .* is the checkpoint of step 4"):
        find_checkpoint(step_dir(root, 4), step=2)


def test_a_run_whose_checkpoint_dir_is_elsewhere_is_found_through_its_config(tmp_path: Path) -> None:
    elsewhere = tmp_path / "ckpts"
    save(elsewhere, 3)
    run = tmp_path / "run"
    run.mkdir()
    config = (REPO / "examples/quickstart.yaml").read_text()
    (run / "config.yaml").write_text(f"{config}\ncheckpoint:\n  dir: {elsewhere}\n")
    assert find_checkpoint(run).found.path == step_dir(elsewhere, 3)


def test_a_step_that_is_missing_or_corrupt_is_refused_naming_the_steps_there(run_dir: Path) -> None:
    with pytest.raises(ConfigError) as info:
        find_checkpoint(run_dir, step=5)
    assert "--step 5: no checkpoint of step 5" in str(info.value)
    assert "step-00000006 (complete), step-00000004 (complete), step-00000002 (complete)" in str(info.value)
    corrupt(step_dir(run_dir / "checkpoints", 4))
    with pytest.raises(ConfigError, match=r"--step 4: .*step-00000004 is unusable: corrupt: policy/shard-0.bin"):
        find_checkpoint(run_dir, step=4)


def test_nothing_usable_is_an_error_naming_what_was_found(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="it holds no checkpoint"):
        find_checkpoint(tmp_path)
    save(tmp_path, 1)
    corrupt(step_dir(tmp_path, 1))
    with pytest.raises(ConfigError, match=r"found step-00000001 \(corrupt"):
        find_checkpoint(tmp_path)


def test_the_target_must_be_new_or_empty(tmp_path: Path) -> None:
    assert check_target(tmp_path / "new") == tmp_path / "new"
    assert check_target(tmp_path) == tmp_path  # empty
    (tmp_path / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        check_target(tmp_path)


def test_cli_refusals_are_one_line_and_exit_2_before_anything_starts(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "model.safetensors").write_text("")
    assert main(["export", str(run_dir), "--to", str(full)]) == EXIT_BAD_INPUT
    assert f"error: --to {full} exists and is not empty" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--step", "9", "--to", str(tmp_path / "hf")]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "--step 9: no checkpoint of step 9" in err and len(err.strip().splitlines()) == 1
    assert main(["export", str(tmp_path / "nope"), "--to", str(tmp_path / "hf")]) == EXIT_BAD_INPUT
    assert "no such directory" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_the_model_directory_has_the_models_files_and_the_given_weights_sharded_when_large(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float32"}))
    (base / "tokenizer.json").write_text("{}")
    (base / "model.safetensors").write_text("old weights, not copied")
    weights = {f"layer.{i}.weight": torch.full((64, 64), float(i), dtype=torch.bfloat16) for i in range(4)}

    one = tmp_path / "one"
    one.mkdir()
    assert write_model(one, weights, base) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert json.loads((one / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert all(torch.equal(load_file(one / "model.safetensors")[n], t) for n, t in weights.items())

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    files = write_model(sharded, weights, base, max_shard="10KB")  # one 8 KiB tensor a shard
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 4 and set(shards) <= set(files)
    for name, t in weights.items():
        assert torch.equal(load_file(sharded / index["weight_map"][name])[name], t)
