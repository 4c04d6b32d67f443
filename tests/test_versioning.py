"""The weight-version protocol (common.versioning), pure: labels, lineage, behind-ness, announcing, admission
capacity, each against values worked out by hand."""

from __future__ import annotations

import pytest

from common.versioning import (
    INITIAL_LABEL,
    LabelError,
    Lineage,
    ResumePoint,
    admission_capacity,
    answer_version,
    decode_label,
    encode_label,
    may_announce,
)


def test_labels_round_trip_and_sglang_default_is_the_initial_policy() -> None:
    assert [encode_label(v) for v in (0, 7, 120)] == ["0", "7", "120"]
    assert [decode_label(label) for label in ("0", "7", "120", " 12 ", 5, "default")] == [0, 7, 120, 12, 5, 0]
    assert decode_label(INITIAL_LABEL) == 0
    for version in (0, 1, 99):
        assert decode_label(encode_label(version)) == version


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("v2", r"meta_info\.weight_version = 'v2': not an int policy version"),
        ("-3", r"meta_info\.weight_version = '-3': policy versions are >= 0"),
        (-1, r"meta_info\.weight_version = -1: policy versions are >= 0"),
        (True, r"meta_info\.weight_version = True: not a policy version"),
        (None, r"meta_info\.weight_version = None"),
        ("", r"meta_info\.weight_version = ''"),
        (2.0, r"meta_info\.weight_version = 2\.0"),
    ],
)
def test_a_bad_label_is_an_error_naming_where_and_the_value(label: object, message: str) -> None:
    with pytest.raises(LabelError, match=message):
        decode_label(label, "meta_info.weight_version")


def test_encode_refuses_what_is_not_a_version() -> None:
    for bad in (-1, True, 1.0, "3"):
        with pytest.raises(LabelError, match="must be an int >= 0"):
            encode_label(bad)  # type: ignore[arg-type]


def test_an_answer_without_a_label_is_from_the_initial_policy() -> None:
    assert answer_version({"weight_version": "4"}) == 4
    assert answer_version({"model_path": "x"}) == 0
    with pytest.raises(LabelError, match="model_info = 'x'"):
        answer_version({"weight_version": "x"}, "model_info")


def test_positions_and_behind_without_resumes_are_raw_versions() -> None:
    plain = Lineage()
    assert [plain.position(v) for v in (0, 3, 9)] == [0, 3, 9]
    # learner 5, eta 2: 3 is 2 behind (within), 2 is 3 behind (out); a version above the learner is never behind
    assert not plain.behind(5, 3, eta=2) and plain.behind(5, 2, eta=2)
    assert not plain.behind(5, 5, eta=0) and plain.behind(5, 4, eta=0)
    assert not plain.behind(5, 9, eta=0)
    with pytest.raises(ValueError, match="eta"):
        plain.behind(5, 5, eta=-1)


def test_behind_after_a_resume_from_an_older_checkpoint_is_measured_in_positions() -> None:
    # Published up to 10, crash, resume from the checkpoint of version 6 as version 11: 11 holds position 6,
    # and 10 - 6 = 4 positions were rolled back. Then 12 and 13 are positions 7 and 8.
    lineage = Lineage().resumed(version=11, restored=6, published=10)
    assert lineage.points == (ResumePoint(11, 6, 4),)
    assert [lineage.position(v) for v in (0, 6, 7, 10, 11, 12, 13)] == [0, 6, 7, 10, 6, 7, 8]
    # at 11 (position 6), eta 1: pre-resume versions are allowed 1 + 4 either way. 7: distance -1, 10: -4,
    # 1: 5 (all within 5); 0: 6 (out). Raw, 11 - 1 = 10 would have left everything below 10 out.
    assert [v for v in range(12) if lineage.behind(11, v, eta=1)] == [0]
    # at 13 (position 8): pre-resume 7 is 1 behind, 3 is 5, 2 is 6 (out); post-resume versions have no
    # allowance: 12 (position 7) is 1 behind, 11 (position 6) is 2 (out)
    assert [v for v in range(14) if lineage.behind(13, v, eta=1)] == [0, 1, 2, 11]
    assert lineage.allowance(13, 12) == 0 and lineage.allowance(13, 10) == 4
    # a post-resume version is held to eta alone: at 14 (position 9), 12 (position 7) is 2 behind: out
    assert lineage.behind(14, 12, eta=1) and not lineage.behind(14, 13, eta=1)


def test_a_lost_branch_ahead_of_the_restored_weights_is_behind_when_beyond_the_allowance() -> None:
    # Two resumes: 0..10, resume from 6 as 11 (rollback 4); 11..15 (positions 6..10), then resume from the
    # checkpoint of version 12 (position 7) as 16: rollback = position(15) - position(12) = 10 - 7 = 3.
    lineage = Lineage().resumed(11, 6, 10).resumed(16, 12, 15)
    assert lineage.points[-1] == ResumePoint(16, 7, 3)
    # at 16 (position 7), eta 0: version 15 (position 10) is 3 ahead, allowed 0 + 3; 10 (position 10) the same;
    # version 0 (position 0) is 7 behind: out
    assert not lineage.behind(16, 15, eta=0) and not lineage.behind(16, 10, eta=0)
    assert lineage.behind(16, 0, eta=0) and not lineage.behind(16, 4, eta=0)  # 4: position 4, 3 behind
    assert lineage.behind(16, 3, eta=0)  # position 3: 4 behind


def test_a_version_is_announced_when_every_engine_of_the_pool_has_it() -> None:
    assert may_announce({"a", "b"}, ["a", "b"], known=True)
    assert may_announce({"a"}, ["a", "b"], known=True)  # b rejoined during the sync: more is fine
    assert not may_announce({"a", "b"}, ["a"], known=True)  # b is in the pool and lacks it
    assert not may_announce(set(), [], known=True)  # every engine quarantined: nobody has it
    assert may_announce(set(), [], known=False)  # no engine at all: nobody to wait for


def test_admission_capacity_is_eta_plus_one_steps_of_groups() -> None:
    assert [admission_capacity(eta, 4) for eta in (0, 1, 3)] == [4, 8, 16]
    assert admission_capacity(2, 1) == 3
    with pytest.raises(ValueError, match="eta"):
        admission_capacity(-1, 4)
    with pytest.raises(ValueError, match="groups_per_step"):
        admission_capacity(1, 0)
