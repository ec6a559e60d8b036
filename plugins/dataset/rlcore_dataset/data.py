"""Reading ``env.options.data``: the rows of a JSONL, JSON or Parquet file, of a directory
of them, or of a ``datasets`` dataset saved to disk, as plain dicts.

Rows are held in memory (a prompt dataset for RL is thousands of rows, not billions);
every reader returns a list of dicts, one per row, the same whatever the format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlcore.errors import ConfigError

KEY = "env.options.data"
#: File suffixes read, in the order a directory lists them (sorted by name within).
SUFFIXES = (".jsonl", ".json", ".parquet")
#: Files ``datasets``' ``save_to_disk`` writes (a Dataset, a DatasetDict).
SAVED_DATASET_FILES = ("dataset_info.json", "state.json", "dataset_dict.json")


def data_path(data: str) -> Path:
    """The path ``env.options.data`` names, checked to exist."""
    if not data:
        raise ConfigError(
            f"{KEY} is not set: give the prompts as a JSONL, JSON or Parquet file or a directory "
            f"({KEY}=path/to/prompts.jsonl)",
            key=KEY,
        )
    path = Path(data).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{KEY} is {data!r}, which does not exist (relative to {Path.cwd()}); give an existing "
            "JSONL, JSON or Parquet file or a directory",
            key=KEY,
        )
    return path


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a directory ``datasets``' ``save_to_disk`` wrote."""
    return path.is_dir() and any((path / f).is_file() for f in SAVED_DATASET_FILES)


def data_files(path: Path) -> list[Path]:
    """The files to read: ``path`` itself, or a directory's JSONL/JSON/Parquet files."""
    if path.is_file():
        if path.suffix not in SUFFIXES:
            raise ConfigError(
                f"{KEY} is {str(path)!r}: a {path.suffix or 'suffix-less'} file; give a "
                f"{', '.join(SUFFIXES)} file or a directory of them",
                key=KEY,
            )
        return [path]
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
    if not files:
        raise ConfigError(
            f"{KEY} is the directory {str(path)!r}, which holds no {', '.join(SUFFIXES)} file "
            "(nor a datasets dataset saved with save_to_disk)",
            key=KEY,
        )
    return files


def load_rows(data: str, *, split: str = "train") -> list[dict[str, Any]]:
    """Every row of ``env.options.data``, as dicts; a :class:`ConfigError` naming the key,
    the file and the line for anything unreadable."""
    return load_rows_and_origins(data, split=split)[0]


def load_rows_and_origins(data: str, *, split: str = "train") -> tuple[list[dict[str, Any]], list[str]]:
    """:func:`load_rows`, and where each row is, for people: ``prompts.jsonl line 22`` (the
    file's own line, counted from 1), ``data.json item 3`` or ``data.parquet row 3`` (from 1),
    ``split 'train' row 3`` of a saved dataset."""
    path = data_path(data)
    if is_saved_dataset(path):
        rows = _saved_dataset(path, split)
        return rows, [f"{path.name} split {split!r} row {i}" for i in range(1, len(rows) + 1)]
    pairs = [pair for f in data_files(path) for pair in _file_rows(f)]
    if not pairs:
        raise ConfigError(f"{KEY} is {data!r}, which holds no rows; give at least one prompt", key=KEY)
    return [row for row, _ in pairs], [where for _, where in pairs]


def first_row(data: str, *, split: str = "train") -> dict[str, Any]:
    """The first row, read without loading the rest where the format allows (the preflight's
    column check)."""
    path = data_path(data)
    if is_saved_dataset(path):
        return load_rows(data, split=split)[0]
    for f in data_files(path):
        for row, _ in _file_rows(f):
            return row
    raise ConfigError(f"{KEY} is {data!r}, which holds no rows; give at least one prompt", key=KEY)


def _file_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """Each row of the file, with where it is (counted from 1)."""
    if path.suffix == ".jsonl":
        yield from _jsonl(path)
    elif path.suffix == ".json":
        yield from _json(path)
    else:
        yield from ((row, f"{path.name} row {i}") for i, row in enumerate(_parquet(path), 1))


def _jsonl(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{KEY}: {path} line {n} is not JSON ({err.msg}); each line is one JSON object",
                    key=KEY,
                ) from None
            yield _object(row, f"{path} line {n}"), f"{path.name} line {n}"


def _json(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ConfigError(f"{KEY}: {path} is not JSON ({err.msg} at line {err.lineno})", key=KEY) from None
    if not isinstance(rows, list):
        raise ConfigError(
            f"{KEY}: {path} holds a JSON {type(rows).__name__}; give a list of objects, one per row "
            "(or a .jsonl file, one object per line)",
            key=KEY,
        )
    for i, row in enumerate(rows, 1):
        yield _object(row, f"{path} item {i}"), f"{path.name} item {i}"


def _parquet(path: Path) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{KEY}: {path} is Parquet, which needs pyarrow: pip install 'rlcore-dataset[parquet]' "
            "(or convert it to JSONL)",
            key=KEY,
        ) from None
    yield from pq.read_table(path).to_pylist()


def _saved_dataset(path: Path, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"{KEY}: {path} is a datasets dataset saved with save_to_disk, which needs the datasets "
            "package: pip install datasets (or export it with to_json to a .jsonl file)",
            key=KEY,
        ) from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(
                f"env.options.split is {split!r}, a split {path} does not have; use one of "
                f"{', '.join(loaded)}",
                key="env.options.split",
            )
        loaded = loaded[split]
    return list(loaded.to_list())


def _object(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise ConfigError(
            f"{KEY}: {where} is a JSON {type(row).__name__}; each row is an object of columns",
            key=KEY,
        )
    return row
