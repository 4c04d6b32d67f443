"""What streamrl sends to SGLang, checked by SGLang's own code (issue 36): the pinned sglang (pyproject's
``sglang`` extra) lives in a third virtualenv, ``.venv-sglang`` (the Makefile's sglang-venv target, which
``make test`` builds), CPU only; tests/sglang_contract.py runs there. The cases are built here by the project's
own functions (``engine_command``, ``weight_sync.protocol``'s body builders, the rollout client), never re-typed:

- every ``sglang.launch_server`` command line parses with ``ServerArgs.add_cli_args`` / ``from_cli_args`` to the
  values meant, field by field;
- every control body validates as SGLang's HTTP server validates it (pydantic over the endpoint's ``io_struct``
  struct, the endpoint read from http_server.py) with no key SGLang would silently ignore;
- every ``/generate`` body the rollout client builds passes SGLang's HTTP contract gate (``sglang.api.v1``: an
  unknown ``sampling_params`` key is a 400) with no top-level key SGLang would ignore;
- the built-in engine's replies to those endpoints decode as SGLang's reply structs (``*ReqOutput``,
  ``LoRAUpdateOutput``) where they exist (the real handlers of rollout_fleet.engine.weights over HTTP, in front of
  a stand-in for the model-running engine);
- the sglang-router command (main venv, the router extra) parses with sglang-router's own ``parse_router_args``.

Each family has a negative twin (a misspelled flag or field, a value that is not what was meant) that must fail,
so the checks cannot pass with the contract gone.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from common.auth import run_secret
from common.config import SharedConfig
from rollout_fleet import fleet as fleet_mod
from rollout_fleet.config import EngineConfig
from rollout_fleet.generate_client import (
    EngineClient,
    SamplingConfig,
    build_generate_request,
    build_group_request,
)
from rollout_fleet.sglang_router import router_command
from streamrl.devices import resolve_plan
from weight_sync import protocol
from weight_sync.buckets import TensorMeta
from weight_sync.tensor_transport import serialize

pytestmark = pytest.mark.timeout(240)
ROOT = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = ROOT / os.environ.get("SGLANG_VENV", ".venv-sglang") / "bin" / "python"
SGLANG_VERSION = "0.5.23"  # the pin of pyproject's sglang extra


def run_checks(cases: dict) -> dict:
    """tests/sglang_contract.py in .venv-sglang on ``cases``; its JSON result."""
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: build it with `make sglang-venv` (`make test` does)")
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(ROOT / "tests" / "sglang_contract.py")],
        input=json.dumps(cases), capture_output=True, text=True, timeout=180, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"sglang_contract.py exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    )
    return json.loads(proc.stdout.splitlines()[-1])


# ---------------------------------------------------------------------------------------------- cases

SHARED = SharedConfig(
    run_id="contract", model_path=Path("/models/tiny"), run_dir=Path("/tmp/streamrl-contract")
)
LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "all",
             "--max-loras-per-batch", "2", "--max-loaded-loras", "4"]  # fmt: skip


def engine_cases(monkeypatch: pytest.MonkeyPatch, run_dir: Path) -> list[dict]:
    """engine_command for a spread of [engine] options (sglang need not be importable here: the command is
    what is checked), each with the ServerArgs values it means; one with the run secret (``run_dir``'s)."""
    monkeypatch.setattr(fleet_mod, "sglang_available", lambda: True)
    variants = [
        (EngineConfig(kind="sglang"), 0, 30000, {}),
        (EngineConfig(kind="sglang", tp_size=2, mem_fraction_static=0.7, max_running_requests=5, seed=7,
                      served_model_name="policy", max_context_len=512, dtype="bfloat16", host="0.0.0.0"),
         1, 30101, {"served_model_name": "policy", "context_length": 512, "dtype": "bfloat16"}),
        (EngineConfig(kind="sglang", tp_size=4, mem_fraction_static=0.2, seed=0, dtype="float16",
                      extra_args=["--disable-cuda-graph", *LORA_ARGS]),
         3, 31000, {"disable_cuda_graph": True, "enable_lora": True, "max_lora_rank": 8,
                    "max_loras_per_batch": 2, "max_loaded_loras": 4, "dtype": "float16"}),
        (EngineConfig(kind="sglang", dtype="float32", max_context_len=4096), 0, 30002,
         {"dtype": "float32", "context_length": 4096, "disable_radix_cache": False, "max_total_tokens": None}),
        (EngineConfig(kind="sglang", disable_radix_cache=True, max_total_tokens=20000), 0, 30003,
         {"disable_radix_cache": True, "max_total_tokens": 20000}),
    ]  # fmt: skip
    cases = []
    for engine, index, port, extra in variants:
        argv = fleet_mod.engine_command(SHARED, engine, port, index)
        assert argv[1:3] == ["-m", "sglang.launch_server"], argv
        seed = engine.seed_of(index)
        expect = {
            "model_path": str(SHARED.model_path),
            "host": engine.host,
            "port": port,
            "base_gpu_id": 0,
            "tp_size": engine.tp_size,
            "mem_fraction_static": engine.mem_fraction_static,
            "max_running_requests": engine.max_running_requests,
            **({"random_seed": seed} if seed is not None else {}),
            **extra,
        }
        cases.append({"argv": argv[3:], "expect": expect})
    # With the run secret (shared.auth on): SGLang's --api-key, which its HTTP server checks as a bearer token.
    secured = SHARED.model_copy(update={"auth": "on", "run_dir": run_dir})
    argv = fleet_mod.engine_command(secured, EngineConfig(kind="sglang", host="0.0.0.0"), 30004)
    cases.append(
        {"argv": argv[3:], "expect": {"host": "0.0.0.0", "port": 30004, "api_key": run_secret(secured)}}
    )
    # The device plan's own SGLang flags (an engine of 2 GPUs sees only its own: base GPU 0).
    plan = resolve_plan(["0", "1", "2", "3"], "disaggregated", 2, 1, 2)
    cases.append(
        {"argv": ["--model-path", "/m", *plan.sglang_args()], "expect": {"base_gpu_id": 0, "tp_size": 2}}
    )
    return cases


def request_cases() -> list[dict]:
    """Every control body streamrl sends to an SGLang endpoint, from the function that builds it."""
    metas = [TensorMeta("model.embed_tokens.weight", torch.bfloat16, (64, 16)),
             TensorMeta("lm_head.weight", torch.float32, (64, 16))]  # fmt: skip
    payload = serialize([("w", [0.0, 0.0])])  # the real serializer; no tensor, so no /dev/shm file is left
    p = protocol
    bodies = [
        (p.INIT_GROUP, p.init_group_body("10.0.0.1", 29500, 1, 3, "g", "nccl")),
        (p.INIT_GROUP, p.init_group_body("127.0.0.1", 29501, 2, 5, backend="gloo")),
        (p.UPDATE_DISTRIBUTED, p.update_distributed_body(metas)),
        (p.UPDATE_DISTRIBUTED, p.update_distributed_body(metas, "g", False, "7", "flattened_bucket", True)),
        (p.UPDATE_TENSOR, p.update_tensor_body([payload, payload])),
        (p.UPDATE_TENSOR, p.update_tensor_body([payload], False, "3", "flattened_bucket", True)),
        (p.RELEASE_MEMORY, p.memory_body(None)),
        (p.RELEASE_MEMORY, p.memory_body(["kv_cache", "weights"])),
        (p.RESUME_MEMORY, p.memory_body(None)),
        (p.RESUME_MEMORY, p.memory_body(["weights"])),
        (p.BEGIN, p.begin_body()),
        (p.END, p.end_body()),
        *[(p.PAUSE, p.pause_body(mode)) for mode in p.PAUSE_MODES],
        (p.CONTINUE, p.continue_body()),
        (p.DESTROY_GROUP, p.destroy_group_body("g")),
        (p.UPDATE_FROM_DISK, p.update_from_disk_body("/models/tiny", "4")),
        (p.GET_WEIGHTS_BY_NAME, p.get_weights_by_name_body("lm_head.weight", 5)),
        (p.UPDATE_WEIGHT_VERSION, p.update_weight_version_body("9")),
        (p.LOAD_LORA, p.load_lora_body("policy-v3", "/runs/x/lora/v3", pinned=True)),
        (p.UNLOAD_LORA, p.unload_lora_body("policy-v2")),
        (p.ABORT_REQUEST, p.abort_body("rid-1")),
        (p.ABORT_REQUEST, p.abort_body(abort_all=True)),
    ]
    return [{"endpoint": e, "body": b} for e, b in bodies]


async def client_cases() -> list[dict]:
    """What the rollout worker's EngineClient sends (abort, pause, continue, version label), captured at its
    one transport call."""
    sent: list[dict] = []
    client = EngineClient(None, "http://127.0.0.1:1", 1.0, 1.0)  # type: ignore[arg-type]

    async def capture(method: str, path: str, body: object, timeout: object) -> tuple[int, str]:
        sent.append({"endpoint": path, "body": body})
        return 200, "{}"

    client._call = capture  # type: ignore[method-assign]
    await client.abort("rid-2")
    for mode in protocol.PAUSE_MODES:
        await client.pause(mode)
    await client.resume()
    await client.update_weight_version(5)
    return sent


async def engine_replies(tmp: Path) -> list[dict]:
    """The built-in engine's replies on its weight endpoints (rollout_fleet.engine.weights: the receiver's
    routes and the engine's own update-from-disk and LoRA handlers) over real HTTP, each success and failure
    this can reach without a second rank: ``{"endpoint", "body", "status"}``."""
    import aiohttp
    from aiohttp import web
    from aiohttp.test_utils import TestServer
    from safetensors.torch import save_file

    from rollout_fleet.engine.weights import weight_sync_extension

    class Engine:  # the attributes of the built-in engine the extension calls
        model = torch.nn.Linear(2, 2)
        weight_version = "0"

        def __init__(self) -> None:
            self.lora_names: list[str] = []

        def load_weights(self, named: object, version: object = None, timeout: object = None) -> None:
            list(named)  # type: ignore[call-overload]

        def set_weight_version(self, label: str, timeout: object = None) -> None:
            self.weight_version = label

    app = web.Application()
    weight_sync_extension(timeout_s=5.0)(app, type("Server", (), {"engine": Engine()})())
    save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
    p = protocol
    calls = [
        (p.BEGIN, p.begin_body()), (p.BEGIN, p.begin_body()), (p.END, p.end_body()), (p.END, p.end_body()),
        (p.UPDATE_DISTRIBUTED, p.update_distributed_body([TensorMeta("w", torch.float32, (2,))])),
        (p.DESTROY_GROUP, p.destroy_group_body("absent")),
        (p.UPDATE_FROM_DISK, p.update_from_disk_body(str(tmp), "1")),
        (p.UPDATE_FROM_DISK, p.update_from_disk_body(str(tmp / "absent"), "1")),
        (p.LOAD_LORA, p.load_lora_body("a", str(tmp / "no-adapter"))),
        (p.UNLOAD_LORA, p.unload_lora_body("a")),
    ]  # fmt: skip
    out = []
    async with TestServer(app) as server, aiohttp.ClientSession() as session:
        for path, body in calls:
            async with session.post(str(server.make_url(path)), json=body) as resp:
                out.append({"endpoint": path, "body": await resp.json(), "status": resp.status})
    return out


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """All positive and negative cases in one .venv-sglang process (one ~10 s import of sglang)."""
    import asyncio

    mp = pytest.MonkeyPatch()
    try:
        servers = engine_cases(mp, tmp_path_factory.mktemp("secured"))
    finally:
        mp.undo()
    requests = request_cases()
    clients = asyncio.run(client_cases())
    replies = asyncio.run(engine_replies(tmp_path_factory.mktemp("replies")))
    good_init = protocol.init_group_body("127.0.0.1", 29500, 1, 2)
    negative_servers = [
        {"argv": ["--model-path", "/m", "--tp-sizes", "2"], "expect": {}},  # misspelled flag
        {"argv": servers[1]["argv"], "expect": {**servers[1]["expect"], "tp_size": 3}},  # not what was meant
        {"argv": ["--model-path", "/m"], "expect": {"tp_degree": 1}},  # no such field
    ]
    misspelled = {k if k != "rank_offset" else "rank_ofset": v for k, v in good_init.items()}
    negative_requests = [
        {"endpoint": protocol.INIT_GROUP, "body": misspelled},  # unknown and missing
        {"endpoint": protocol.INIT_GROUP, "body": {**good_init, "master_port": "not a port"}},
        {"endpoint": protocol.PAUSE, "body": {"mode": "abort_all"}},
        {"endpoint": protocol.UPDATE_TENSOR, "body": {"serialized_named_tensors": ["not base64!"]}},
        {"endpoint": "/update_weights_from_distributed_v2", "body": {}},  # no such endpoint
        {
            "endpoint": protocol.LOAD_LORA,
            "body": {"lora_name": "x", "lora_path": "/p", "pinned": False, "rank": 8},
        },
    ]
    greedy = SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1)
    sampled = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20, stop_token_ids=(2, 5))
    generate = [
        build_generate_request([1, 2, 3], greedy, 16, "rid-a"),
        build_generate_request([7], sampled, 1, "rid-b"),
        build_group_request([1, 2, 3], sampled, 256, ["g-0", "g-1", "g-2"]),
    ]
    bad = build_generate_request([1, 2, 3], greedy, 16, "rid-c")
    negative_generate = [
        {**bad, "sampling_params": {**bad["sampling_params"], "max_tokens": 16}},  # OpenAI's name: a 400
        {**bad, "sampling_params": {**bad["sampling_params"], "top_k": "20"}},  # a string for an int: a 400
        {**bad, "return_logprobs": True},  # misspelled top-level key: silently ignored by SGLang
    ]
    cases = {
        "generate": generate + negative_generate,
        "server_args": servers + negative_servers,
        "requests": requests + clients + negative_requests,
        "responses": [{"endpoint": r["endpoint"], "body": r["body"]} for r in replies]
        + [{"endpoint": protocol.BEGIN, "body": {"success": True, "mesage": "x"}}],  # misspelled
    }
    result = run_checks(cases)
    result["_cases"] = cases
    result["_replies"] = replies
    result["_counts"] = {
        "servers": len(servers), "requests": len(requests), "clients": len(clients), "generate": len(generate)
    }  # fmt: skip
    return result


