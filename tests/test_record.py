"""Trajectory record schema v1 and its msgpack codec: round trips, the golden fixture, validation errors.

Schema v2 (multi-turn samples) has its own tests in tests/test_record_v2.py.

Regenerate the golden fixture only for a deliberate schema change (which is a new schema version):
    .venv/bin/python tests/test_record.py --write-fixture
"""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np
import pytest

from broker.codec import GROUP_KEYS, SAMPLE_KEYS, decode, encode
from broker.record import (
    ARRAY_DTYPES,
    RecordError,
    Sample,
    TrajectoryGroup,
    make_group_id,
    synthetic_group,
)

FIXTURE = Path(__file__).parent / "fixtures" / "record_v1.msgpack"


def fixed_record() -> TrajectoryGroup:
    """The record pinned by the golden fixture: every field set to a non-default, exactly representable value."""
    return TrajectoryGroup(
        run_id="golden",
        epoch=2,
        prompt_index=17,
        attempt=1,
        prompt_id="add-17",
        task="addition",
        prompt_ids=np.array([5, 6, 7, 150_000, 0], dtype=np.int32),
        samples=[
            Sample(
                sample_index=0,
                output_ids=np.array([11, 12, 13, 2**31 - 1], dtype=np.int32),
                logprobs=np.array([-0.5, -1.25, 0.0, -20.0], dtype=np.float32),
                versions=np.array([3, 3, 4, 4], dtype=np.int32),
                loss_mask=np.array([0, 0, 1, 1], dtype=np.uint8),
                finish_reason="stop",
                truncated=False,
                reward=1.0,
                reward_components={"format": 1.0, "correct": 1.0},
                reward_status="ok",
                reward_error="",
                temperature=0.75,
                top_p=0.875,
                top_k=50,
                engine_id="engine-a",
                timings={"generate_s": 1.5, "reward_s": 0.125},
                num_resubmits=1,
            ),
            Sample(
                sample_index=1,
                output_ids=np.array([21, 22], dtype=np.int32),
                logprobs=np.array([-3.0, -0.0625], dtype=np.float32),
                versions=np.array([4, 4], dtype=np.int32),
                loss_mask=np.array([1, 1], dtype=np.uint8),
                finish_reason="length",
                truncated=True,
                reward=0.0,
                reward_components={},
                reward_status="timeout",
                reward_error="verifier timed out after 5.0 s",
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                engine_id="engine-b",
                timings={},
                num_resubmits=0,
            ),
        ],
        worker_id="worker-3",
        created_at=1_700_000_123.25,
        extra={"answer": "42", "source": "gsm"},
    )


def test_golden_fixture_pins_the_wire_format() -> None:
    data = FIXTURE.read_bytes()
    assert encode(fixed_record()) == data
    decoded = decode(data)
    assert decoded == fixed_record()
    assert decoded.group_id == "golden:e2:p17:a1"
    for name, dtype in ARRAY_DTYPES.items():
        assert getattr(decoded.samples[0], name).dtype == dtype


@pytest.mark.parametrize("num_tokens", [1024, 8192])
def test_round_trip_of_realistic_groups(num_tokens: int) -> None:
    group = synthetic_group(np.random.default_rng(num_tokens), num_samples=8, num_tokens=num_tokens)
    data = encode(group)
    back = decode(data)
    assert back == group
    assert back.num_tokens() == 8 * num_tokens
    # Arrays travel as packed binary: the payload is the raw array bytes plus a small constant overhead.
    raw = 8 * num_tokens * (4 + 4 + 4 + 1) + group.prompt_ids.nbytes
    assert raw < len(data) < raw + 2_000
    # ...and decode to views of the payload, not copies.
    assert not back.samples[0].logprobs.flags.writeable


def test_equality_sees_a_single_changed_token() -> None:
    a, b = fixed_record(), fixed_record()
    b.samples[1].output_ids = np.array([21, 23], dtype=np.int32)
    assert a != b


