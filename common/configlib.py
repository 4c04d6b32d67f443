"""Config machinery shared by every role: a TOML file plus dotted CLI overrides, validated by pydantic.

Each role package owns a pydantic section (``learner.config.LearnerConfig`` ...). A process builds a tree of
the sections it needs, loads it with :func:`load_config`, and renders ``--help`` with :func:`render_help`.
Errors name the dotted field and the offending value, so ``--learner.lr=abc`` says exactly what is wrong.
"""

from __future__ import annotations

import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import tomli_w
from pydantic import BaseModel, ConfigDict, Tag, ValidationError

T = TypeVar("T", bound=BaseModel)


class Section(BaseModel):
    """Base class of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ConfigError(ValueError):
    """A config file or override that cannot be accepted; the message names the field and the value."""


def parse_overrides(args: list[str]) -> tuple[Path | None, dict[str, Any]]:
    """Split ``--config FILE`` and ``--a.b=v`` / ``--a.b v`` arguments into a file path and a nested dict."""
    config_path: Path | None = None
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ConfigError(f"option --{key} needs a value")
            value = args[i + 1]
            i += 1
        i += 1
        if key == "config":
            config_path = Path(value)
            continue
        _set_dotted(overrides, key, _parse_value(value))
    return config_path, overrides


def _parse_value(text: str) -> Any:
    # JSON gives numbers, booleans, lists and null; anything else stays a string for pydantic to coerce.
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML (or JSON) config file into a dict; a missing or malformed file is a ConfigError."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid: {exc}") from exc


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "<root>"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {field}{shown}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def build_config(model: type[T], data: dict[str, Any]) -> T:
    """Validate a nested dict against ``model``; errors become one ConfigError naming fields and values."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_config(model: type[T], args: list[str], base: dict[str, Any] | None = None) -> T:
    """Defaults < ``base`` < the ``--config`` file < dotted overrides, validated as ``model``."""
    path, overrides = parse_overrides(args)
    data = dict(base or {})
    if path is not None:
        data = _deep_merge(data, read_config_file(path))
    return build_config(model, _deep_merge(data, overrides))


def dump_config(config: BaseModel, path: Path) -> None:
    """Write the resolved config as TOML (None values omitted: they mean 'the default')."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = config.model_dump(mode="json", exclude_none=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(tomli_w.dumps(data))
    tmp.replace(path)


def _type_name(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(annotation)) + "}"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _variants(annotation: Any) -> list[tuple[str, type[BaseModel]]] | None:
    """(tag, class) of each member of a union of config classes (a discriminated union), else None."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    out = []
    for member in typing.get_args(annotation):
        meta: tuple[Any, ...] = ()
        if typing.get_origin(member) is typing.Annotated:
            member, *rest = typing.get_args(member)
            meta = tuple(rest)
        if not (isinstance(member, type) and issubclass(member, BaseModel)):
            return None
        tag = next((m.tag for m in meta if isinstance(m, Tag)), member.__name__)
        out.append((tag, member))
    return out


def _walk(model: type[BaseModel], prefix: str = "", group: str = "") -> typing.Iterator[FieldRow]:
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _walk(annotation, dotted + ".", group)
            continue
        variants = _variants(annotation)
        if variants is not None:
            yield from _walk_union(dotted, field.get_default(call_default_factory=True), variants)
            continue
        default = REQUIRED if field.is_required() else field.get_default(call_default_factory=True)
        yield FieldRow(dotted, _type_name(annotation), default, field.description or "", group)


def _walk_union(
    dotted: str, default: Any, variants: list[tuple[str, type[BaseModel]]]
) -> typing.Iterator[FieldRow]:
    """A union selected by its ``name`` field: the name once, then each member's own fields under its tag."""
    shown = {tag: _shown_name(tag, member) for tag, member in variants}
    doc = f"Selects the {dotted.rsplit('.', 1)[-1]}; each one's fields are listed under its name."
    yield FieldRow(
        f"{dotted}.name", "{" + ",".join(shown.values()) + "}", getattr(default, "name", None), doc, ""
    )
    for tag, member in variants:
        summary = (member.__doc__ or "").strip().splitlines()[0].removeprefix(f"{tag}: ")
        label = f"{dotted}.name = {shown[tag]}: {summary}"
        rows = [row for row in _walk(member, dotted + ".", label) if row.dotted != f"{dotted}.name"]
        yield from rows or [FieldRow("", "", None, "", label)]  # a member with no fields still shows its name


def _shown_name(tag: str, member: type[BaseModel]) -> str:
    """A member's tag when its ``name`` is a Literal; else (any name) the name field's doc, e.g. a pattern."""
    field = member.model_fields["name"]
    if typing.get_origin(field.annotation) is typing.Literal:
        return tag
    return (field.description or tag).rstrip(".")


class _Required:
    """The default shown for a field that has none."""

    def __repr__(self) -> str:
        return "required"


REQUIRED = _Required()


class FieldRow(typing.NamedTuple):
    """One leaf field: ``group`` names the union member it belongs to ("" outside a union)."""

    dotted: str
    type_name: str
    default: Any
    doc: str
    group: str


def iter_fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, str, Any, str]]:
    """Yield (dotted name, type, default, doc) for every leaf field of a config tree; a field of a union of
    config classes once per member that has it."""
    for row in _walk(model, prefix):
        if row.dotted:
            yield row.dotted, row.type_name, row.default, row.doc


def render_help(
    model: type[BaseModel], sections: typing.Iterable[str] | None = None, fields: typing.Iterable[str] = ()
) -> str:
    """Every field of the selected sections (all when None), plus the single dotted ``fields`` named, with its
    type, default and one-line doc; a union's fields grouped under each member's name."""
    wanted = set(sections) if sections is not None else None
    singles = set(fields)
    lines = []
    current, current_group = None, ""
    for row in _walk(model):
        section = (row.dotted or row.group).split(".", 1)[0]
        if wanted is not None and section not in wanted and row.dotted not in singles:
            continue
        if section != current:
            current, current_group = section, ""
            section_doc = (model.model_fields[section].description or "").strip()
            lines.append(f"\n[{section}]  {section_doc}".rstrip())
        if row.group != current_group:
            current_group = row.group
            if row.group:
                lines.append(f"  {row.group}")
        if not row.dotted:
            continue
        indent = "    " if row.group else "  "
        shown = str(row.default) if isinstance(row.default, Path) else repr(row.default)
        lines.append(f"{indent}--{row.dotted} {row.type_name} (default: {shown})")
        lines.append(f"{indent}    {row.doc}")
    return "\n".join(lines).lstrip("\n")