def test_the_pinned_sglang_is_the_one_checked(checked: dict) -> None:
    assert checked["version"] == SGLANG_VERSION
    pin = [
        line for line in (ROOT / "pyproject.toml").read_text().splitlines() if line.startswith("sglang = ")
    ]
    assert pin == [f'sglang = ["sglang=={SGLANG_VERSION}"]'], pin


def test_every_launch_command_parses_with_sglangs_server_args(checked: dict) -> None:
    n = checked["_counts"]["servers"]
    problems = {json.dumps(c["argv"]): p for c, p in zip(checked["_cases"]["server_args"][:n], checked["server_args"][:n], strict=True) if p}  # fmt: skip
    assert not problems, problems


def test_a_wrong_launch_command_is_caught(checked: dict) -> None:
    misspelled, not_meant, no_field = checked["server_args"][checked["_counts"]["servers"] :]
    assert misspelled and "--tp-sizes" in misspelled[0], misspelled
    assert not_meant == ["ServerArgs.tp_size = 2, meant 3"], not_meant
    assert no_field == ["ServerArgs has no field 'tp_degree'"], no_field


def test_every_generate_body_passes_sglangs_contract_gate(checked: dict) -> None:
    n = checked["_counts"]["generate"]
    assert checked["generate"][:n] == [[]] * n, checked["generate"][:n]


def test_a_wrong_generate_body_is_caught(checked: dict) -> None:
    unknown_key, wrong_type, misspelled = checked["generate"][checked["_counts"]["generate"] :]
    assert len(unknown_key) == 1 and "unknown field `max_tokens`" in unknown_key[0], unknown_key
    assert len(wrong_type) == 1 and "invalid type" in wrong_type[0], wrong_type
    assert misspelled == [
        "/generate: 'return_logprobs' is no field of SGLang's GenerateRequest (ignored by it)"
    ]


def test_every_control_body_is_a_valid_sglang_request(checked: dict) -> None:
    n = checked["_counts"]["requests"] + checked["_counts"]["clients"]
    cases, results = checked["_cases"]["requests"][:n], checked["requests"][:n]
    problems = {
        f"{c['endpoint']} {json.dumps(c['body'])[:200]}": p for c, p in zip(cases, results, strict=True) if p
    }
    assert not problems, problems
    # Every SGLang endpoint streamrl names was checked, and each maps to its own struct in SGLang's server.
    sent = {c["endpoint"] for c in cases}
    named = {v for k, v in vars(protocol).items() if k.isupper() and isinstance(v, str) and v.startswith("/")}
    own = {
        protocol.LOAD_LORA_DISTRIBUTED
    }  # streamrl's own endpoint; SGLang answers 404 (docs/weight_sync.md)
    bodiless = {protocol.MODEL_INFO}  # a GET
    assert named - own - bodiless <= sent, sorted(named - own - bodiless - sent)
    assert protocol.LOAD_LORA_DISTRIBUTED not in checked["routes"]


def test_a_wrong_control_body_is_caught(checked: dict) -> None:
    n = checked["_counts"]["requests"] + checked["_counts"]["clients"]
    misspelled, bad_port, bad_mode, bad_payload, no_endpoint, extra = checked["requests"][n:]
    assert any("'rank_ofset' is no field" in p for p in misspelled), misspelled
    assert any("rank_offset" in p and "Field required" in p for p in misspelled), misspelled
    assert len(bad_port) == 1 and "master_port" in bad_port[0], bad_port
    assert len(bad_mode) == 1 and "mode" in bad_mode[0], bad_mode
    assert len(bad_payload) == 1 and "base64" in bad_payload[0], bad_payload
    assert no_endpoint and "no such POST endpoint" in no_endpoint[0], no_endpoint
    assert extra == [
        "/load_lora_adapter: 'rank' is no field of SGLang's LoadLoRAAdapterReqInput (ignored by it)"
    ]


def test_the_built_in_engines_replies_decode_as_sglangs_reply_structs(checked: dict) -> None:
    replies = checked["_replies"]
    # Both outcomes were reached: a reply of each kind is checked, not only failures.
    assert {(r["endpoint"], r["status"]) for r in replies} >= {
        (protocol.BEGIN, 200), (protocol.BEGIN, 400), (protocol.UPDATE_FROM_DISK, 200),
        (protocol.UPDATE_FROM_DISK, 400), (protocol.LOAD_LORA, 400), (protocol.DESTROY_GROUP, 400),
    }, replies  # fmt: skip
    problems = {
        f"{r['endpoint']} {r['status']} {json.dumps(r['body'])}": p
        for r, p in zip(replies, checked["responses"], strict=False)
        if p
    }
    assert not problems, problems


