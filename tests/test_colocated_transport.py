"""Colocated weight sync and sleep / wake, all real: built-in engine processes (`python -m streamrl engine`) and the
learner's publisher (`WeightSender` with `transport = "tensor"`) in this process, which is unrelated to them (no
multiprocessing parentage, so no shared authkey: the file_system handles must work on their own).

- An update by handle (`/update_weights_from_tensor`) makes the engine's weights equal the learner's bit for bit,
  in both payload shapes (flattened_bucket and per tensor); no /dev/shm file is left, and the engine no longer
  maps any; the engine sleeps (`/release_memory_occupation`), refuses to generate, wakes and is updated again.
- A bad payload is refused with an error naming the field, and the engine keeps its weights and version.
- The KV pool's memory really goes: the engine's resident size (/proc/PID/status) falls by at least the pool's
  size while released and comes back after the resume; release is refused while a request runs; a request made
  while paused and released waits at the pause gate, and is refused with the reason once generation continues.
- An engine SIGKILLed while it holds a bucket's mapping is quarantined, the other engine gets the whole model, and
  nothing is left in /dev/shm.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from broker.server import free_port
from tests.test_engine_weight_sync import wait_ready
from tests.test_weight_sync_e2e import _train_step
from weight_sync import protocol
from weight_sync.buckets import TensorMeta, flatten_into
from weight_sync.config import WeightSyncConfig
from weight_sync.receiver import weights_checksum
from weight_sync.sender import WeightSender, sync_weights
from weight_sync.tensor_transport import SharedBuffers, bucket_payload, deserialize, leaked_files, serialize

pytestmark = pytest.mark.timeout(120)
TIMEOUT_S = 20.0
KV_TOKENS = 12288  # 768 blocks of 16 tokens, 4 KiB a token: a 48 MiB pool
REPO = Path(__file__).resolve().parents[1]

# Runs the real engine (`streamrl engine ...`), which SIGKILLs itself right after it has mapped the payload of
# its KILL_AT-th update by handle: it dies holding the sender's shared memory.
KILLER = """
import os, runpy, signal, sys
from weight_sync import receiver
unpack, calls = receiver.unpack, []
def dying_unpack(*args, **kwargs):
    named = unpack(*args, **kwargs)
    calls.append(1)
    if len(calls) == int(os.environ["KILL_AT"]):
        os.kill(os.getpid(), signal.SIGKILL)
    return named
receiver.unpack = dying_unpack
sys.argv = ["streamrl", *sys.argv[1:]]
runpy.run_module("streamrl", run_name="__main__")
"""


def call(url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """(status, parsed JSON) of a GET (no body) or POST, error statuses included."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    return status, json.loads(raw) if raw else None


