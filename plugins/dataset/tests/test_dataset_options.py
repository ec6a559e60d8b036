"""Bad input is refused when the options resolve (the preflight), one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlcore.config import resolve_options
from rlcore.errors import ConfigError
from rlcore_dataset.data import load_rows
from rlcore_dataset.options import DatasetOptions

REWARDS = str(Path(__file__).resolve().parent / "fixture_rewards.py")


def resolve(**options: object) -> DatasetOptions:
    return resolve_options(options, DatasetOptions, section="env", backend="dataset")


def refused(key: str, match: str, **options: object) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve(**options)
    assert info.value.key == key and "\n" not in str(info.value)


def test_good_options_resolve(data_file: Path) -> None:
    o = resolve(data=str(data_file), reward=[f"{REWARDS}:length", f"{REWARDS}:matches"], reward_weights=[1, 0.5])
    assert o.reward_weights == [1.0, 0.5]
    assert resolve(data=str(data_file), reward=f"{REWARDS}:length").reward == f"{REWARDS}:length"


def test_bad_input_is_named(data_file: Path, tmp_path: Path) -> None:
    ok = f"{REWARDS}:length"
    refused("env.options.data", "is not set", reward=ok)
    refused("env.options.data", "does not exist", data=str(tmp_path / "nope.jsonl"), reward=ok)
    refused("env.options.reward", "give the reward function", data=str(data_file))
    refused("env.options.reward", "cannot import 'no_such_module_xyz'", data=str(data_file), reward="no_such_module_xyz:f")
    refused("env.options.reward", "does not exist", data=str(data_file), reward="missing.py:f")
    refused("env.options.reward", "has no function 'nope'.*length", data=str(data_file), reward=f"{REWARDS}:nope")
    refused("env.options.reward", "requires 'difficulty'.*columns: answer, id", data=str(data_file), reward=f"{REWARDS}:needs_missing")
    refused("env.options.reward", "takes no 'completions'", data=str(data_file), reward=f"{REWARDS}:no_completions")
    refused("env.options.reward_weights", "2 weights for 1", data=str(data_file), reward=ok, reward_weights=[1, 2])
    refused("env.options.prompt_column", "lacks.*columns: prompt, answer, id", data=str(data_file), reward=ok, prompt_column="question")
    refused("env.options.on_reward_error", "fail, skip", data=str(data_file), reward=ok, on_reward_error="ignore")
    refused("env.options.reward_timeout_s", "reward_timeout_s", data=str(data_file), reward=ok, reward_timeout_s=0)
    refused("env.options.shufle", "Did you mean 'env.options.shuffle'", data=str(data_file), reward=ok, shufle=False)


def test_chat_messages_need_the_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    refused("env.options.chat_template", "chat_template=true", data=str(path), reward=f"{REWARDS}:length")
    assert resolve(data=str(path), reward=f"{REWARDS}:length", chat_template=True).chat_template


def test_formats_and_directories_give_the_same_rows(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(4)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]) + "\n")
    (tmp_path / "b.json").write_text(json.dumps(rows[2:]))
    (tmp_path / "notes.txt").write_text("ignored")
    assert load_rows(str(tmp_path)) == rows
    assert load_rows(str(tmp_path / "b.json")) == rows[2:]
    (tmp_path / "c.jsonl").write_text('{"prompt": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"c.jsonl line 2 is not JSON"):
        load_rows(str(tmp_path))


def test_parquet_is_read_with_pyarrow_or_refused_naming_the_extra(tmp_path: Path) -> None:
    path = tmp_path / "p.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")
        with pytest.raises(ConfigError, match=r"rlcore-dataset\[parquet\]"):
            load_rows(str(path))
        return
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}]), path)
    assert load_rows(str(path)) == [{"prompt": "a", "answer": "1"}]


def test_a_datasets_dataset_saved_to_disk_is_read(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")  # the test extra installs it
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": "3+1=", "answer": "4"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    assert load_rows(str(tmp_path / "one")) == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dict"))
    assert load_rows(str(tmp_path / "dict")) == rows[:1]


def test_each_row_knows_its_line_counted_from_one(tmp_path: Path) -> None:
    from rlcore_dataset.data import load_rows_and_origins

    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n\n{"prompt": "y"}\n')
    (tmp_path / "b.json").write_text('[{"prompt": "z"}]')
    rows, origins = load_rows_and_origins(str(tmp_path))
    assert [r["prompt"] for r in rows] == ["x", "y", "z"]
    # The blank line counts: the second row is the file's line 3, as an editor shows it.
    assert origins == ["a.jsonl line 1", "a.jsonl line 3", "b.json item 1"]
