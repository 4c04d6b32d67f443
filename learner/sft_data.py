"""The supervised trainer's data: a JSONL or Parquet file of prompt/completion pairs or chat conversations,
tokenized once into examples (token ids with a per-token loss mask).

A row (a JSONL line, or a Parquet row) is either ``{"prompt": str, "completion": str}`` (loss on the completion
and EOS) or ``{"messages": [{"role": str, "content": str, "loss": bool (optional)}, ...]}`` (loss on the
assistant turns unless a message's ``loss`` says otherwise). A conversation is rendered with the tokenizer's chat
template; a message's tokens are what its turn adds to the rendering of the turns before it, and an assistant
turn's header (the template's generation prompt) never carries loss (another role's turn with ``"loss": true`` is
trained whole, header included: a template has no generation prompt for it). The format is the file's suffix;
both go through the same row checks, and a bad row is refused with its line (row) number and field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common.supervised import Example

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIX = ".parquet"


class DataError(ValueError):
    """A dataset row that cannot be trained on; the message names the file, the line (row) and the field."""


def prompt_completion_example(tokenizer: Any, prompt: str, completion: str) -> Example:
    """Prompt tokens (mask 0), then completion tokens and EOS (mask 1)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example.prompt_and_output(prompt_ids, output_ids)


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    if not messages and not generation_prompt:
        return ""
    if getattr(tokenizer, "chat_template", None):
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=generation_prompt)
    # no template: the turns' contents one after another, each ended by EOS
    return "".join(m["content"] + tokenizer.eos_token for m in messages)


def chat_example(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """The conversation's tokens, each message's mask from its ``loss`` flag (default: assistant turns)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        loss = bool(message.get("loss", message["role"] == "assistant"))
        assistant = loss and message["role"] == "assistant"  # the template's generation prompt is its header
        header = _render(tokenizer, messages[:k], generation_prompt=True) if assistant else done
        full = _render(tokenizer, messages[: k + 1], generation_prompt=False)
        if not (header.startswith(done) and full.startswith(header)):
            raise ValueError(
                "the chat template does not render a conversation as its turns one after another"
            )
        for text, flag in ((header[len(done) :], 0), (full[len(header) :], int(loss))):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids, mask = ids + piece, mask + [flag] * len(piece)
        done = full
    return Example(ids, mask)


def _field(row: dict[str, Any], name: str, kind: type, where: str) -> Any:
    if name not in row:
        raise DataError(f"{where}: field {name!r} is missing")
    if not isinstance(row[name], kind) or isinstance(row[name], bool) and kind is not bool:
        raise DataError(f"{where}: field {name!r} must be a {kind.__name__}, got {row[name]!r}")
    return row[name]


def _check_messages(messages: list[Any], where: str) -> None:
    if not messages:
        raise DataError(f"{where}: field 'messages' is empty")
    for i, message in enumerate(messages):
        at = f"{where}: messages[{i}]"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be an object, got {message!r}")
        _field(message, "role", str, at)
        _field(message, "content", str, at)
        if "loss" in message:
            _field(message, "loss", bool, at)
    if not any(m.get("loss", m["role"] == "assistant") for m in messages):
        raise DataError(
            f"{where}: field 'messages' has no turn with loss (no assistant turn, no 'loss': true)"
        )


def line_example(tokenizer: Any, row: Any, where: str) -> Example:
    """The example of one parsed row (a JSONL line or a Parquet row); ``where`` ("FILE line N", "FILE row N")
    prefixes every error."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a line must be a JSON object, got {type(row).__name__}")
    if "messages" in row:
        messages = _field(row, "messages", list, where)
        _check_messages(messages, where)
        return chat_example(tokenizer, messages)
    if "prompt" in row or "completion" in row:
        prompt = _field(row, "prompt", str, where)
        completion = _field(row, "completion", str, where)
        if not completion:
            raise DataError(f"{where}: field 'completion' is empty")
        return prompt_completion_example(tokenizer, prompt, completion)
    raise DataError(
        f"{where}: needs field 'messages', or fields 'prompt' and 'completion' (got {sorted(row)})"
    )


def data_format(path: str | Path) -> str:
    """``"jsonl"`` or ``"parquet"``, from the suffix of ``path``; any other suffix is refused."""
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix == PARQUET_SUFFIX:
        return "parquet"
    raise DataError(
        f"sft.data = {str(path)!r}: unknown format {suffix!r}; expected .jsonl or .json (JSON lines) or .parquet"
    )


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None


def _without_nulls(value: Any) -> Any:
    # Parquet has no absent field: a row without a completion, or a message struct without its optional 'loss'
    # (the column's struct has it for every message), reads as null; dropped, it meets the JSONL checks as missing
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _parquet_rows(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa  # only a Parquet dataset pays for the import
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowException as exc:
        raise DataError(f"{path}: not a Parquet file ({exc})") from None
    names = parquet.schema_arrow.names
    columns = [name for name in ("messages", "prompt", "completion") if name in names]
    if "messages" not in names and not {"prompt", "completion"} <= set(names):
        raise DataError(
            f"{path}: needs column 'messages', or columns 'prompt' and 'completion' (it has {sorted(names)})"
        )
    number = 0
    for group in range(parquet.num_row_groups):  # one row group in memory at a time
        for row in parquet.read_row_group(group, columns=columns).to_pylist():
            number += 1
            yield f"{path} row {number}", _without_nulls(row)


def load_examples(path: Path, tokenizer: Any, max_seq_len: int | None = None) -> list[Example]:
    """Every row of ``path`` (JSONL: blank lines skipped; Parquet) as an example; a row longer than
    ``max_seq_len`` tokens is refused rather than cut, since a cut one would train on a conversation nobody
    wrote."""
    rows = _parquet_rows(path) if data_format(path) == "parquet" else _jsonl_rows(path)
    examples = []
    for where, row in rows:
        example = line_example(tokenizer, row, where)
        if max_seq_len is not None and len(example.ids) > max_seq_len:
            raise DataError(f"{where}: {len(example.ids)} tokens, more than sft.max_seq_len = {max_seq_len}")
        examples.append(example)
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples
