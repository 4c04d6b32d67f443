"""SGLang's own parsers and request types applied to what streamrl sends (run in .venv-sglang, the Makefile's
sglang-venv target; tests/test_sglang_contract.py builds the cases with the project's functions and runs this).

Imports only SGLang, its pydantic/msgspec and the standard library. Reads one JSON object on stdin:

- ``server_args``: ``[{"argv": [...], "expect": {field: value}}]``, each argv parsed by
  ``ServerArgs.add_cli_args`` + ``ServerArgs.from_cli_args`` and compared field by field;
- ``requests``: ``[{"endpoint": "/x", "body": {...}}]``, each body validated as the HTTP server does (pydantic
  over the endpoint's ``io_struct`` request struct, the endpoint -> struct map read from
  ``entrypoints/http_server.py``), plus what the server silently ignores: a key that is no field of the struct;
- ``responses``: ``[{"endpoint": "/x", "body": {...}}]``, each decoded as the endpoint's ``*ReqOutput`` struct;
- ``generate``: ``[body, ...]``, each ``/generate`` body through SGLang's HTTP contract gate
  (``sglang.srt.entrypoints.api_contract.generate_contract_error``, the generated ``sglang.api.v1`` decoder that
  answers 400 for an unknown ``sampling_params`` key), plus top-level keys the gate would silently ignore.

Writes one JSON line: ``{"version": ..., "io_struct": "import" | "source", "server_args": [problems...],
"requests": [...], "responses": [...]}``, one list of problem strings per case (empty: it holds).

Why ``io_struct`` may come from its source: importing ``sglang.srt.managers.io_struct`` pulls in the scheduler,
model configs, quantization layers and GPU kernel packages (schedule_batch -> configs -> layers.linear ->
sglang.kernels -> tvm_ffi, torchvision, ...), which the CPU venv does not hold. Then the module's own source is
executed in part: its import lines for the standard library, msgspec and ``sglang.srt.utils.msgspec_utils``, and
the class definitions of ``BaseReq`` and the request / reply structs, verbatim. The structs and their pydantic
schema are SGLang's; nothing is re-typed here.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import types
from importlib import metadata
from pathlib import Path
from typing import Any

_SRT = None


def srt_dir() -> Path:
    global _SRT
    if _SRT is None:
        spec = importlib.util.find_spec("sglang")
        assert spec is not None and spec.submodule_search_locations, "sglang is not installed here"
        _SRT = Path(next(iter(spec.submodule_search_locations))) / "srt"
    return _SRT


# ------------------------------------------------------------------------------------------ server args


def check_server_args(argv: list[str], expect: dict[str, Any]) -> list[str]:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(argv)
    except (argparse.ArgumentError, SystemExit) as exc:
        return [f"ServerArgs' parser refused {argv}: {exc}"]
    if unknown:
        return [f"ServerArgs' parser does not know {unknown}"]
    try:
        args = ServerArgs.from_cli_args(ns)
    except Exception as exc:  # noqa: BLE001 - any refusal is the finding
        return [f"ServerArgs.from_cli_args: {type(exc).__name__}: {exc}"]
    problems = []
    for field, want in expect.items():
        if not hasattr(args, field):
            problems.append(f"ServerArgs has no field {field!r}")
        elif getattr(args, field) != want:
            problems.append(f"ServerArgs.{field} = {getattr(args, field)!r}, meant {want!r}")
    return problems


# ------------------------------------------------------------------------------------------- io_struct


def _routes() -> dict[str, tuple[str, str | None]]:
    """``endpoint -> (request struct, reply struct or None)`` from http_server.py: a handler decorated with
    ``@app.post(path)`` (or api_route) whose ``obj`` parameter is ``Annotated[X, Body()]`` or ``X``; the reply
    struct is X with ReqInput -> ReqOutput when io_struct defines it."""
    tree = ast.parse((srt_dir() / "entrypoints" / "http_server.py").read_text())
    out: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        paths = [
            d.args[0].value
            for d in node.decorator_list
            if isinstance(d, ast.Call)
            and isinstance(d.func, ast.Attribute)
            and d.func.attr in ("post", "api_route", "put")
            and d.args
            and isinstance(d.args[0], ast.Constant)
        ]
        struct = None
        for arg in node.args.args + node.args.kwonlyargs:
            if arg.arg != "obj" or arg.annotation is None:
                continue
            ann = arg.annotation
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Annotated":
                ann = ann.slice.elts[0]  # type: ignore[attr-defined]
            if isinstance(ann, ast.Subscript) and getattr(ann.value, "id", None) == "Optional":
                ann = ann.slice
            if isinstance(ann, ast.Name):
                struct = ann.id
        for path in paths:
            if struct is not None:
                out[path] = (struct, None)
    return out


def _load_io_struct() -> tuple[types.ModuleType, str]:
    try:
        import sglang.srt.managers.io_struct as io_struct

        return io_struct, "import"
    except ImportError:
        pass
    path = srt_dir() / "managers" / "io_struct.py"
    tree = ast.parse(path.read_text())
    wanted = {"BaseReq", "AbortReq"}
    wanted |= {
        n.name for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith(("ReqInput", "Output"))
    }
    module = types.ModuleType("sglang_io_struct_source")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module
    import msgspec

    # In order: every import line and module-level statement that works here (an import of the GPU side fails
    # and is left out), and each wanted class whose annotations resolve with what was imported; the others
    # (GenerateReqInput and the structs that need the scheduler's types) are left out.
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name not in wanted:
            continue
        try:
            exec(compile(ast.Module([node], []), str(path), "exec"), module.__dict__)
            if isinstance(node, ast.ClassDef):
                msgspec.structs.fields(module.__dict__[node.name])  # resolves the annotations now
        except Exception:  # noqa: BLE001 - what this subset cannot define is not something streamrl sends
            if isinstance(node, ast.ClassDef):
                module.__dict__.pop(node.name, None)
    return module, "source"


def _struct_problems(io: types.ModuleType, name: str, body: Any, what: str) -> list[str]:
    import msgspec
    import pydantic

    cls = getattr(io, name, None)
    if cls is None:
        return [f"{what}: io_struct has no {name} here"]
    if not isinstance(body, dict):
        return [f"{what}: the body is {type(body).__name__}, SGLang expects a JSON object ({name})"]
    fields = {f.name for f in msgspec.structs.fields(cls)}
    problems = [
        f"{what}: {key!r} is no field of SGLang's {name} (ignored by it)" for key in body if key not in fields
    ]
    try:
        pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
    except pydantic.ValidationError as exc:
        problems.append(f"{what}: SGLang's {name} refuses it: {exc}")
    return problems


def check_requests(io: types.ModuleType, routes: dict, cases: list[dict]) -> list[list[str]]:
    out = []
    for case in cases:
        endpoint = case["endpoint"]
        if endpoint not in routes:
            out.append(
                [f"{endpoint}: SGLang's http_server has no such POST endpoint taking a request struct"]
            )
            continue
        out.append(_struct_problems(io, routes[endpoint][0], case["body"], endpoint))
    return out


def _decode(value: Any, tp: Any, where: str) -> list[str]:
    """``value`` (decoded JSON) as SGLang's type ``tp``: a struct from its JSON object (as SGLang's
    ``msgspec_to_builtins`` writes one: field names, no key that is not a field, every required field), the rest
    by ``msgspec.convert``. msgspec itself decodes these ``array_like`` structs only from arrays (its IPC form)."""
    import typing

    import msgspec

    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if not isinstance(value, dict):
            return [f"{where}: {value!r} is not a JSON object ({tp.__name__})"]
        fields = {f.name: f for f in msgspec.structs.fields(tp)}
        problems = [f"{where}: {k!r} is no field of SGLang's {tp.__name__}" for k in value if k not in fields]
        for name, f in fields.items():
            if name in value:
                problems += _decode(value[name], f.type, f"{where}.{name}")
            elif f.required:
                problems.append(f"{where}: SGLang's {tp.__name__} requires {name!r}")
        return problems
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        tries = [_decode(value, arm, where) for arm in args]
        return [] if any(not t for t in tries) else min(tries, key=len)
    if origin in (dict,) and isinstance(value, dict) and len(args) == 2:
        return [p for k, v in value.items() for p in _decode(v, args[1], f"{where}[{k!r}]")]
    if origin in (list,) and isinstance(value, list) and args:
        return [p for i, v in enumerate(value) for p in _decode(v, args[0], f"{where}[{i}]")]
    try:
        msgspec.convert(value, tp, strict=False)
    except (msgspec.ValidationError, TypeError) as exc:
        return [f"{where}: {value!r}: {exc}"]
    return []


def check_responses(io: types.ModuleType, routes: dict, cases: list[dict]) -> list[list[str]]:
    out = []
    for case in cases:
        endpoint = case["endpoint"]
        struct = case.get("struct") or (
            routes[endpoint][0].replace("ReqInput", "ReqOutput") if endpoint in routes else None
        )
        if struct is None:
            out.append([f"{endpoint}: no SGLang reply struct named for it"])
            continue
        cls = getattr(io, struct, None)
        out.append(
            _decode(case["body"], cls, f"{endpoint} reply") if cls else [f"io_struct has no {struct} here"]
        )
    return out


def check_generate(bodies: list[Any]) -> list[list[str]]:
    import msgspec
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    fields = {f.encode_name for f in msgspec.structs.fields(GenerateRequest)}
    out = []
    for body in bodies:
        error = generate_contract_error(body)
        problems = [f"/generate: SGLang's contract gate refuses it (HTTP 400): {error}"] if error else []
        problems += [
            f"/generate: {k!r} is no field of SGLang's GenerateRequest (ignored by it)"
            for k in body
            if k not in fields
        ]
        out.append(problems)
    return out


def main() -> None:
    cases = json.loads(sys.stdin.read())
    result: dict[str, Any] = {"version": metadata.version("sglang")}
    result["server_args"] = [check_server_args(c["argv"], c["expect"]) for c in cases.get("server_args", [])]
    result["generate"] = check_generate(cases.get("generate", []))
    if cases.get("requests") or cases.get("responses"):
        io, how = _load_io_struct()
        routes = _routes()
        result["io_struct"] = how
        result["routes"] = {k: v[0] for k, v in routes.items()}
        result["requests"] = check_requests(io, routes, cases.get("requests", []))
        result["responses"] = check_responses(io, routes, cases.get("responses", []))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
