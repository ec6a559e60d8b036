"""``rlcore.context.artifact_key``: a filesystem-safe cache key that never gives two inputs one key."""

from __future__ import annotations

import itertools

from rlcore.context import artifact_key

SAFE = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-~")


def test_plain_parts_stay_readable() -> None:
    assert artifact_key("tiny", "float32", 3) == "tiny-float32-3"
    assert artifact_key("Qwen2.5_0.5B") == "Qwen2.5_0.5B"


def test_sanitized_keys_keep_a_readable_prefix() -> None:
    key = artifact_key("/models/llama 3", "bfloat16")
    assert key.startswith("models_llama_3-bfloat16~")
    assert set(key) <= SAFE


def test_different_parts_never_share_a_key() -> None:
    # the example: both used to become "_-"-something
    assert artifact_key("+-") != artifact_key("*-")
    cases = [
        ("+-",), ("*-",), ("_-",), ("-",), ("",), (), ("", ""), ("a", "b"), ("a-b",), ("a_b",),
        ("a b",), ("a/b",), ("a", "", "b"), ("a--b",), ("_a",), ("a_",), ("a",), ("default",),
        (".",), ("..",), ("x" * 200,), ("x" * 201,), ("/m", "{'k': 1}"), ("/m", "{'k': 2}"),
    ]
    keys = [artifact_key(*c) for c in cases]
    assert len(set(keys)) == len(keys), [k for k in keys if keys.count(k) > 1]


def test_short_strings_over_a_small_alphabet_are_injective() -> None:
    alphabet = ["a", "_", "-", "+", "*", "."]
    inputs = [
        parts
        for n in range(1, 3)
        for lengths in itertools.product(range(0, 3), repeat=n)
        for parts in itertools.product(
            *[["".join(w) for w in itertools.product(alphabet, repeat=length)] for length in lengths]
        )
    ]
    seen: dict[str, tuple[str, ...]] = {}
    for parts in inputs:
        key = artifact_key(*parts)
        assert seen.setdefault(key, parts) == parts, (key, seen[key], parts)


def test_keys_are_filesystem_safe_and_bounded() -> None:
    for parts in [("..",), (".hidden",), ("x" * 500,), ("/a/b", "c:d", "é")]:
        key = artifact_key(*parts)
        assert set(key) <= SAFE
        assert key not in {"", ".", ".."} and not key.startswith(".")
        assert len(key) <= 100
