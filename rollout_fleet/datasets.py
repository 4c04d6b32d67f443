"""Prompt datasets from local files: JSONL, JSON, Parquet, Arrow, and Hugging Face ``save_to_disk`` folders.

The ``datasets`` package is not needed: a ``save_to_disk`` folder is a ``state.json`` naming Arrow files in IPC
stream format (a ``DatasetDict`` adds ``dataset_dict.json`` and one folder per split), which pyarrow reads.
Every problem with the input is reported with the file, the row (or line) and the field, at load time, so a
bad dataset fails before any rollout starts. Fields may be dotted paths into nested dicts
(``reward_model.ground_truth``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

CHAT_MODES = ("auto", "always", "never")


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file, the row and the field."""


def read_rows(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """All rows of a dataset file or folder as dicts, in file order."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path}: no such file or folder")
    if path.is_dir():
        return _read_saved_dataset(path, split)
    if split is not None:
        raise DatasetError(
            f"dataset {path}: split={split!r} only applies to a save_to_disk DatasetDict folder"
        )
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".json":
        return _read_json(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return _as_dicts(path, pq.read_table(path).to_pylist())
    if suffix == ".arrow":
        return _as_dicts(path, _read_arrow(path).to_pylist())
    raise DatasetError(
        f"dataset {path}: unknown format {suffix!r}; expected .jsonl, .json, .parquet, .arrow or a folder"
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset {path}: line {line_no}: invalid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"dataset {path}: line {line_no}: expected a JSON object, got {type(row).__name__}"
                )
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"dataset {path}: invalid JSON at line {e.lineno} ({e.msg})") from None
    if not isinstance(data, list):
        raise DatasetError(f"dataset {path}: expected a JSON list of objects, got {type(data).__name__}")
    return _as_dicts(path, data)


def _as_dicts(path: Path, rows: list[Any]) -> list[dict[str, Any]]:
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"dataset {path}: row {i}: expected an object, got {type(row).__name__}")
    return rows


def _read_arrow(path: Path) -> Any:
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        pass
    try:
        with pa.memory_map(str(path)) as source:
            return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as e:
        raise DatasetError(f"dataset {path}: not an Arrow IPC stream or file ({e})") from None


def _read_saved_dataset(path: Path, split: str | None) -> list[dict[str, Any]]:
    """A ``datasets`` save_to_disk folder: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        if split is None:
            if len(splits) != 1:
                raise DatasetError(
                    f"dataset {path}: a DatasetDict with splits {splits}; choose one with split="
                )
            split = splits[0]
        if split not in splits:
            raise DatasetError(f"dataset {path}: split {split!r} not found; available: {splits}")
        return _read_saved_dataset(path / split, None)
    state_file = path / "state.json"
    if not state_file.is_file():
        raise DatasetError(
            f"dataset {path}: a folder without state.json or dataset_dict.json is not a saved dataset"
        )
    files = [entry["filename"] for entry in json.loads(state_file.read_text()).get("_data_files", [])]
    if not files:
        raise DatasetError(f"dataset {path}: state.json lists no data files")
    rows: list[dict[str, Any]] = []
    for name in files:
        if not (path / name).is_file():
            raise DatasetError(f"dataset {path}: state.json lists {name}, which is missing")
        rows.extend(_read_arrow(path / name).to_pylist())
    return rows


def get_field(row: Mapping[str, Any], field: str, where: str) -> Any:
    """``row[field]`` with dotted paths into nested dicts; missing or null is an error naming ``where``."""
    node: Any = row
    for part in field.split("."):
        if not isinstance(node, Mapping) or part not in node:
            have = sorted(node) if isinstance(node, Mapping) else type(node).__name__
            raise DatasetError(f"{where}: field {field!r} is missing (the row has {have})")
        node = node[part]
    if node is None:
        raise DatasetError(f"{where}: field {field!r} is null")
    return node


def check_messages(value: Any, field: str, where: str) -> list[dict[str, str]]:
    """A chat prompt: a non-empty list of {"role": str, "content": str}."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise DatasetError(f"{where}: field {field!r} must be a string or a non-empty list of messages")
    for j, message in enumerate(value):
        if not (
            isinstance(message, Mapping)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f"{where}: field {field!r} message {j} needs string 'role' and 'content', got {message!r}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


class ChatFormatter:
    """Turns a prompt (a string or a list of chat messages) into the exact text the engine receives.

    ``auto``: message lists go through the tokenizer's chat template, strings stay raw; ``always``: strings
    become a user message (after ``system_prompt`` if set) and go through the template too; ``never``: strings
    stay raw and message lists are an error.
    """

    def __init__(self, mode: str = "auto", tokenizer: Any = None, system_prompt: str | None = None) -> None:
        if mode not in CHAT_MODES:
            raise DatasetError(f"chat_template must be one of {CHAT_MODES}, got {mode!r}")
        self.mode, self.tokenizer, self.system_prompt = mode, tokenizer, system_prompt

    def needs_template(self, prompt: str | list[dict[str, str]]) -> bool:
        return self.mode == "always" or (self.mode == "auto" and isinstance(prompt, list))

    def check(self, prompt: str | list[dict[str, str]], where: str) -> None:
        if isinstance(prompt, list) and self.mode == "never":
            raise DatasetError(f"{where}: the prompt is a list of messages but chat_template='never'")
        if self.needs_template(prompt):
            if self.tokenizer is None:
                raise DatasetError(f"{where}: the prompt needs a chat template but no tokenizer was given")
            if not getattr(self.tokenizer, "chat_template", None):
                raise DatasetError(f"{where}: the prompt needs a chat template but the tokenizer has none")

    def render(self, prompt: str | list[dict[str, str]], instruction: str | None = None) -> str:
        if not self.needs_template(prompt):
            return prompt if not instruction else f"{prompt}\n{instruction}"  # type: ignore[return-value]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if isinstance(prompt, str) and self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if instruction:
            last = messages[-1]
            messages[-1] = {**last, "content": f"{last['content']}\n{instruction}"}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class PromptDataset:
    """Rows of a dataset with a prompt field and an answer field, validated in full on first use.

    A prompt is a non-empty string or a list of chat messages; an answer is a string or a number (stored as
    its string). ``exclude`` holds prompt texts to leave out (the held-out set, for disjointness).
    """

    def __init__(
        self,
        path: str | Path,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        split: str | None = None,
        formatter: ChatFormatter | None = None,
        instruction: str | None = None,
    ) -> None:
        self.path, self.split = Path(path), split
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.formatter = formatter or ChatFormatter()
        self.instruction = instruction
        self.exclude: frozenset[str] = frozenset()
        self.excluded = 0

    def where(self, row_index: int) -> str:
        split = f" (split {self.split})" if self.split else ""
        return f"dataset {self.path}{split}: row {row_index}"

    @cached_property
    def _items(self) -> list[tuple[int, str, str]]:
        """(row index in the file, rendered prompt text, answer) for each row kept."""
        items = []
        for i, row in enumerate(read_rows(self.path, self.split)):
            where = self.where(i)
            prompt = get_field(row, self.prompt_field, where)
            if isinstance(prompt, str):
                if not prompt.strip():
                    raise DatasetError(f"{where}: field {self.prompt_field!r} is an empty string")
            else:
                prompt = check_messages(prompt, self.prompt_field, where)
            self.formatter.check(prompt, where)
            answer = get_field(row, self.answer_field, where)
            if isinstance(answer, bool) or not isinstance(answer, str | int | float):
                raise DatasetError(
                    f"{where}: field {self.answer_field!r} must be a string or a number, got {type(answer).__name__}"
                )
            text = self.formatter.render(prompt, self.instruction)
            if text in self.exclude:
                self.excluded += 1
            else:
                items.append((i, text, str(answer)))
        if not items:
            raise DatasetError(f"dataset {self.path}: no usable rows")
        return items

    def __len__(self) -> int:
        return len(self._items)

    def item(self, index: int) -> tuple[int, str, str]:
        """(row index in the file, prompt text, answer) of the ``index``-th kept row."""
        return self._items[index]

    def texts(self) -> frozenset[str]:
        return frozenset(text for _, text, _ in self._items)
