"""The run's tokenizer, served without importing transformers where that changes nothing.

The driver encodes prompts and decodes completions; loading ``AutoTokenizer`` for that
imports transformers and, through it, torch: about 4.4 CPU-seconds on this project's
2-core machines, spent while the setup's workers start on the same cores. A checkpoint
whose tokenizer is the *generic* fast tokenizer (``tokenizer_class`` ``TokenizersBackend``
or ``PreTrainedTokenizerFast``) is, in transformers, nothing but ``tokenizer.json`` run by
the ``tokenizers`` library (~0.05 s to load) with special tokens named in
``tokenizer_config.json``. :func:`load` serves such a checkpoint with :class:`FastTokenizer`
when the two files leave transformers nothing to change (:func:`fast_path_refusal`):

* no ``add_bos_token`` / ``add_eos_token`` in the config (transformers would rebuild the
  post-processor from them) and a post-processor in ``tokenizer.json``;
* every special token the config names is already a special added token of
  ``tokenizer.json``, and every entry of ``added_tokens_decoder`` is there with its id
  (transformers would otherwise add or re-flag tokens, changing ids or what
  ``skip_special_tokens`` drops);
* ``clean_up_tokenization_spaces`` off (transformers' default);
* no legacy ``special_tokens_map.json`` beside a config without ``added_tokens_decoder``
  (transformers would take the special tokens from it).

Any other checkpoint gets transformers' ``AutoTokenizer``. :class:`FastTokenizer` serves
what the run's loop, prompt-and-score envs and OpenAI-compatible endpoints call
(``tokenizer(text).input_ids``, ``encode``, ``decode``, ``batch_decode``, the special
token ids, ``len``, ``apply_chat_template`` through :mod:`rlcore.chat_template`) and hands
any other attribute to the transformers tokenizer of the same files, loaded on first use,
so an env that needs more of Hugging Face's interface (``pad``, tensors...) still gets it.
``tests/test_tokenizer.py`` and ``tests/test_chat_template.py`` hold the two to the same
ids and texts.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcore.chat_template import TRANSFORMERS_ONLY_OPTIONS, ChatTemplate, read_templates

log = logging.getLogger(__name__)

#: transformers' class names of the generic fast tokenizer (v5 and v4 spellings).
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
#: Config keys that name one special token each.
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


@functools.cache
def _transformers_v5() -> bool:
    """Whether the installed transformers is v5 or later, whose ``apply_chat_template``
    :class:`FastTokenizer` renders (v4 returns ids, not a dict, by default and passes more
    tokens to templates): read from its metadata, without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return int(version("transformers").split(".")[0]) >= 5
    except (PackageNotFoundError, ValueError):
        return True  # nothing to defer to: rlcore's own rendering


#: transformers' lazy imports are not thread-safe (two threads importing at once get
#: ImportError): every import of it by the driver's threads is made under this lock
#: (:mod:`rlcore.tinymodel` writes the tiny model under it too).
TRANSFORMERS_LOCK = threading.Lock()


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured_specials(config: dict[str, Any]) -> list[str]:
    names = [_token_text(config.get(key)) for key in SPECIAL_KEYS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        names += [_token_text(v) for v in (extra.values() if isinstance(extra, dict) else extra)]
    return [n for n in names if n is not None]


def _read(path: Path) -> tuple[dict[str, Any], str] | None:
    """``tokenizer_config.json`` (parsed) and ``tokenizer.json`` (text) of ``path``, read
    once for both the check and the tokenizer; None when either is missing."""
    tokenizer_file, config_file = path / "tokenizer.json", path / "tokenizer_config.json"
    if not tokenizer_file.is_file() or not config_file.is_file():
        return None
    return json.loads(config_file.read_text()), tokenizer_file.read_text()


def _refusal(config: dict[str, Any], spec_text: str) -> str | None:
    if config.get("tokenizer_class") not in GENERIC_CLASSES:
        return f"tokenizer_class {config.get('tokenizer_class')!r} is not the generic fast tokenizer"
    for key in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces"):
        if config.get(key):
            return f"tokenizer_config.json sets {key}"
    spec = json.loads(spec_text)
    if spec.get("post_processor") is None:
        return "tokenizer.json has no post_processor"
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    for name in _configured_specials(config):
        if not added.get(name, {}).get("special"):
            return f"special token {name!r} is not a special added token of tokenizer.json"
    for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
        found = added.get(entry.get("content"))
        if found is None or found["id"] != int(token_id) or bool(found.get("special")) != bool(entry.get("special")):
            return f"added token {entry.get('content')!r} differs from tokenizer.json"
    return None


def _checked(path: Path) -> tuple[tuple[dict[str, Any], str] | None, str | None]:
    """``path``'s files (:func:`_read`) and why they need transformers (or None)."""
    files = _read(path)
    if files is None:
        return None, "no tokenizer.json and tokenizer_config.json"
    if "added_tokens_decoder" not in files[0] and (path / "special_tokens_map.json").is_file():
        return files, "special tokens in a legacy special_tokens_map.json"
    return files, _refusal(*files)


def fast_path_refusal(path: Path) -> str | None:
    """Why ``path``'s tokenizer needs transformers (see the module doc), or ``None``."""
    return _checked(path)[1]


def transformers_tokenizer(path: str) -> Any:
    """transformers' ``AutoTokenizer`` of ``path``, imported under :data:`TRANSFORMERS_LOCK`."""
    with TRANSFORMERS_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)


