"""Every command line the README, docs/*.md and the comments of pyproject.toml and the Makefile show parses: a
renamed or removed config field cannot leave a stale example behind.

The command lines are ``streamrl ...``, ``python -m streamrl ...`` and ``make run RUN_ARGS="..."`` in code
blocks and in inline code. Each one's arguments go through what ``streamrl COMMAND`` itself parses them with
(the config loader of streamrl/cli.py, or the sub-command's own argument parser); nothing is started. A value
written as a placeholder (``N``, ``DIR``, ``HOST:PORT``, ``FILE.toml``) cannot be validated, so for it only the
field's name is checked against the config tree.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from common.configlib import ConfigError, iter_fields
from streamrl.cli import COMMANDS
from streamrl.config import StreamRLConfig, load

ROOT = Path(__file__).resolve().parents[1]
# the README and docs, and the two files whose comments show commands (pyproject's extras, the Makefile's targets)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "pyproject.toml", ROOT / "Makefile"]

# `streamrl` sub-commands with an argument parser of their own (not the config tree), and those the test cannot
# parse without running them: `model init` parses its options inside the model build, `audit` takes one path.
OWN_PARSER = {"inspect", "export", "compose", "replay"}
NOT_PARSED = {"model", "audit"}
FIELDS = {name for name, _, _, _ in iter_fields(StreamRLConfig)}
# a text field takes a placeholder as it is (a required one, like openenv's env_url, must be given to parse)
TEXT_FIELDS = {
    name for name, type_name, _, _ in iter_fields(StreamRLConfig) if type_name in ("str", "str | None")
}
# An upper-case word (N, DIR, RUN_DIR, HOST:PORT, FILE.toml, A:B), or one holding `...` or a shell `$`: a
# placeholder.
PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:[.:][A-Za-z0-9_]+)*|.*\.\.\..*|.*\$.*)$")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`]+)`")


@dataclass(frozen=True)
class Example:
    where: str  # file:line, for the failure message
    line: str  # the command line as shown

    def __str__(self) -> str:
        return f"{self.where}: {self.line}"


def _code_block_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of every fenced code block, with ``\\`` continuations joined."""
    out = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", first
        for offset, raw in enumerate(block.group(1).splitlines()):
            if not pending:
                start = first + offset
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            out.append((start, pending + raw))
            pending = ""
    return out


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span outside the fenced blocks; a span may wrap a line."""
    masked = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return [
        (masked.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())) for m in INLINE.finditer(masked)
    ]


def _command_start(line: str, inline: bool) -> str | None:
    """The command line from its ``streamrl`` / ``python -m streamrl`` / ``make run`` on, or None. Inline code
    must start with it (after a ``$`` prompt); a code block's line may put it after a prompt, environment
    assignments or a launcher (``kubectl exec POD -- streamrl up``); a comment line is prose."""
    if line.lstrip().startswith("#"):
        return None
    if inline and re.match(r"--[a-z_]+\.[a-z_]", line):  # `--section.field=value` alone: an override of `up`
        return f"streamrl up {line}"
    command = r"((?:python3? -m )?streamrl(?: .*)?$|make run RUN_ARGS=.*$)"
    match = re.match(r"\s*(?:\$ )?" + command, line) if inline else re.search(r"(?:^|[\s$])" + command, line)
    return match.group(1).strip() if match else None


def find_examples(paths: list[Path] = DOCS, root: Path = ROOT) -> list[Example]:
    found = []
    for path in paths:
        text = path.read_text()
        lines = [(n, line, False) for n, line in _code_block_lines(text)]
        for number, line, inline in [*lines, *((n, line, True) for n, line in _inline_spans(text))]:
            command = _command_start(line, inline)
            if command is not None:
                found.append(Example(f"{path.relative_to(root)}:{number}", command))
    return found


def _argv(line: str) -> list[str] | None:
    """The arguments after ``streamrl`` of a shown command line (``make run``'s are ``up``'s); None when the line
    names no sub-command (``streamrl COMMAND ...``, a bare ``streamrl``)."""
    line = line.split(" # ", 1)[0].split(" | ", 1)[0].split(" && ", 1)[0]
    words = shlex.split(line)
    if words[0] == "make":
        words = ["up", *shlex.split(words[2].partition("=")[2])] if len(words) > 2 else ["up"]
    else:
        words = words[words.index("streamrl") + 1 :]
    if not words or not re.fullmatch(r"[a-z][a-z-]*", words[0]):
        return None
    # usage lines: `[--x=V]` is an optional argument, `...` more of the same, `--section.field=value` any
    # override; a shell script's "${array[@]}" expands to arguments the page does not show
    words = [_unbracket(w) for w in words]
    return [w for w in words if w and w not in ("...", "|") and not w.startswith(("$", "--section.field"))]


def _unbracket(word: str) -> str:
    """A usage line's optional group (``[--x=V]``, ``[--config FILE.toml]``) without its brackets; a value's own
    brackets (a JSON list) stay."""
    if word.startswith("[-"):
        word = word[1:]
    while word.endswith("]") and word.count("]") > word.count("["):
        word = word[:-1]
    return word


def _config_args(args: list[str]) -> list[str]:
    """The dotted overrides of ``args`` the loader can validate; a placeholder value only names its field, which
    must exist (a failure names it as the loader does)."""
    kept: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=")
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
            value, i = args[i + 1], i + 1
        elif not eq:
            value = "..."  # a field named without a value: its name is checked
        i += 1
        name = key[2:]
        # --help prints; up's --resume RUN_DIR reads that run's config.toml, which a page's example has not got
        if arg in ("-h", "--help") or name == "resume" or name == "config" and PLACEHOLDER.match(value):
            continue
        if PLACEHOLDER.match(value) and key.startswith("--") and name not in TEXT_FIELDS:
            if name not in FIELDS:
                raise ConfigError(f"--{name}: no such field in the config tree")
            continue
        kept += [key, value] if not eq else [arg]
    return kept


def parse_example(line: str) -> None:
    """Parse a shown command line as ``streamrl`` would; ConfigError (or SystemExit from argparse) if stale."""
    argv = _argv(line)
    if argv is None:
        return
    name, rest = argv[0], argv[1:]
    if name in NOT_PARSED:
        return
    if name == "eval" and "--adversarial" in rest:
        rest = [a for a in rest if a != "--adversarial"]
    if name in OWN_PARSER:
        _parse_own(name, rest)
        return
    if name not in COMMANDS:
        raise ConfigError(f"streamrl {name}: no such sub-command")
    load(_config_args(rest))


def _sample_values(args: list[str]) -> list[str]:
    """``args`` with a placeholder value made a real one: the first of ``a|b|...``, else 0 after an option (a
    number, a path and a string all take it), else the positional RUN_DIR."""
    out = []
    for i, arg in enumerate(args):
        if "|" in arg:
            arg = arg.split("|")[0]
        elif PLACEHOLDER.match(arg):
            arg = "0" if i > 0 and args[i - 1].startswith("--") else "RUN_DIR"
        out.append(arg)
    return out


def _parse_own(name: str, rest: list[str]) -> None:
    if not rest or "-h" in rest or "--help" in rest:  # `streamrl inspect` alone names the command
        return
    if name == "inspect":
        from streamrl.inspect import parse_args

        parse_args(_sample_values(rest))
    elif name in ("export", "replay"):
        from streamrl.export import _parser as export_parser
        from streamrl.replay import _parser as replay_parser

        (export_parser if name == "export" else replay_parser)().parse_args(_sample_values(rest))
    else:  # compose: --devices N and --out FILE are its own, the rest are config overrides (compose.main)
        own = {"--devices", "--out"}
        skip = {i + 1 for i, a in enumerate(rest) if a in own} | {i for i, a in enumerate(rest) if a in own}
        overrides = [a for i, a in enumerate(rest) if i not in skip and a.split("=")[0] not in own]
        load(_config_args(overrides))


EXAMPLES = find_examples()


def test_the_docs_show_commands() -> None:
    """The finder finds the README's and the docs' commands (it is not vacuously green)."""
    lines = {e.line for e in EXAMPLES}
    assert len(EXAMPLES) > 40
    assert any(line.startswith("streamrl plan --shared.devices=") for line in lines)
    assert any(line.startswith("make run RUN_ARGS=") for line in lines)
    assert any(line.startswith("python -m streamrl") for line in lines)


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_every_shown_command_parses(example: Example) -> None:
    try:
        parse_example(example.line)
    except (ConfigError, SystemExit) as exc:
        pytest.fail(f"{example}: {exc}")


@pytest.mark.parametrize(
    ("text", "stale"),
    [
        ("Run `streamrl up --task.name=long_multiplication`.", "task"),  # the key is rollout.task.name
        ("```\n$ streamrl plan --engine.counts=2 \\\n    --shared.eta=0\n```\n", "engine.counts"),
        ('`make run RUN_ARGS="--learner.max_step=0"`', "learner.max_step"),
        ("`python -m streamrl rollout --rollout.group_size=many`", "rollout.group_size"),
        ("```\nstreamrl up [--ray.adress=HOST:PORT]\n```\n", "ray.adress"),
        ("`streamrl inspect RUN_DIR --min-rewards 1`", "min-rewards"),
        ("`streamrl compose --devices 4 --engine.tp=2`", "engine.tp"),
        ("`streamrl serve --shared.eta=1`", "serve"),
        ("The task (`--task.name=tool_arithmetic`) is multi-turn.", "task"),  # an override shown alone
    ],
)
def test_a_stale_example_fails(
    tmp_path: Path, text: str, stale: str, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text(text)
    (example,) = find_examples([page], tmp_path)
    with pytest.raises((ConfigError, SystemExit)) as caught:
        parse_example(example.line)
    assert stale in str(caught.value) + capsys.readouterr().err


def test_a_current_example_with_placeholders_parses() -> None:
    for line in (
        "streamrl up --up.launcher=ray [--ray.address=HOST:PORT]",
        "streamrl up --resume RUN_DIR",
        "streamrl inspect RUN_DIR [--steps A:B] [--min-reward X] [--outcome trained|dropped|...]",
        'make run RUN_ARGS="--learner.max_steps=0"',
        "streamrl compose --devices 4 --learner.world_size=2",
    ):
        parse_example(line)