def test_helpers_min_max_version_and_tokens() -> None:
    g = fixed_record()
    assert g.samples[0].min_version() == 3
    assert g.samples[1].min_version() == 4
    assert (g.min_version(), g.max_version(), g.num_tokens()) == (3, 4, 6)
    assert make_group_id("r", 1, 2, 3) == "r:e1:p2:a3" == make_group_id("r", 1, 2, 3)


def test_lists_are_converted_but_lossy_inputs_refused() -> None:
    s = Sample(0, [1, 2], [-0.5, -1.0], [0, 0], [1, 1], "stop", False, 0.0)
    assert s.output_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
    with pytest.raises(RecordError, match=r"output_ids = 'array of float64': must hold integers"):
        Sample(0, [1.5, 2.0], [-0.5, -1.0], [0, 0], [1, 1], "stop", False, 0.0)
    with pytest.raises(RecordError, match=r"versions = 4294967296: out of range"):
        Sample(0, [1, 2], [-0.5, -1.0], [0, 2**32], [1, 1], "stop", False, 0.0)


# ----- validation: each malformed case names its field path and value, on write and on read --------------


def _set(path: str, value: object) -> Callable[[TrajectoryGroup], None]:
    """A mutation that sets ``samples[i].name`` or a group attribute to ``value``."""

    def mutate(g: TrajectoryGroup) -> None:
        if path.startswith("samples["):
            i = int(path[8 : path.index("]")])
            setattr(g.samples[i], path.split(".", 1)[1], value)
        else:
            setattr(g, path, value)

    return mutate


def _poke(i: int, name: str, index: int, value: float) -> Callable[[TrajectoryGroup], None]:
    def mutate(g: TrajectoryGroup) -> None:
        arr = getattr(g.samples[i], name).copy()
        arr[index] = value
        setattr(g.samples[i], name, arr)

    return mutate


def _big() -> TrajectoryGroup:
    return synthetic_group(np.random.default_rng(7), num_samples=4, num_tokens=32, version=2)