def launch(model_dir: Path, port: int, kill_at: int | None = None) -> subprocess.Popen:
    """An engine process; its run directory (resolved config) beside the model, in the module's tmp dir."""
    flags = ["engine", f"--shared.model_path={model_dir}", "--shared.torch_threads=1", f"--engine.port={port}",
             f"--engine.control_timeout_s={TIMEOUT_S}", f"--engine.max_total_tokens={KV_TOKENS}",
             f"--shared.run_dir={model_dir.parent / 'run'}"]  # fmt: skip
    if kill_at is None:
        cmd = [sys.executable, "-m", "streamrl", *flags]
    else:
        cmd = [sys.executable, "-c", KILLER, *flags]
    env = {**os.environ, "KILL_AT": str(kill_at or 0)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class Engine:
    def __init__(self, model_dir: Path, kill_at: int | None = None) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = launch(model_dir, port, kill_at)

    def checksum(self) -> str:
        return call(self.url + "/weights_checker", {"action": "checksum"})[1]["checksum"]

    def version(self) -> str:
        return call(self.url + "/model_info")[1]["weight_version"]

    def info(self) -> dict:
        return call(self.url + "/server_info")[1]

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

    def maps_shared_memory(self) -> bool:
        with open(f"/proc/{self.proc.pid}/maps") as maps:
            return any("/dev/shm/torch_" in line for line in maps)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollout_fleet.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("colocated") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    served = Engine(model_dir)
    try:  # an engine that never answers still leaves no process behind
        wait_ready(served.url, served.proc)
        yield served
    finally:
        served.stop()


def learner(model_dir: Path, seed: int) -> torch.nn.Module:
    """The learner's model after a training step: weights no engine serves yet."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), seed=seed)
    return model


def truth(model: torch.nn.Module) -> str:
    return weights_checksum([(n, p.detach()) for n, p in model.named_parameters()])


def config(**fields: Any) -> WeightSyncConfig:
    return WeightSyncConfig(
        transport="tensor", bucket_mb=0.25, timeout_s=TIMEOUT_S, pause_mode="abort", **fields
    )


def generate(url: str, ids: list[int], new: int = 8, timeout: float = 60.0) -> tuple[int, Any]:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True},
    }
    return call(url + "/generate", body, timeout)


# ------------------------------------------------------------------------------------- transport alone


RECEIVER = """
import os, signal, sys
from weight_sync.tensor_transport import unpack
for line in sys.stdin:
    fmt, payload = line.split()
    try:
        named = unpack([payload], None if fmt == "null" else fmt)
        print("ok", sum(float(t.double().sum()) for _, t in named), flush=True)
    except ValueError as exc:
        print("refused", exc, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies still mapping the last payload
"""


def test_cpu_handles_reach_an_unrelated_process_and_leave_nothing_in_dev_shm() -> None:
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.int64)
    metas = [TensorMeta.of("a", a), TensorMeta.of("b", b)]
    want = float(a.double().sum() + b.double().sum())
    shared = SharedBuffers()
    flat = flatten_into([a, b], shared.empty(sum(m.nbytes for m in metas), torch.device("cpu")))
    assert mp.get_sharing_strategy() == "file_descriptor"  # the default, untouched by serialize
    default = io.BytesIO()
    ForkingPickler(default).dump([("a", torch.ones(2).share_memory_())])  # torch's default: a descriptor
    lines = [
        f"flattened_bucket {serialize(bucket_payload(flat, metas, flattened=True))}",
        f"null {serialize(bucket_payload(flat, metas, flattened=False))}",
        f"null {base64.b64encode(default.getvalue()).decode()}",
        f"null {serialize(bucket_payload(flat, metas, flattened=False))}",
    ]
    proc = subprocess.run([sys.executable, "-c", RECEIVER], input="\n".join(lines) + "\n", capture_output=True,
                          text=True, cwd=REPO, timeout=60)  # fmt: skip
    out = proc.stdout.splitlines()
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [line.split()[0] for line in out] == ["ok", "ok", "refused", "ok"], out
    assert all(abs(float(line.split()[1]) - want) < 1e-9 for line in out if line.startswith("ok"))
    assert "file descriptor" in out[2] and "unrelated process" in out[2]
    # The receiver died holding its mapping (its reference is never given back): the name is still there ...
    assert leaked_files() == [n.lstrip("/") for n in shared.names] and len(shared.names) == 1
    shared.close()  # ... until the sender, once every receiver answered or died, unlinks it
    del flat
    assert leaked_files() == []


class Exec:
    """Unpickling this runs a shell command: a payload must never be able to."""

    def __reduce__(self) -> tuple:
        return (os.system, ("true",))


def test_a_payload_cannot_name_anything_but_tensors() -> None:
    with pytest.raises(ValueError, match=r"system is not allowed in a tensor payload"):
        deserialize(base64.b64encode(pickle.dumps([("x", Exec())])).decode())
    with pytest.raises(ValueError, match="not base64"):
        deserialize("%%%")


# ----------------------------------------------------------------------------------- a real engine


def test_update_by_handle_is_bitwise_in_both_shapes_and_survives_sleep(
    awake: Engine, model_dir: Path
) -> None:
    engine = awake
    model = learner(model_dir, seed=0)
    before = engine.checksum()
    sender = WeightSender([engine.url], config(load_format="flattened_bucket"))
    assert sender.connect() == {} and sender.group is None  # no process group between learner and engine
    first = sync_weights(model, 1, sender)
    assert first is not None and first.engines_ok == [engine.url] and first.attempts == 1
    assert first.buckets > 1 and first.bytes == sum(p.nbytes for p in model.parameters())
    assert engine.checksum() == truth(model) != before and engine.version() == "1"
    assert leaked_files() == [] and not engine.maps_shared_memory()

    # sleep: paused, KV and weights released; generation refused once continued; wake, then sync by tensor
    assert sender.sleep(tags=None) == {}
    assert engine.info()["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    status, body = call(engine.url + "/weights_checker", {"action": "checksum"})
    assert status == 400 and "released" in body["message"]
    assert sender.wake() == {} and engine.info()["memory_released"] == []
    _train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), seed=1)
    sender.config = config(load_format="per_tensor")
    second = sync_weights(model, 2, sender)
    assert second is not None and second.engines_ok == [engine.url] and second.engines_failed == {}
    assert engine.checksum() == truth(model) and engine.version() == "2"
    assert leaked_files() == [] and not engine.maps_shared_memory()
    status, answer = generate(engine.url, [5, 6, 7])
    assert status == 200 and answer["meta_info"]["weight_version"] == "2"
    sender.close()


def test_a_bad_payload_is_refused_and_changes_nothing(engine: Engine, model_dir: Path) -> None:
    checksum, version = engine.checksum(), engine.version()
    url = engine.url + protocol.UPDATE_TENSOR
    model = learner(model_dir, seed=5)
    name, real = "model.norm.weight", model.model.norm.weight.detach()
    shared = SharedBuffers()
    flat = flatten_into([real], shared.empty(real.nbytes, torch.device("cpu")))
    good = TensorMeta.of(name, real)
    metadata = bucket_payload(flat, [good], flattened=True)
    metadata["metadata"][0].end_idx -= 4
    evil = base64.b64encode(pickle.dumps([(name, Exec())])).decode()

    def body(payload: Any, **fields: Any) -> dict:
        encoded = payload if isinstance(payload, str) else serialize(payload)
        return {"serialized_named_tensors": [encoded], "weight_version": "99", **fields}

    status, reply = call(url, body([(name, flat.view(real.dtype))]))
    assert status == 400 and reply["message"] == protocol.MSG_TENSOR_SESSION_REQUIRED  # outside a session
    assert call(engine.url + protocol.BEGIN, {})[0] == 200
    cases = {
        "'serialized_named_tensors' is required": {},
        "'serialized_named_tensors' = 'x' has the wrong type": {"serialized_named_tensors": "x"},
        "'load_format' = 'my.loader'": body("eA==", load_format="my.loader"),
        "'weight_version' = 3 must be a str": body("eA==", weight_version=3),
        "serialized_named_tensors[0]: not base64": body("%%%"),
        "serialized_named_tensors[0]: posix.system is not allowed": body(evil),
        "unknown parameter name 'model.nope'": body([("model.nope", flat.view(real.dtype))]),
        "shape [32, 4] != expected [128]": body([(name, flat.view(real.dtype).view(32, 4))]),
        "metadata[0] (model.norm.weight): start_idx, end_idx, numel = 0, 508, 128": body(
            metadata, load_format="flattened_bucket"
        ),
        "flattened_tensor: expected a 1-D uint8 tensor": body(
            {"flattened_tensor": flat.view(real.dtype), "metadata": metadata["metadata"]},
            load_format="flattened_bucket",
        ),
    }
    for expected, request in cases.items():
        status, reply = call(url, request)
        assert status == 400 and expected in reply["message"], (expected, reply)
        assert not engine.maps_shared_memory(), expected  # a refused payload is not kept mapped either
    assert call(engine.url + protocol.END, {})[0] == 200
    shared.close()
    del flat
    assert engine.checksum() == checksum and engine.version() == version
    assert leaked_files() == [] and not engine.maps_shared_memory()


def fill_kv_pool(url: str) -> dict:
    """Twelve distinct 960-token prompts decoding 64 tokens together hold all 768 blocks at once, so every page
    of the pool has been written (blocks are zeroed when first handed out, lowest ids first)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 90, (960,), generator=gen).tolist() for _ in range(12)]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True}}
    status, answers = call(url + "/generate", body, timeout=90)
    assert status == 200 and len(answers) == 12
    return call(url + "/v1/loads")[1]["loads"][0]


