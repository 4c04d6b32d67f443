"""SGLang 0.5.x weight-update protocol: request bodies, their parsing on the engine side, and reply parsing.

Pure data, no HTTP (engine_http.py sends, the engine's handlers receive). Field names, defaults and messages follow
SGLang 0.5.23 (``managers/io_struct.py``, ``scheduler_components/weight_updater.py``); see
docs/sglang_api.md sections 3 and 4 and docs/weight_sync.md.

Order per update: pause_generation -> begin_weight_update (absent, 404, before 0.5.23) ->
update_weights_from_distributed (or, colocated, update_weights_from_tensor) per bucket -> end_weight_update ->
continue_generation. Colocated engines also sleep and wake: release_memory_occupation /
resume_memory_occupation with tags (section 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # imported where used: a client that only sends control requests never loads torch
    from weight_sync.buckets import TensorMeta
    from weight_sync.lora import LoraSpec

INIT_GROUP = "/init_weights_update_group"
UPDATE_DISTRIBUTED = "/update_weights_from_distributed"
UPDATE_TENSOR = "/update_weights_from_tensor"
RELEASE_MEMORY = "/release_memory_occupation"
RESUME_MEMORY = "/resume_memory_occupation"
BEGIN = "/begin_weight_update"
END = "/end_weight_update"
PAUSE = "/pause_generation"
CONTINUE = "/continue_generation"
DESTROY_GROUP = "/destroy_weights_update_group"
UPDATE_FROM_DISK = "/update_weights_from_disk"
GET_WEIGHTS_BY_NAME = "/get_weights_by_name"
MODEL_INFO = "/model_info"
UPDATE_WEIGHT_VERSION = "/update_weight_version"
ABORT_REQUEST = "/abort_request"
# SGLang's LoRA endpoints (0.5.x): an adapter by path on the engine's filesystem, and its removal.
LOAD_LORA = "/load_lora_adapter"
UNLOAD_LORA = "/unload_lora_adapter"
# streamrl's own: an adapter broadcast over the update group, as update_weights_from_distributed does for full
# weights. SGLang has no such endpoint (it answers 404 before posting a receive, so the sender never hangs).
LOAD_LORA_DISTRIBUTED = "/load_lora_adapter_from_distributed"

DEFAULT_GROUP = "weight_update_group"
PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_FORMATS = (None, "flattened_bucket")
# update_weights_from_tensor: "direct" loads by name like null; SGLang's custom loader import paths are refused.
TENSOR_LOAD_FORMATS = (None, "direct", "flattened_bucket")
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")

# Reply messages, verbatim from SGLang 0.5.23.
MSG_INIT_OK = "Succeeded to initialize custom process group."
MSG_UPDATE_OK = "Succeeded to update parameter online."
MSG_SESSION_REQUIRED = (
    "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
)
# By analogy with the line above (section 3.3 quotes only the distributed one).
MSG_TENSOR_SESSION_REQUIRED = (
    "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
)
MSG_BEGIN_TWICE = "a weight-update session is already open; call end_weight_update() first"
MSG_END_WITHOUT_BEGIN = "no weight-update session is open; call begin_weight_update() first"
MSG_SESSION_OK = "Success"
MSG_DESTROY_OK = "Succeeded to destroy custom process group."
MSG_DESTROY_MISSING = "The group to be destroyed does not exist."
MSG_PAUSED = "Generation paused successfully."
MSG_CONTINUED = "Generation continued successfully."


def version_suffix(weight_version: str | None) -> str:
    """Appended to a successful update's message when a weight_version was sent."""
    return f" Weight version updated to {weight_version}." if weight_version is not None else ""


# ---------------------------------------------------------------------------------------------- builders


def init_group_body(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP,
    backend: str = "nccl",
) -> dict[str, Any]:
    """``/init_weights_update_group``: engine rank r joins as ``rank_offset + tp_rank``."""
    if not group_name:
        raise ValueError("group_name must be non-empty")
    if rank_offset < 1 or world_size <= rank_offset:
        raise ValueError(f"rank_offset = {rank_offset} must be in [1, world_size = {world_size})")
    return {
        "master_address": master_address,
        "master_port": int(master_port),
        "rank_offset": int(rank_offset),
        "world_size": int(world_size),
        "group_name": group_name,
        "backend": backend,
    }