BAD_CASES: dict[str, tuple[Callable[[TrajectoryGroup], None], str, str]] = {
    "nan logprob": (_poke(3, "logprobs", 17, np.nan), r"samples\[3\]\.logprobs\[17\] = nan", "finite"),
    "positive logprob": (_poke(1, "logprobs", 4, 0.5), r"samples\[1\]\.logprobs\[4\] = 0\.5", "<="),
    "negative version": (_poke(0, "versions", 2, -1), r"samples\[0\]\.versions\[2\] = -1", ">= 0"),
    "negative token": (_poke(2, "output_ids", 9, -5), r"samples\[2\]\.output_ids\[9\] = -5", ">= 0"),
    "mask not 0/1": (_poke(0, "loss_mask", 1, 2), r"samples\[0\]\.loss_mask\[1\] = 2", "0 or 1"),
    "short logprobs": (
        lambda g: setattr(g.samples[2], "logprobs", g.samples[2].logprobs[:31]),
        r"samples\[2\]\.logprobs = 'length 31'",
        "len\\(output_ids\\) = 32",
    ),
    "long loss mask": (
        lambda g: setattr(g.samples[1], "loss_mask", np.ones(33, dtype=np.uint8)),
        r"samples\[1\]\.loss_mask = 'length 33'",
        "must equal",
    ),
    "empty output": (
        lambda g: [setattr(g.samples[0], n, getattr(g.samples[0], n)[:0]) for n in ARRAY_DTYPES],
        r"samples\[0\]\.output_ids = '\[\]'",
        "empty",
    ),
    "nan reward": (_set("samples[1].reward", float("nan")), r"samples\[1\]\.reward = nan", "finite"),
    "inf component": (
        _set("samples[0].reward_components", {"correct": float("inf")}),
        r"samples\[0\]\.reward_components\['correct'\] = inf",
        "finite",
    ),
    "unknown finish": (_set("samples[2].finish_reason", "eos"), r"finish_reason = 'eos'", "one of"),
    "unknown status": (_set("samples[0].reward_status", "meh"), r"reward_status = 'meh'", "one of"),
    "error without text": (
        _set("samples[0].reward_status", "error"),
        r"samples\[0\]\.reward_error = ''",
        "empty",
    ),
    "bad top_p": (_set("samples[0].top_p", 0.0), r"samples\[0\]\.top_p = 0\.0", r"\(0, 1\]"),
    "schema version": (_set("schema_version", 3), r"schema_version = 3", "unknown"),
    "empty run id": (_set("run_id", ""), r"run_id = ''", "empty"),
    "empty prompt id": (_set("prompt_id", ""), r"prompt_id = ''", "empty"),
    "empty prompt": (_set("prompt_ids", np.zeros(0, dtype=np.int32)), r"prompt_ids = '\[\]'", "empty"),
    "foreign group id": (_set("group_id", "other"), r"group_id = 'other'", "make_group_id"),
    "negative epoch": (_set("epoch", -1), r"epoch = -1", ">= 0"),
    "no samples": (_set("samples", []), r"samples = \[\]", "non-empty"),
    "duplicate index": (_set("samples[2].sample_index", 0), r"samples\[2\]\.sample_index = 0", "duplicate"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_validation_on_write_names_field_and_value(case: str) -> None:
    mutate, field_re, reason_re = BAD_CASES[case]
    group = _big()
    encode(group)  # valid before the mutation
    mutate(group)
    with pytest.raises(RecordError, match=field_re) as info:
        encode(group)
    assert re.search(reason_re, info.value.reason), info.value.reason


@pytest.mark.parametrize("case", sorted(set(BAD_CASES) - {"foreign group id"}))
def test_validation_on_read_names_field_and_value(case: str) -> None:
    mutate, field_re, _ = BAD_CASES[case]
    group = _big()
    mutate(group)
    data = encode(group, validate=False)
    with pytest.raises(RecordError, match=field_re):
        decode(data)


def _wire(group: TrajectoryGroup) -> dict:
    return msgpack.unpackb(encode(group), raw=False)


def _pack(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def test_decode_errors_name_the_field() -> None:
    good = _wire(fixed_record())

    with pytest.raises(RecordError, match=r"<payload> = '65 bytes': not msgpack"):
        decode(np.random.default_rng(0).bytes(64) + b"\xc1")

    m = copy.deepcopy(good)
    del m["s"][1][SAMPLE_KEYS["logprobs"]]
    with pytest.raises(RecordError, match=r"samples\[1\]\.logprobs = None: missing"):
        decode(_pack(m))

    m = copy.deepcopy(good)
    m["s"][0][SAMPLE_KEYS["versions"]] += b"\x00"
    with pytest.raises(RecordError, match=r"samples\[0\]\.versions = '17 bytes': not a whole number"):
        decode(_pack(m))

    m = copy.deepcopy(good)
    m["s"][0][SAMPLE_KEYS["output_ids"]] = [11, 12, 13, 14]
    with pytest.raises(RecordError, match=r"samples\[0\]\.output_ids = 'list': must be packed int32 bytes"):
        decode(_pack(m))

    m = copy.deepcopy(good)
    m[GROUP_KEYS["epoch"]] = "2"
    with pytest.raises(RecordError, match=r"epoch = '2': must be an int"):
        decode(_pack(m))

    m = copy.deepcopy(good)
    m["zz"] = 1
    with pytest.raises(RecordError, match=r"<unknown key> = 'zz'"):
        decode(_pack(m))

    m = copy.deepcopy(good)
    m[GROUP_KEYS["schema_version"]] = 3
    with pytest.raises(RecordError, match=r"schema_version = 3: unknown"):
        decode(_pack(m))

    m = copy.deepcopy(good)  # v1 keys under a v2 label: the v2 fields are missing
    m[GROUP_KEYS["schema_version"]] = 2
    with pytest.raises(RecordError, match=r"samples\[0\]\.turn_bounds = None: missing \(wire key 'tb'\)"):
        decode(_pack(m))

    with pytest.raises(RecordError, match=r"<payload> = 'list': must be a msgpack map"):
        decode(_pack([1, 2]))


def write_fixture() -> None:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_bytes(encode(fixed_record()))
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-fixture"]:
        write_fixture()