@pytest.fixture
def awake(engine: Engine):
    """The module's engine, left resumed and generating whatever the test did to it."""
    yield engine
    call(engine.url + protocol.RESUME_MEMORY, {"tags": None})
    call(engine.url + protocol.CONTINUE, {})


def test_release_frees_the_kv_pool_and_resume_brings_it_back(awake: Engine, model_dir: Path) -> None:
    engine = awake
    model = learner(model_dir, seed=6)
    sender = WeightSender([engine.url], config())
    assert sync_weights(model, 6, sender).engines_ok == [engine.url]
    probe = [5, 6, 7, 8, 9]
    greedy = generate(engine.url, probe)[1]["output_ids"]
    loads = fill_kv_pool(engine.url)
    assert loads["kv_blocks_peak"] == loads["kv_blocks_total"] == KV_TOKENS // 16
    pool = engine.info()["kv_pool_bytes"]
    assert pool == (KV_TOKENS + 16) * 4096  # + the null block
    full = engine.rss()

    # refused while a request runs (SGLang asserts an idle server)
    answer: dict = {}
    long = threading.Thread(target=lambda: answer.update(r=generate(engine.url, probe, new=3000, timeout=90)))
    long.start()
    deadline = time.monotonic() + 30
    while call(engine.url + "/v1/loads")[1]["loads"][0]["num_running_reqs"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, body = call(engine.url + protocol.RELEASE_MEMORY, {"tags": ["kv_cache"]})
    assert status == 400 and "no ongoing request" in body["error"]["message"]
    assert (
        call(engine.url + protocol.PAUSE, {"mode": "abort"})[0] == 200
    )  # the long request is answered, aborted
    long.join(30)
    assert answer["r"][1]["meta_info"]["finish_reason"]["type"] == "abort"

    status, body = call(engine.url + protocol.RELEASE_MEMORY, {"tags": ["kv_cache"]})
    assert (status, body) == (200, None)
    released = engine.rss()
    assert full - released >= pool, (full, released, pool)
    weights = engine.info()["weights_bytes"]
    assert call(engine.url + protocol.RELEASE_MEMORY, {"tags": ["weights"]}) == (200, None)
    without_weights = engine.rss()
    # Most of the weights' storage is small heap blocks (handed back by malloc_trim) and pages of the mapped
    # safetensors file: the fall is measured 1.0 to 1.6 times their size here, bounded loosely.
    assert released - without_weights >= weights / 2, (released, without_weights, weights)
    assert engine.info()["memory_released"] == ["kv_cache", "weights"]
    status, body = call(engine.url + protocol.RELEASE_MEMORY, {"tags": ["kv"]})
    assert status == 400 and "tags" in body["message"]

    # while paused a request waits at the pause gate (as on SGLang); once generation continues it is refused
    waiting: dict = {}
    gated = threading.Thread(target=lambda: waiting.update(r=generate(engine.url, probe)))
    gated.start()
    gated.join(1.0)
    assert gated.is_alive()
    assert call(engine.url + protocol.CONTINUE, {})[0] == 200
    gated.join(30)
    status, body = waiting["r"]
    assert status == 503 and "memory is released (kv_cache, weights)" in body["error"]["message"]

    # wake: resume everything, update the weights by handle (the sync pauses, updates, continues)
    assert call(engine.url + protocol.RESUME_MEMORY, {"tags": None}) == (200, None)
    assert engine.info()["memory_released"] == []
    result = sync_weights(model, 7, sender)
    sender.close()
    assert result is not None and result.engines_ok == [engine.url]
    assert engine.checksum() == truth(model)
    assert generate(engine.url, probe)[1]["output_ids"] == greedy  # the same weights give the same tokens
    fill_kv_pool(engine.url)
    back = engine.rss()
    print(f"\nRSS MiB: full {full / 2**20:.1f}, kv released {released / 2**20:.1f}, weights too "
          f"{without_weights / 2**20:.1f}, refilled after resume {back / 2**20:.1f}; pool {pool / 2**20:.1f}")  # fmt: skip
    assert back - released >= pool * 0.95


def test_engine_killed_holding_a_bucket_is_quarantined_and_leaves_no_shm(
    engine: Engine, model_dir: Path
) -> None:
    dying = Engine(model_dir, kill_at=3)
    try:
        wait_ready(dying.url, dying.proc)
        model = learner(model_dir, seed=11)
        sender = WeightSender([engine.url, dying.url], config(load_format="flattened_bucket"))
        assert sender.connect() == {}
        result = sync_weights(model, 11, sender)
        assert dying.proc.wait(timeout=10) == -signal.SIGKILL  # it died in the middle of the sync
        assert result is not None and result.engines_ok == [engine.url]
        assert list(result.engines_failed) == [dying.url]
        assert result.engines_failed[dying.url].startswith("transport:")
        assert list(sender.quarantined) == [dying.url]
        assert result.attempts == 2  # the survivor got the whole model again, alone
        assert result.seconds < 2 * TIMEOUT_S
        assert engine.checksum() == truth(model) and engine.version() == "11"
        assert leaked_files() == []  # the buffers the dead engine held are unlinked too
        sender.close()
    finally:
        dying.stop()


@pytest.mark.gpu
def test_cuda_ipc_update_reaches_an_engine_on_the_gpu(model_dir: Path) -> None:
    """On one GPU: the engine on CUDA, the learner's model on the same CUDA device, buckets by CUDA IPC handle."""
    port = free_port()
    flags = ["engine", f"--shared.model_path={model_dir}", f"--engine.port={port}", "--engine.device=cuda",
             "--engine.dtype=float32", f"--engine.control_timeout_s={TIMEOUT_S}",
             f"--shared.run_dir={model_dir.parent / 'run'}"]  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", *flags], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        model = learner(model_dir, seed=3).to("cuda")
        sender = WeightSender([url], config())
        result = sync_weights(model, 1, sender)
        assert result is not None and result.engines_ok == [url], result
        assert call(url + "/weights_checker", {"action": "checksum"})[1]["checksum"] == truth(model)
        assert sender.sleep(tags=None) == {} and sender.wake() == {}
        result = sync_weights(model, 2, sender)
        assert result is not None and result.engines_ok == [url]
        assert call(url + "/weights_checker", {"action": "checksum"})[1]["checksum"] == truth(model)
        sender.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)
