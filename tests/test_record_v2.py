"""Trajectory record schema v2 (multi-turn samples): the golden fixture, v1 still read and still written for
single-turn groups, and the turn structure's validation.

Regenerate the v2 golden fixture only for a deliberate schema change (which is a new schema version):
    PYTHONPATH=. .venv/bin/python tests/test_record_v2.py --write-fixture
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest

from broker.codec import GROUP_KEYS, SAMPLE_KEYS, SAMPLE_KEYS_V2, decode, encode
from broker.record import SCHEMA_V1, SCHEMA_V2, RecordError, Sample, TrajectoryGroup
from tests.test_record import FIXTURE as FIXTURE_V1
from tests.test_record import fixed_record as fixed_record_v1

FIXTURE = Path(__file__).parent / "fixtures" / "record_v2.msgpack"


def two_turn_sample(index: int = 0) -> Sample:
    """Turn 1 (tokens 0-2, version 3), a 2-token tool observation (3-4, masked, version 3), turn 2 (5-6,
    version 4: a weight update between the turns)."""
    return Sample(
        sample_index=index,
        output_ids=np.array([11, 12, 13, 90, 91, 14, 15], dtype=np.int32),
        logprobs=np.array([-0.5, -1.25, -0.125, 0.0, 0.0, -2.0, -0.25], dtype=np.float32),
        versions=np.array([3, 3, 3, 3, 3, 4, 4], dtype=np.int32),
        loss_mask=np.array([1, 1, 1, 0, 0, 1, 1], dtype=np.uint8),
        finish_reason="stop",
        truncated=False,
        reward=1.0,
        reward_components={"correct": 1.0, "format": 1.0},
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        engine_id="engine-a",
        timings={"generate_s": 0.5},
        num_resubmits=0,
        turn_bounds=np.array([0, 3, 5, 7], dtype=np.int32),
        episode={"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "observation_tokens": 2.0},
    )


def fixed_record() -> TrajectoryGroup:
    """The record the v2 golden fixture pins: one two-turn sample and one single-turn sample."""
    single = fixed_record_v1().samples[1]
    return TrajectoryGroup(
        run_id="golden",
        epoch=0,
        prompt_index=5,
        attempt=0,
        prompt_id="tool-5",
        task="tool_arithmetic",
        prompt_ids=np.array([3, 40, 41, 4], dtype=np.int32),
        samples=[two_turn_sample(0), single],
        worker_id="worker-1",
        created_at=1_700_000_000.5,
        extra={"answer": "42"},
    )


def test_golden_v2_fixture_pins_the_wire_format() -> None:
    data = FIXTURE.read_bytes()
    assert encode(fixed_record()) == data
    decoded = decode(data)
    assert decoded == fixed_record()
    assert decoded.schema_version == SCHEMA_V2
    wire = msgpack.unpackb(data, raw=False)
    assert wire[GROUP_KEYS["schema_version"]] == 2
    assert set(wire["s"][0]) == set(SAMPLE_KEYS_V2.values())
    first = decoded.samples[0]
    assert first.turns() == [(0, 3), (5, 7)]
    assert first.turn_bounds.dtype == np.dtype("<i4")
    assert decoded.samples[1].turns() == [(0, 2)]  # a single-turn sample inside a v2 group


def test_version_1_is_still_read_and_written_for_single_turn_groups() -> None:
    old = decode(FIXTURE_V1.read_bytes())
    assert old.schema_version == SCHEMA_V1
    for sample in old.samples:
        assert sample.turn_bounds.shape == (0,) and sample.episode == {}
        assert not sample.is_multi_turn()
    # a single-turn group built today is v1 on the wire, byte for byte the v1 fixture
    assert fixed_record_v1().schema_version == SCHEMA_V1
    assert encode(fixed_record_v1()) == FIXTURE_V1.read_bytes()
    assert set(msgpack.unpackb(encode(fixed_record_v1()), raw=False)["s"][0]) == set(SAMPLE_KEYS.values())


def test_multi_turn_samples_need_v2() -> None:
    group = fixed_record()
    group.schema_version = SCHEMA_V1
    with pytest.raises(RecordError, match=r"schema_version = 1: multi-turn samples .* need schema v2"):
        encode(group)


def _with(**changes) -> Sample:
    sample = two_turn_sample()
    for name, value in changes.items():
        setattr(sample, name, np.asarray(value, dtype=getattr(sample, name).dtype))
    return sample


@pytest.mark.parametrize(
    ("changes", "field", "reason"),
    [
        ({"turn_bounds": [0, 3, 5]}, r"samples\[0\]\.turn_bounds = 'length 3'", "pairs"),
        ({"turn_bounds": [0, 3, 2, 7]}, r"turn_bounds\[2:4\] = \[2, 7\]", "disjoint"),
        ({"turn_bounds": [0, 3, 5, 5]}, r"turn_bounds\[2:4\] = \[5, 5\]", "non-empty"),
        ({"turn_bounds": [0, 3, 5, 9]}, r"turn_bounds\[2:4\] = \[5, 9\]", "within"),
        ({"turn_bounds": [0, 3, 4, 6]}, r"turn_bounds\[3\] = 6", "must end at T = 7"),
        ({"loss_mask": [1, 1, 1, 0, 1, 1, 1]}, r"loss_mask\[4\] = 1", "observation tokens"),
        ({"turn_bounds": [1, 3, 5, 7], "loss_mask": [1, 1, 1, 0, 0, 1, 1]}, r"loss_mask\[0\] = 1", "masked"),
    ],
)
def test_turn_structure_is_validated(changes: dict, field: str, reason: str) -> None:
    group = fixed_record()
    group.samples[0] = _with(**changes)
    with pytest.raises(RecordError, match=field) as info:
        group.validate()
    assert reason in str(info.value)
    # the same error on read: a producer that skipped validation cannot get it past the decoder
    with pytest.raises(RecordError, match=field):
        decode(encode(group, validate=False))


def test_episode_counters_must_be_finite_floats() -> None:
    group = fixed_record()
    group.samples[0].episode = {"turns": float("nan")}
    with pytest.raises(RecordError, match=r"samples\[0\]\.episode\['turns'\] = nan: must be finite"):
        group.validate()


def test_the_archive_keeps_turns_and_episode_counters(tmp_path) -> None:
    import pyarrow.parquet as pq

    from archiver.archive import TokenText, sample_rows, write_rows

    rows = sample_rows(fixed_record(), "1-0", None, TokenText(None), 0.0)
    write_rows(tmp_path / "part.parquet", rows)
    table = pq.read_table(tmp_path / "part.parquet").to_pylist()
    assert [r["turn_bounds"] for r in table] == [[0, 3, 5, 7], []]
    assert [r["num_turns"] for r in table] == [2, 1]
    counters = {c["name"]: c["value"] for c in table[0]["episode"]}
    assert counters == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "observation_tokens": 2.0}
    assert table[0]["loss_mask"] == [1, 1, 1, 0, 0, 1, 1] and table[1]["episode"] == []


def write_fixture() -> None:
    FIXTURE.write_bytes(encode(fixed_record()))
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-fixture"]:
        write_fixture()
