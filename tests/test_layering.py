"""The import rules of the house (README, "Layout"), checked over the AST of every module of every package.

Imports flow one way: ``common`` (utilities every package uses) imports no package of ours; ``broker`` (Redis
transport) and ``weight_sync`` (the weight-update protocol) import only ``common``; the roles (``archiver``,
``rollout_fleet``, ``learner``) import those three and never each other; ``streamrl`` (the application) imports
every package and no package imports it. Lazy imports inside functions count the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BELOW_ROLES = {"common", "broker", "weight_sync"}
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "broker": {"common"},
    "weight_sync": {"common"},
    "archiver": BELOW_ROLES,
    "rollout_fleet": BELOW_ROLES,
    "learner": BELOW_ROLES,
    "streamrl": BELOW_ROLES | {"archiver", "rollout_fleet", "learner"},
}


def imported_packages(path: Path, packages: set[str]) -> list[tuple[str, int]]:
    """Each (package of ours, line) that the module at ``path`` imports, at any depth of its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[0], node.lineno) for name in names if name.split(".")[0] in packages]
    return found


def violations(root: Path, allowed: dict[str, set[str]]) -> list[str]:
    """Every import that breaks ``allowed`` (package -> the packages it may import), as 'file:line: a -> b'."""
    bad = []
    for package, may_import in allowed.items():
        for path in sorted((root / package).rglob("*.py")):
            for target, line in imported_packages(path, set(allowed)):
                if target != package and target not in may_import:
                    bad.append(f"{path.relative_to(root)}:{line}: {package} -> {target}")
    return bad


def test_every_package_of_the_project_has_a_place_in_the_layering() -> None:
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "benchmarks"}
    assert packages == set(ALLOWED), "a new top-level package needs its line in ALLOWED (and in the README)"


def test_imports_flow_one_way() -> None:
    assert violations(ROOT, ALLOWED) == []


@pytest.mark.parametrize(
    ("package", "source", "expected"),
    [
        ("learner", "from rollout_fleet.tasks import get_task\n", "learner -> rollout_fleet"),
        ("broker", "def f():\n    import learner.trainer\n", "broker -> learner"),
        ("common", "from broker.client import connect\n", "common -> broker"),
        ("rollout_fleet", "import streamrl.config as c\n", "rollout_fleet -> streamrl"),
    ],
)
def test_the_check_finds_a_forbidden_import(tmp_path: Path, package: str, source: str, expected: str) -> None:
    for name in ALLOWED:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / package / "bad.py").write_text(source)
    assert [v.split(": ", 1)[1] for v in violations(tmp_path, ALLOWED)] == [expected]


# Modules that must load without torch (about 2 s of every process start on 2 cores): the config tree, which
# every role's entry and `--help` load first, what the supervisor, the learner's rank launcher and the
# control-only clients import.
TORCH_FREE = (
    "streamrl.config",
    "streamrl.cli",
    "streamrl.up",
    "streamrl.replay",  # the launcher of the replay's ranks
    "rollout_fleet.generate_client",
    "archiver.archive",
    "learner.main",
)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_config_tree_and_control_clients_load_without_torch(module: str) -> None:
    import subprocess
    import sys

    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", f"importing {module} loads {out.stdout.strip()}"
