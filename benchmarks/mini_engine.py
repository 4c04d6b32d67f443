"""A minimal receiving engine: a Hugging Face causal LM behind SGLang's weight-update endpoints. No generation.

It is the reference receiver the weight-sync tests and benchmark run against until (and besides) the built-in
engine: a real aiohttp server in its own process, a real ``WeightReceiver`` in a real process group, a real
model whose parameters are overwritten by name. It also mimics an SGLang 0.5.10 server (``--no-sessions``: no
``/begin_weight_update``, 404) and can SIGKILL itself on the N-th update (``--kill-at-update N``), a fault that
cannot be timed from outside.

    python -m benchmarks.mini_engine --model-dir DIR --port 0 [--no-sessions] [--kill-at-update N]

Besides the weight endpoints: ``/pause_generation``, ``/continue_generation`` (state only), ``/model_info``,
``/health``, ``/get_weights_by_name``, ``/update_weights_from_disk``, ``/weights_checker`` (``{"action":
"checksum"}``), ``/score`` (log-probs of ``input_ids`` under the served weights) and ``/stats``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from aiohttp import web

from common.versioning import INITIAL_LABEL
from weight_sync import protocol
from weight_sync.engine_routes import read_json, reply, validation_error, weight_routes
from weight_sync.receiver import (
    WeightReceiver,
    copy_into,
    model_destination,
    weights_by_name,
    weights_checksum,
)


def load_model(
    model_dir: str | None, model_config: str | None, device: str = "cpu", dtype: str = "float32"
) -> torch.nn.Module:
    """From an HF directory, or (benchmarks) a Qwen2 of the given config with uninitialised weights, on
    ``device`` in ``dtype``."""
    torch_dtype = getattr(torch, dtype)
    if model_dir:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**json.loads(model_config or "{}"))
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device=device).to(torch_dtype)
    model.tie_weights()  # to_empty gives tied parameters separate storage: tie them again (tied configs)
    return model.eval()


def load_safetensors_dir(model: torch.nn.Module, path: str) -> int:
    """``/update_weights_from_disk``: copy every tensor of the directory's safetensors files, by name."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    named = [item for f in files for item in load_file(str(f)).items()]
    copy_into(model)(named)
    return len(named)


class MiniEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.model = load_model(args.model_dir, args.model_config, args.device, args.dtype)
        self.model_path = args.model_dir or "<in-memory>"
        self.receiver = WeightReceiver(
            copy_into(self.model),
            timeout_s=args.timeout_s,
            require_session=not args.no_sessions,
            destination=None if args.no_direct else model_destination(self.model),
            device=args.device,
        )
        self.receiver.weight_version = INITIAL_LABEL
        self.paused: str | None = None
        self.calls: dict[str, int] = {}
        self.update_requests = 0
        self._bench_buffer: torch.Tensor | None = None

    @web.middleware
    async def count_calls(self, request: web.Request, handler):  # noqa: ANN001 - aiohttp middleware
        self.calls[request.path] = self.calls.get(request.path, 0) + 1
        if request.path == protocol.UPDATE_DISTRIBUTED:
            self.update_requests += 1
            if self.update_requests == self.args.kill_at_update:
                os.kill(os.getpid(), signal.SIGKILL)  # a real crash in the middle of a sync
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.count_calls], client_max_size=64 * 2**20)
        app.add_routes(weight_routes(self.receiver, sessions=not self.args.no_sessions))
        app.add_routes(
            [
                web.post(protocol.PAUSE, self.pause),
                web.post(protocol.CONTINUE, self.resume),
                web.get(protocol.MODEL_INFO, self.model_info),
                web.get("/health", self.health),
                web.route("*", protocol.GET_WEIGHTS_BY_NAME, self.get_weights),
                web.post(protocol.UPDATE_FROM_DISK, self.update_from_disk),
                web.route("*", "/weights_checker", self.checksum),
                web.post("/score", self.score),
                web.get("/stats", self.stats),
                web.post("/bench_receive", self.bench_receive),
            ]
        )
        return app

    async def pause(self, request: web.Request) -> web.Response:
        try:
            self.paused = protocol.parse_pause_mode(await read_json(request))
        except ValueError as exc:
            return validation_error(str(exc))
        return web.json_response({"message": protocol.MSG_PAUSED, "status": "ok"})

    async def resume(self, request: web.Request) -> web.Response:
        self.paused = None
        return web.json_response({"message": protocol.MSG_CONTINUED, "status": "ok"})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "model_path": self.model_path,
                "served_model_name": self.model_path,
                "is_generation": True,
                "weight_version": self.receiver.weight_version,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def get_weights(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            values = weights_by_name(self.model, body["name"], int(body.get("truncate_size", 100)))
        except (ValueError, KeyError):
            return web.json_response({"error": {"message": "Get parameter by name failed"}}, status=400)
        return web.json_response(values)

    async def update_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await read_json(request)
            path = body["model_path"]
        except (ValueError, KeyError) as exc:
            return validation_error(f"model_path: {exc}")
        try:
            await asyncio.to_thread(load_safetensors_dir, self.model, path)
        except Exception as exc:
            return reply(False, f"Failed to update weights: {exc}")
        self.model_path = path
        self.receiver.mark_consistent(body.get("weight_version"))
        status, payload = protocol.reply_body(
            True, "Succeeded to update model weights.", num_paused_requests=0
        )
        return web.json_response(payload, status=status)

    async def checksum(self, request: web.Request) -> web.Response:
        digest = await asyncio.to_thread(weights_checksum, list(self.model.named_parameters()))
        return web.json_response({"success": True, "message": "Success.", "checksum": digest})

    async def score(self, request: web.Request) -> web.Response:
        """Log-prob of each token of ``input_ids`` after the first, under the served weights."""
        try:
            ids = torch.tensor([list((await read_json(request))["input_ids"])], dtype=torch.long)
        except (ValueError, KeyError, TypeError) as exc:
            return validation_error(f"input_ids: {exc}")

        def forward() -> list[float]:
            with torch.no_grad():
                logits = self.model(input_ids=ids).logits.float()
            logp = torch.log_softmax(logits[0, :-1], dim=-1)
            return logp.gather(-1, ids[0, 1:, None])[:, 0].tolist()

        return web.json_response({"logprobs": await asyncio.to_thread(forward)})

    async def bench_receive(self, request: web.Request) -> web.Response:
        """Benchmarks only: receive one 1-element broadcast (the start line), then ``nbytes`` of uint8 into a
        buffer kept (and already touched) across calls, with no loading: the transport's limit for the same
        bytes. One broadcast, or with ``chunk`` one per chunk, all posted at once."""
        try:
            body = await read_json(request)
            nbytes = int(body["nbytes"])
            chunk = int(body.get("chunk") or nbytes)
            group = self.receiver.groups[body.get("group_name", protocol.DEFAULT_GROUP)]
        except (ValueError, KeyError, TypeError) as exc:
            return validation_error(f"bench_receive: {exc!r}")

        def run() -> None:
            with self.receiver.exclusive():
                if self._bench_buffer is None or self._bench_buffer.numel() != nbytes:
                    self._bench_buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.args.device)
                group.broadcast(torch.empty(1, device=self.args.device))
                chunks = self._bench_buffer.split(chunk)
                for work in [group.broadcast(c, async_op=True) for c in chunks]:
                    work.wait()

        try:
            await asyncio.to_thread(run)
        except Exception as exc:
            return reply(False, f"bench_receive failed: {exc}")
        return reply(True, "received")

    async def stats(self, request: web.Request) -> web.Response:
        r = self.receiver
        return web.json_response(
            {
                **asdict(r.stats),
                "session_open": r.session_open,
                "consistent": r.consistent,
                "weight_version": r.weight_version,
                "paused": self.paused,
                "calls": self.calls,
                "groups": list(r.groups),
            }
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="Hugging Face model directory to serve")
    p.add_argument("--model-config", help="JSON kwargs of a Qwen2Config (uninitialised weights, benchmarks)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed as 'PORT <n>')")
    p.add_argument("--timeout-s", type=float, default=60.0, help="group join / receive timeout")
    p.add_argument("--no-sessions", action="store_true", help="behave like SGLang 0.5.10: no begin/end")
    p.add_argument("--kill-at-update", type=int, default=0, help="SIGKILL itself on the N-th update call")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--no-direct", action="store_true", help="per-tensor updates go through load_weights too")
    p.add_argument("--device", default="cpu", help="torch device of the model and the receive buffers")
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype"
    )
    args = p.parse_args(argv)
    if not (args.model_dir or args.model_config):
        p.error("one of --model-dir or --model-config is required")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = MiniEngine(args)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    web.run_app(engine.app(), sock=sock, print=None, handle_signals=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