def update_distributed_body(
    metas: list[TensorMeta],
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    weight_version: str | None = None,
    load_format: str | None = None,
    abort_all_requests: bool = False,
) -> dict[str, Any]:
    """``/update_weights_from_distributed`` for one bucket: HF names, dtypes without ``torch.``, full shapes."""
    if not metas:
        raise ValueError("an update needs at least one tensor")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format = {load_format!r}: expected one of {LOAD_FORMATS}")
    from weight_sync.buckets import dtype_name

    return {
        "names": [m.name for m in metas],
        "dtypes": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "group_name": group_name,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
        "weight_version": weight_version,
        "load_format": load_format,
    }


def update_tensor_body(
    serialized_named_tensors: list[str],
    flush_cache: bool = True,
    weight_version: str | None = None,
    load_format: str | None = None,
    abort_all_requests: bool = False,
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` for one bucket: one serialized payload per TP rank of the engine
    (``weight_sync.tensor_transport.serialize``), rank r reading element r."""
    if not serialized_named_tensors:
        raise ValueError("serialized_named_tensors needs one entry per TP rank")
    if load_format not in TENSOR_LOAD_FORMATS:
        raise ValueError(f"load_format = {load_format!r}: expected one of {TENSOR_LOAD_FORMATS}")
    return {
        "serialized_named_tensors": list(serialized_named_tensors),
        "load_format": load_format,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
        "weight_version": weight_version,
    }


def memory_body(tags: list[str] | None = None) -> dict[str, Any]:
    """``/release_memory_occupation`` and ``/resume_memory_occupation``: ``tags`` None (or empty) means all."""
    if tags is None:
        return {"tags": None}
    parse_memory_tags({"tags": list(tags)}, RELEASE_MEMORY)  # refuse a typo here, not on the engine
    return {"tags": list(tags)}


def lora_distributed_body(
    metas: list[TensorMeta],
    lora_name: str,
    spec: LoraSpec,
    group_name: str = DEFAULT_GROUP,
    flush_cache: bool = True,
    weight_version: str | None = None,
    load_format: str | None = None,
) -> dict[str, Any]:
    """``/load_lora_adapter_from_distributed`` for one bucket of adapter tensors (``M.lora_A.weight``,
    ``M.lora_B.weight``): the fields of ``update_weights_from_distributed`` plus SGLang's LoRA fields
    ``lora_name`` and ``config_dict`` (PEFT's adapter config, with the exact ``scaling``)."""
    body = update_distributed_body(metas, group_name, flush_cache, weight_version, load_format)
    if not lora_name:
        raise ValueError("lora_name must be non-empty")
    return {**body, "lora_name": lora_name, "config_dict": spec.config_dict()}


def load_lora_body(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    """SGLang's ``/load_lora_adapter``: a PEFT adapter directory the engine can read, under ``lora_name``
    (requests then select it with ``lora_path = lora_name``)."""
    if not lora_name or not lora_path:
        raise ValueError("lora_name and lora_path must be non-empty")
    return {"lora_name": lora_name, "lora_path": str(lora_path), "pinned": bool(pinned)}


def unload_lora_body(lora_name: str) -> dict[str, Any]:
    return {"lora_name": lora_name}


def update_weight_version_body(new_version: str, abort_all_requests: bool = False) -> dict[str, Any]:
    """``/update_weight_version``: only the label (an adapter load by path does not change it on SGLang)."""
    return {"new_version": str(new_version), "abort_all_requests": bool(abort_all_requests)}


def begin_body(selector: Literal["target", "draft", "all"] = "all") -> dict[str, Any]:
    return {"selector": selector}


def end_body() -> dict[str, Any]:
    return {}


def pause_body(mode: str = "abort") -> dict[str, Any]:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode = {mode!r}: expected one of {PAUSE_MODES}")
    return {"mode": mode}


def continue_body() -> dict[str, Any]:
    """``{}``: 0.5.10 has no fields, 0.5.23 defaults ``torch_empty_cache`` to true."""
    return {}


def abort_body(rid: str = "", abort_all: bool = False) -> dict[str, Any]:
    """``/abort_request``: the request ``rid`` (matched by prefix on live rids), or every request."""
    return {"rid": rid, "abort_all": bool(abort_all)}


def destroy_group_body(group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
    return {"group_name": group_name}


def update_from_disk_body(
    model_path: str,
    weight_version: str | None = None,
    flush_cache: bool = True,
    abort_all_requests: bool = False,
) -> dict[str, Any]:
    """``/update_weights_from_disk``: reload from an HF directory (recovery of a restarted engine)."""
    if not model_path:
        raise ValueError("model_path must be non-empty")
    return {
        "model_path": str(model_path),
        "weight_version": weight_version,
        "flush_cache": bool(flush_cache),
        "abort_all_requests": bool(abort_all_requests),
    }


def get_weights_by_name_body(name: str, truncate_size: int = 100) -> dict[str, Any]:
    return {"name": name, "truncate_size": int(truncate_size)}


# ------------------------------------------------------------------------------- engine-side parsing


def _require(body: Any, key: str, kind: type | tuple[type, ...], endpoint: str) -> Any:
    if not isinstance(body, dict):
        raise ValueError(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    if key not in body:
        raise ValueError(f"{endpoint}: field {key!r} is required")
    value = body[key]
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # pydantic lax mode: "29500" is accepted for int fields (AReaL relies on it)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{endpoint}: field {key!r} = {value!r} has the wrong type")
    return value


@dataclass(frozen=True)
class InitGroupRequest:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


def parse_init_group(body: Any) -> InitGroupRequest:
    ep = INIT_GROUP
    req = InitGroupRequest(
        master_address=_require(body, "master_address", str, ep),
        master_port=_require(body, "master_port", int, ep),
        rank_offset=_require(body, "rank_offset", int, ep),
        world_size=_require(body, "world_size", int, ep),
        group_name=body.get("group_name", DEFAULT_GROUP),
        backend=body.get("backend", "nccl"),
    )
    if not isinstance(req.group_name, str) or not req.group_name:
        raise ValueError(f"{ep}: group_name = {req.group_name!r} must be a non-empty string")
    return req


@dataclass(frozen=True)
class UpdateRequest:
    metas: list[TensorMeta]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    adapter: LoraSpec | None = None  # set for a LoRA adapter update: the tensors are lora_A / lora_B
    lora_name: str | None = None


def parse_update_distributed(body: Any) -> UpdateRequest:
    ep = UPDATE_DISTRIBUTED
    names = _require(body, "names", list, ep)
    dtypes = _require(body, "dtypes", list, ep)
    shapes = _require(body, "shapes", list, ep)
    load_format = body.get("load_format")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"{ep}: load_format = {load_format!r}: expected one of {LOAD_FORMATS}")
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"{ep}: weight_version = {version!r} must be a string or null")
    from weight_sync.buckets import metas_from_request

    return UpdateRequest(
        metas=metas_from_request(names, dtypes, shapes),
        group_name=body.get("group_name", DEFAULT_GROUP),
        flush_cache=bool(body.get("flush_cache", True)),
        abort_all_requests=bool(body.get("abort_all_requests", False)),
        weight_version=version,
        load_format=load_format,
    )


@dataclass(frozen=True)
class TensorUpdateRequest:
    """``/update_weights_from_tensor``: the tensors arrive by handle, so the request carries no names until the
    payload is unpacked (``weight_sync.tensor_transport.unpack``)."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


def _optional(body: dict, key: str, kind: type, default: Any, endpoint: str) -> Any:
    value = body.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise ValueError(f"{endpoint}: field {key!r} = {value!r} must be a {kind.__name__} or null")
    return default if value is None else value


def parse_update_tensor(body: Any) -> TensorUpdateRequest:
    ep = UPDATE_TENSOR
    serialized = _require(body, "serialized_named_tensors", list, ep)
    if not serialized or not all(isinstance(s, str) and s for s in serialized):
        raise ValueError(
            f"{ep}: field 'serialized_named_tensors' must be a non-empty list of base64 strings, one per TP rank"
        )
    load_format = body.get("load_format")
    if load_format not in TENSOR_LOAD_FORMATS:
        raise ValueError(
            f"{ep}: field 'load_format' = {load_format!r}: the built-in engine takes {TENSOR_LOAD_FORMATS} "
            "(no custom loaders)"
        )
    return TensorUpdateRequest(
        serialized_named_tensors=serialized,
        load_format=None if load_format == "direct" else load_format,
        flush_cache=_optional(body, "flush_cache", bool, True, ep),
        abort_all_requests=_optional(body, "abort_all_requests", bool, False, ep),
        weight_version=_optional(body, "weight_version", str, None, ep),
    )


def parse_memory_tags(body: Any, endpoint: str) -> tuple[str, ...]:
    """The tags of a release / resume body; ``null`` (or no field) means every tag, as SGLang does."""
    if not isinstance(body, dict):
        raise ValueError(f"{endpoint}: the body must be a JSON object, got {type(body).__name__}")
    tags = body.get("tags")
    if tags is None:
        return MEMORY_TAGS
    if not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags):
        raise ValueError(f"{endpoint}: field 'tags' = {tags!r} must be null or a list of {list(MEMORY_TAGS)}")
    return tuple(dict.fromkeys(tags)) or MEMORY_TAGS


def parse_lora_distributed(body: Any) -> UpdateRequest:
    """``/load_lora_adapter_from_distributed``: an update request whose tensors are one adapter's."""
    ep = LOAD_LORA_DISTRIBUTED
    lora_name = _require(body, "lora_name", str, ep)
    config = _require(body, "config_dict", dict, ep)
    from weight_sync.lora import LoraSpec

    spec = LoraSpec.from_config_dict(config, f"{ep}: config_dict")
    req = parse_update_distributed(body)
    return UpdateRequest(**{**req.__dict__, "adapter": spec, "lora_name": lora_name})


@dataclass(frozen=True)
class LoadLoraRequest:
    lora_name: str
    lora_path: str
    pinned: bool = False


def parse_load_lora(body: Any) -> LoadLoraRequest:
    ep = LOAD_LORA
    return LoadLoraRequest(
        lora_name=_require(body, "lora_name", str, ep),
        lora_path=_require(body, "lora_path", str, ep),
        pinned=bool(body.get("pinned", False)),
    )


def parse_unload_lora(body: Any) -> str:
    return _require(body, "lora_name", str, UNLOAD_LORA)


def parse_pause_mode(body: Any) -> str:
    mode = (body or {}).get("mode", "abort") if isinstance(body, dict | type(None)) else None
    if mode not in PAUSE_MODES:
        raise ValueError(f"{PAUSE}: mode = {mode!r}: expected one of {PAUSE_MODES}")
    return mode


def parse_group_name(body: Any) -> str:
    name = (body or {}).get("group_name", DEFAULT_GROUP) if isinstance(body, dict | type(None)) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"group_name = {name!r} must be a non-empty string")
    return name


# ------------------------------------------------------------------------------------ reply parsing


@dataclass(frozen=True)
class Reply:
    """One HTTP reply, or a transport failure (``status`` 0: refused, reset, timed out)."""

    status: int
    body: Any = None
    error: str | None = None

    @property
    def transport_failed(self) -> bool:
        return self.status == 0

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def ok(self) -> bool:
        """HTTP 200 and, when the body says, ``success`` (``{"status": "ok"}`` for pause / continue)."""
        if self.status != 200:
            return False
        if isinstance(self.body, dict):
            if "success" in self.body:
                return bool(self.body["success"])
            if "status" in self.body:
                return self.body["status"] == "ok"
        return True

    @property
    def message(self) -> str:
        """The best human-readable reason: transport error, ``message``, ``error.message``, or the text."""
        if self.error:
            return self.error
        body = self.body
        if isinstance(body, dict):
            if isinstance(body.get("message"), str):
                return body["message"]
            err = body.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return err["message"]
            if isinstance(err, str):
                return err
        return "" if body is None else str(body)[:500]

    def describe(self) -> str:
        """``HTTP 400: <message>`` or ``transport: <error>`` for failure reports."""
        return f"transport: {self.error}" if self.transport_failed else f"HTTP {self.status}: {self.message}"


def reply_body(success: bool, message: str, **extra: Any) -> tuple[int, dict[str, Any]]:
    """An engine's ``{success, message}`` reply and its status: 200 on success, 400 on failure."""
    return (200 if success else 400), {"success": success, "message": message, **extra}