class Encoded(dict):  # type: ignore[type-arg]
    """What ``tokenizer(text)`` returns: ``input_ids`` and ``attention_mask``, as keys and
    as attributes (the part of transformers' ``BatchEncoding`` the run uses)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    """A generic Hugging Face fast tokenizer served by ``tokenizers`` alone (module doc)."""

    def __init__(self, path: Path, files: tuple[dict[str, Any], str] | None = None) -> None:
        """``files``: the config and ``tokenizer.json`` text already read (:func:`load`)."""
        from tokenizers import Tokenizer

        self.name_or_path = str(path)
        files = files or _read(path)
        if files is None:
            raise FileNotFoundError(f"{path} has no tokenizer.json and tokenizer_config.json")
        config, spec_text = files
        self._config = config
        self._tokenizer = Tokenizer.from_str(spec_text)
        # transformers encodes one text untruncated and unpadded unless asked.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self._full: Any = None
        self._full_lock = threading.Lock()
        for key in SPECIAL_KEYS:
            token = _token_text(self._config.get(key))
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else self._tokenizer.token_to_id(token))
        #: The checkpoint's template(s), as transformers' attribute of the same name (a
        #: template set here afterwards is the one later calls render, as there).
        self.chat_template = read_templates(path, config)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **kwargs: Any) -> Encoded:
        """``input_ids`` (and ``attention_mask``) of one text, or one list per text."""
        if kwargs:  # padding, truncation, tensors...: transformers' own
            return self.full(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return Encoded(input_ids=ids, attention_mask=[1] * len(ids))
        batch = [self.encode(t, add_special_tokens=add_special_tokens) for t in text]
        return Encoded(input_ids=batch, attention_mask=[[1] * len(ids) for ids in batch])

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return list(self.full.encode(text, add_special_tokens=add_special_tokens, **kwargs))
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        if kwargs:
            return str(self.full.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs))
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return str(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kwargs) for s in sequences]

    def __len__(self) -> int:
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    def apply_chat_template(
        self,
        conversation: Sequence[Any],
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """transformers' ``apply_chat_template`` (v5 defaults), rendered by
        :class:`rlcore.chat_template.ChatTemplate` over this tokenizer's current
        ``chat_template`` and special tokens: the text (``tokenize=False``), else its ids,
        as ``input_ids`` and ``attention_mask`` with ``return_dict``. One conversation or
        a list of them. Padding, truncation, tensors and assistant masks asked for (not at
        their defaults), tools given as functions, and a transformers older than v5 are
        transformers' own: such calls go to it. What it would refuse (an empty
        conversation, a tool that is neither a schema nor a function) is refused here."""
        tools = None if tools is None else list(tools)  # a generator is read once
        template_options = dict(
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
        # Keywords at transformers' defaults change nothing; others are its work.
        own = {k: kwargs.pop(k) for k in TRANSFORMERS_ONLY_OPTIONS if k in kwargs}
        if (
            any(own[k] not in (None, False, {}) for k in own)
            or any(callable(t) for t in tools or ())
            or not _transformers_v5()
        ):
            return self.full.apply_chat_template(
                conversation,
                tokenize=tokenize,
                return_dict=return_dict,
                **template_options,
                **own,
                **kwargs,
            )
        if isinstance(conversation, list | tuple) and not conversation:
            raise ValueError("cannot apply a chat template to an empty conversation")
        first = conversation[0] if isinstance(conversation, list | tuple) else None
        batched = isinstance(first, list | tuple) or hasattr(first, "messages")
        chats = [getattr(c, "messages", c) for c in conversation] if batched else [conversation]
        template = ChatTemplate(self.chat_template, self._special_tokens())
        texts = [template.render(chat, **template_options, **kwargs) for chat in chats]
        if not tokenize:
            return texts if batched else texts[0]
        ids = [self.encode(t, add_special_tokens=False) for t in texts]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(i) for i in ids]
        return Encoded(input_ids=ids if batched else ids[0], attention_mask=masks if batched else masks[0])

    def _special_tokens(self) -> dict[str, str]:
        """The named special tokens a chat template sees (transformers' ``special_tokens_map``)."""
        return {k: str(getattr(self, k)) for k in SPECIAL_KEYS if getattr(self, k, None) is not None}

    @property
    def full(self) -> Any:
        """transformers' tokenizer of the same files, loaded on first use."""
        with self._full_lock:
            if self._full is None:
                log.info("loading transformers' tokenizer of %s for an attribute rlcore does not serve", self.name_or_path)
                self._full = transformers_tokenizer(self.name_or_path)
            return self._full

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class lacks; dunders (pickle, copy) stay Python's.
        if name.startswith("__") or "_full_lock" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.full, name)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_full"], state["_full_lock"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._full_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab={len(self)})"


def load(path: Path) -> Any:
    """The tokenizer of the checkpoint at ``path``: a :class:`FastTokenizer` when it serves
    the files exactly, else transformers' ``AutoTokenizer`` (module doc)."""
    files, refusal = _checked(path)
    if refusal is None:
        return FastTokenizer(path, files)
    log.debug("tokenizer of %s through transformers: %s", path, refusal)
    return transformers_tokenizer(str(path))