def test_a_wrong_reply_is_caught(checked: dict) -> None:
    misspelled = checked["responses"][-1]
    assert any("'mesage' is no field" in p for p in misspelled), misspelled
    assert any("requires 'message'" in p for p in misspelled), misspelled


# ------------------------------------------------------------------------------------------ the router


def _router_args(argv: list[str]) -> object:
    from sglang_router.launch_router import parse_router_args

    assert argv[1:3] == ["-m", "sglang_router.launch_router"], argv
    return parse_router_args(argv[3:])


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin", "power_of_two", "random"])
def test_the_router_command_parses_with_sglang_routers_own_parser(policy: str) -> None:
    urls = ["http://127.0.0.1:30000", "http://127.0.0.1:30001"]
    argv = router_command(urls, 31000, host="127.0.0.2", policy=policy, health_check_interval_s=3,
                          request_timeout_s=90.5, prometheus_port=29123, extra_args=["--max-payload-size", "1024"],
                          api_key="run-secret")  # fmt: skip
    args = _router_args(argv)
    meant = {
        "worker_urls": urls, "host": "127.0.0.2", "port": 31000, "policy": policy,
        "health_check_endpoint": "/model_info", "health_check_interval_secs": 3, "request_timeout_secs": 90,
        "log_level": "warn", "prometheus_host": "127.0.0.2", "prometheus_port": 29123, "max_payload_size": 1024,
        "api_key": "run-secret",  # sent to the engines, which require the run secret
    }  # fmt: skip
    assert {k: getattr(args, k) for k in meant} == meant
    args._validate_router_args()  # type: ignore[attr-defined]


def test_a_wrong_router_command_is_caught() -> None:
    argv = router_command(["http://127.0.0.1:30000"], 31000, prometheus_port=29123)
    with pytest.raises(SystemExit):
        _router_args([*argv, "--health-check-endpoints", "/health"])  # misspelled
    with pytest.raises(SystemExit):
        _router_args([*argv, "--policy", "least_loaded"])  # no such policy
    # A flag the router knows under another meaning parses, and the field comparison sees the difference.
    args = _router_args([*argv, "--health-check-endpoint", "/health"])
    assert args.health_check_endpoint == "/health" != "/model_info"
