"""msgpack codec of the trajectory record, schema v1.

One group is one msgpack map with short keys (:data:`GROUP_KEYS`, :data:`SAMPLE_KEYS`). Arrays travel as the
raw little-endian bytes of their schema dtype (msgpack ``bin``), never as lists of numbers, and are decoded with
``np.frombuffer`` into read-only views without a further copy. Dicts are written with sorted keys, so the same
record always encodes to the same bytes (the golden fixture tests/fixtures/record_v1.msgpack pins them).

Decoding is strict: a missing key, an unknown key, a value of the wrong type, array bytes that are not a whole
number of items, or an unknown schema version each raise :class:`~broker.record.RecordError` naming the field.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from broker.record import (
    ARRAY_DTYPES,
    KNOWN_SCHEMA_VERSIONS,
    PROMPT_DTYPE,
    RecordError,
    Sample,
    TrajectoryGroup,
)

# field name -> wire key. Frozen with schema v1: changing a key is a new schema version.
GROUP_KEYS: dict[str, str] = {
    "schema_version": "sv",
    "run_id": "run",
    "group_id": "gid",
    "prompt_id": "pid",
    "epoch": "ep",
    "prompt_index": "pi",
    "attempt": "at",
    "task": "task",
    "prompt_ids": "p",
    "worker_id": "w",
    "created_at": "t",
    "samples": "s",
    "extra": "x",
}
SAMPLE_KEYS: dict[str, str] = {
    "sample_index": "i",
    "output_ids": "o",
    "logprobs": "lp",
    "versions": "ver",
    "loss_mask": "m",
    "finish_reason": "fr",
    "truncated": "tr",
    "reward": "r",
    "reward_components": "rc",
    "reward_status": "rs",
    "reward_error": "re",
    "temperature": "T",
    "top_p": "tp",
    "top_k": "tk",
    "engine_id": "e",
    "timings": "tm",
    "num_resubmits": "nr",
}
_FLOAT_FIELDS = {"reward", "temperature", "top_p", "created_at"}
_FLOAT_DICTS = {"reward_components", "timings"}
_SAMPLE_ITEMS = tuple(SAMPLE_KEYS.items())
_SAMPLE_ARRAYS = tuple((name, SAMPLE_KEYS[name], dtype) for name, dtype in ARRAY_DTYPES.items())
_SAMPLE_FLOATS = tuple((n, k) for n, k in _SAMPLE_ITEMS if n in _FLOAT_FIELDS)
_SAMPLE_FLOAT_DICTS = tuple((n, k) for n, k in _SAMPLE_ITEMS if n in _FLOAT_DICTS)


def _wire_array(arr: np.ndarray, dtype: np.dtype) -> memoryview:
    # A memoryview of the contiguous little-endian data: msgpack writes it as bin without an extra copy.
    if arr.dtype == dtype and arr.flags.c_contiguous:
        return arr.data.cast("B")
    return memoryview(np.ascontiguousarray(arr, dtype=dtype)).cast("B")


def _encode_sample(s: Sample) -> dict[str, Any]:
    d = s.__dict__
    out = {key: d[name] for name, key in _SAMPLE_ITEMS}  # wire key order = SAMPLE_KEYS order
    for name, key, dtype in _SAMPLE_ARRAYS:
        out[key] = _wire_array(d[name], dtype)
    for name, key in _SAMPLE_FLOATS:
        out[key] = float(d[name])
    for name, key in _SAMPLE_FLOAT_DICTS:
        value = d[name]
        out[key] = {k: float(value[k]) for k in sorted(value)}
    return out


def encode(group: TrajectoryGroup, validate: bool = True) -> bytes:
    """The msgpack bytes of ``group`` (validated first unless ``validate`` is False, which only tests use
    to produce malformed entries)."""
    return bytes(encode_buffer(group, validate))


def encode_buffer(group: TrajectoryGroup, validate: bool = True) -> memoryview:
    """:func:`encode` without the final copy: a read-only view of the packer's buffer, sized up front from the
    array sizes so it is never reallocated (the producer sends this; a megabyte copied less per group)."""
    if validate:
        group.validate()
    out: dict[str, Any] = {}
    for name, key in GROUP_KEYS.items():
        value = getattr(group, name)
        if name == "prompt_ids":
            value = _wire_array(value, PROMPT_DTYPE)
        elif name == "samples":
            value = [_encode_sample(s) for s in value]
        elif name == "created_at":
            value = float(value)
        elif name == "extra":
            value = {k: value[k] for k in sorted(value)}
        out[key] = value
    size = group.prompt_ids.nbytes + sum(
        s.output_ids.nbytes + s.logprobs.nbytes + s.versions.nbytes + s.loss_mask.nbytes + 1024
        for s in group.samples
    )
    packer = msgpack.Packer(use_bin_type=True, autoreset=False, buf_size=size + 4096)
    packer.pack(out)
    return packer.getbuffer().toreadonly()


def _take(m: dict[str, Any], keys: dict[str, str], prefix: str) -> dict[str, Any]:
    """Map wire keys back to field names; a missing or unknown key is a RecordError naming it."""
    if len(m) == len(keys):
        try:
            return {name: m[key] for name, key in keys.items()}
        except KeyError:
            pass
    known = set(keys.values())
    for key in m:
        if key not in known:
            raise RecordError(f"{prefix}<unknown key>", key, "not a key of schema v1")
    for name, key in keys.items():
        if key not in m:
            raise RecordError(f"{prefix}{name}", None, f"missing (wire key {key!r})")
    raise AssertionError("unreachable")  # pragma: no cover


def _read_array(value: Any, dtype: np.dtype, path: str) -> np.ndarray:
    if not isinstance(value, bytes):
        raise RecordError(path, type(value).__name__, f"must be packed {dtype} bytes")
    if len(value) % dtype.itemsize:
        raise RecordError(path, f"{len(value)} bytes", f"not a whole number of {dtype.itemsize}-byte items")
    return np.frombuffer(value, dtype=dtype)


def _decode_sample(m: Any, path: str) -> Sample:
    if type(m) is dict and len(m) == len(_SAMPLE_ITEMS):
        try:  # fast path: every key present, arrays are whole numbers of items
            d = {name: m[key] for name, key in _SAMPLE_ITEMS}
            for name, _, dtype in _SAMPLE_ARRAYS:
                value = d[name]
                if type(value) is not bytes:
                    raise TypeError
                d[name] = np.frombuffer(value, dtype=dtype)
        except (KeyError, TypeError, ValueError):
            pass
        else:
            sample = Sample.__new__(Sample)  # arrays already have their schema dtypes: skip __post_init__
            sample.__dict__ = d
            return sample
    if not isinstance(m, dict):
        raise RecordError(path, type(m).__name__, "must be a map")
    fields = _take(m, SAMPLE_KEYS, path + ".")
    for name, dtype in ARRAY_DTYPES.items():
        fields[name] = _read_array(fields[name], dtype, f"{path}.{name}")
    return Sample(**fields)


def decode(data: bytes, validate: bool = True) -> TrajectoryGroup:
    """The group encoded in ``data``; raises RecordError (naming the field and value) for anything that is
    not a valid schema v1 record."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise RecordError("<payload>", f"{len(data)} bytes", f"not msgpack: {exc}") from None
    if not isinstance(m, dict):
        raise RecordError("<payload>", type(m).__name__, "must be a msgpack map")
    version = m.get(GROUP_KEYS["schema_version"])
    if version not in KNOWN_SCHEMA_VERSIONS:
        raise RecordError("schema_version", version, f"unknown; known: {sorted(KNOWN_SCHEMA_VERSIONS)}")
    fields = _take(m, GROUP_KEYS, "")
    fields["prompt_ids"] = _read_array(fields["prompt_ids"], PROMPT_DTYPE, "prompt_ids")
    samples = fields["samples"]
    if not isinstance(samples, list):
        raise RecordError("samples", type(samples).__name__, "must be a list")
    fields["samples"] = [_decode_sample(s, f"samples[{i}]") for i, s in enumerate(samples)]
    try:
        group = TrajectoryGroup(**fields)
    except TypeError as exc:  # e.g. a non-str run_id reaching make_group_id
        raise RecordError("<payload>", None, str(exc)) from None
    if validate:
        group.validate()
    return group
