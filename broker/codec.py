"""msgpack codec of the trajectory record, schemas v1 and v2.

One group is one msgpack map with short keys (:data:`GROUP_KEYS`, :data:`SAMPLE_KEYS`). Arrays travel as the
raw little-endian bytes of their schema dtype (msgpack ``bin``), never as lists of numbers, and are decoded with
``np.frombuffer`` into read-only views without a further copy. Dicts are written with sorted keys, so the same
record always encodes to the same bytes (the golden fixture tests/fixtures/record_v1.msgpack pins them).

Decoding is strict: a missing key, an unknown key, a value of the wrong type, array bytes that are not a whole
number of items, or an unknown schema version each raise :class:`~broker.record.RecordError` naming the field.

Schema v2 (multi-turn samples) is v1 plus two sample keys (:data:`SAMPLE_KEYS_V2`): ``tb`` (turn bounds, packed
int32) and ``es`` (episode counters). A group whose samples are all single-turn is written as v1, byte for
byte; the golden fixtures tests/fixtures/record_v1.msgpack and record_v2.msgpack pin both.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from broker.record import (
    ARRAY_DTYPES,
    KNOWN_SCHEMA_VERSIONS,
    PROMPT_DTYPE,
    SCHEMA_V1,
    TURN_BOUNDS_DTYPE,
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
# Schema v2: v1's keys plus the multi-turn fields. Frozen with schema v2.
SAMPLE_KEYS_V2: dict[str, str] = {**SAMPLE_KEYS, "turn_bounds": "tb", "episode": "es"}
_FLOAT_FIELDS = {"reward", "temperature", "top_p", "created_at"}
_FLOAT_DICTS = {"reward_components", "timings", "episode"}
_ARRAY_DTYPES_V2 = {**ARRAY_DTYPES, "turn_bounds": TURN_BOUNDS_DTYPE}


class _Layout:
    """The sample wire layout of one schema version: keys, and which fields are arrays, floats, float dicts."""

    def __init__(self, keys: dict[str, str], dtypes: dict[str, np.dtype]) -> None:
        self.keys = keys
        self.dtypes = dtypes
        self.items = tuple(keys.items())
        self.arrays = tuple((name, keys[name], dtype) for name, dtype in dtypes.items())
        self.floats = tuple((n, k) for n, k in self.items if n in _FLOAT_FIELDS)
        self.float_dicts = tuple((n, k) for n, k in self.items if n in _FLOAT_DICTS)


_LAYOUTS = {1: _Layout(SAMPLE_KEYS, dict(ARRAY_DTYPES)), 2: _Layout(SAMPLE_KEYS_V2, _ARRAY_DTYPES_V2)}
# what a v1 sample holds of the v2 fields: nothing (one shared read-only empty array)
_V1_DEFAULTS = {"turn_bounds": Sample.__dataclass_fields__["turn_bounds"].default_factory()}  # type: ignore[misc]


def _wire_array(arr: np.ndarray, dtype: np.dtype) -> memoryview:
    # A memoryview of the contiguous little-endian data: msgpack writes it as bin without an extra copy.
    if arr.dtype == dtype and arr.flags.c_contiguous:
        return arr.data.cast("B")
    return memoryview(np.ascontiguousarray(arr, dtype=dtype)).cast("B")


def _encode_sample(s: Sample, layout: _Layout) -> dict[str, Any]:
    d = s.__dict__
    out = {key: d[name] for name, key in layout.items}  # wire key order = SAMPLE_KEYS order
    for name, key, dtype in layout.arrays:
        out[key] = _wire_array(d[name], dtype)
    for name, key in layout.floats:
        out[key] = float(d[name])
    for name, key in layout.float_dicts:
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
    # an unknown version only gets here unvalidated (tests writing malformed entries): the newest layout
    layout = _LAYOUTS.get(group.schema_version, _LAYOUTS[max(_LAYOUTS)])
    out: dict[str, Any] = {}
    for name, key in GROUP_KEYS.items():
        value = getattr(group, name)
        if name == "prompt_ids":
            value = _wire_array(value, PROMPT_DTYPE)
        elif name == "samples":
            value = [_encode_sample(s, layout) for s in value]
        elif name == "created_at":
            value = float(value)
        elif name == "extra":
            value = {k: value[k] for k in sorted(value)}
        out[key] = value
    size = group.prompt_ids.nbytes + sum(
        s.output_ids.nbytes
        + s.logprobs.nbytes
        + s.versions.nbytes
        + s.loss_mask.nbytes
        + 1024
        + s.turn_bounds.nbytes
        + 64 * len(s.episode)
        for s in group.samples
    )
    packer = msgpack.Packer(use_bin_type=True, autoreset=False, buf_size=size + 4096)
    packer.pack(out)
    return packer.getbuffer().toreadonly()


def _take(m: dict[str, Any], keys: dict[str, str], prefix: str, version: int = SCHEMA_V1) -> dict[str, Any]:
    """Map wire keys back to field names; a missing or unknown key is a RecordError naming it."""
    if len(m) == len(keys):
        try:
            return {name: m[key] for name, key in keys.items()}
        except KeyError:
            pass
    known = set(keys.values())
    for key in m:
        if key not in known:
            raise RecordError(f"{prefix}<unknown key>", key, f"not a key of schema v{version}")
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


def _decode_sample(m: Any, path: str, version: int) -> Sample:
    layout = _LAYOUTS[version]
    if type(m) is dict and len(m) == len(layout.items):
        try:  # fast path: every key present, arrays are whole numbers of items
            d = {name: m[key] for name, key in layout.items}
            for name, _, dtype in layout.arrays:
                value = d[name]
                if type(value) is not bytes:
                    raise TypeError
                d[name] = np.frombuffer(value, dtype=dtype)
        except (KeyError, TypeError, ValueError):
            pass
        else:
            if version == SCHEMA_V1:
                d["turn_bounds"], d["episode"] = _V1_DEFAULTS["turn_bounds"], {}
            sample = Sample.__new__(Sample)  # arrays already have their schema dtypes: skip __post_init__
            sample.__dict__ = d
            return sample
    if not isinstance(m, dict):
        raise RecordError(path, type(m).__name__, "must be a map")
    fields = _take(m, layout.keys, path + ".", version)
    for name, dtype in layout.dtypes.items():
        fields[name] = _read_array(fields[name], dtype, f"{path}.{name}")
    return Sample(**fields)


def decode(data: bytes, validate: bool = True) -> TrajectoryGroup:
    """The group encoded in ``data``; raises RecordError (naming the field and value) for anything that is
    not a valid schema v1 or v2 record."""
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
    fields["samples"] = [_decode_sample(s, f"samples[{i}]", version) for i, s in enumerate(samples)]
    try:
        group = TrajectoryGroup(**fields)
    except TypeError as exc:  # e.g. a non-str run_id reaching make_group_id
        raise RecordError("<payload>", None, str(exc)) from None
    if validate:
        group.validate()
    return group
