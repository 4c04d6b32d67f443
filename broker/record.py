"""The trajectory record, schema v1 (frozen) and v2 (multi-turn): one stream entry is one prompt group.

A group carries everything the learner needs to train on it without asking anyone else: the prompt and output
token ids exactly as the engine returned them (never re-tokenised), the engine's behaviour log-probs, the
policy version of every output token, a loss mask, the reward with its components and status, and enough ids
to recognise a duplicate (group ids are a deterministic function of run, epoch, prompt index and attempt).

Arrays are 1-D numpy arrays with the dtypes fixed by the schema (:data:`ARRAY_DTYPES`). Records decoded from
the stream hold read-only views of the received bytes (no copy); copy before mutating them.

:meth:`TrajectoryGroup.validate` runs before every write and after every read; it raises :class:`RecordError`
naming the field path (``samples[3].logprobs[17]``) and the offending value.

Schema v2 adds two per-sample fields for multi-turn (agentic) samples, and nothing else changes:

- ``turn_bounds`` (int32, 2 x turns): ``[start_0, end_0, start_1, end_1, ...]``, the half-open spans of
  ``output_ids`` the model generated, one per turn, in order and disjoint, the last ending at T. Between them
  lie observation and tool tokens (the environment's), whose loss mask is 0, whose log-prob is 0.0 and whose
  version is that of the turn that caused them. Empty for a single-turn sample.
- ``episode`` (dict[str, float]): the episode's counters (turns, tool calls, tool errors, observation tokens).

A group is written as v1 when none of its samples is multi-turn (so single-turn bytes equal v1 and the golden
v1 fixture still pins them) and as v2 otherwise; readers accept both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SCHEMA_V1, SCHEMA_V2 = 1, 2
SCHEMA_VERSION = SCHEMA_V2  # the newest; a group states the version it needs (schema_version_for)
KNOWN_SCHEMA_VERSIONS = frozenset({SCHEMA_V1, SCHEMA_V2})
FINISH_REASONS = ("stop", "length", "abort")
REWARD_STATUSES = ("ok", "timeout", "error")
# Engines compute log-probs in reduced precision; a token with probability ~1 can come back slightly above 0.
LOGPROB_EPS = 1e-3
INT32_MAX = 2**31 - 1

# Per-sample arrays and the dtype each one has on the wire and in memory (little-endian).
ARRAY_DTYPES: dict[str, np.dtype] = {
    "output_ids": np.dtype("<i4"),
    "logprobs": np.dtype("<f4"),
    "versions": np.dtype("<i4"),
    "loss_mask": np.dtype("u1"),
}
PROMPT_DTYPE = np.dtype("<i4")
TURN_BOUNDS_DTYPE = np.dtype("<i4")
_NO_TURNS = np.zeros(0, dtype=TURN_BOUNDS_DTYPE)
_NO_TURNS.flags.writeable = False


class RecordError(ValueError):
    """A record that does not satisfy schema v1. ``field`` is the path, ``value`` what was found there."""

    def __init__(self, field: str, value: Any, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        shown = repr(value)
        if len(shown) > 120:
            shown = shown[:117] + "..."
        super().__init__(f"{field} = {shown}: {reason}")


def schema_version_for(samples: list[Any]) -> int:
    """The schema version a group of these samples is written with: v2 if any is multi-turn, else v1."""
    for s in samples:
        if isinstance(s, Sample) and s.is_multi_turn():
            return SCHEMA_V2
    return SCHEMA_V1


def make_group_id(run_id: str, epoch: int, prompt_index: int, attempt: int) -> str:
    """The deterministic id of a prompt group: the same prompt of the same epoch and attempt gives the same id,
    so a group produced twice (a retried worker, a resubmission) is recognised as a duplicate."""
    return f"{run_id}:e{epoch}:p{prompt_index}:a{attempt}"


def as_array(value: Any, dtype: np.dtype, path: str) -> np.ndarray:
    """``value`` (a list or an array) as a 1-D array of ``dtype``; refuses lossy conversions (floats to ints,
    integers out of range, 2-D input) with a RecordError instead of silently changing the data."""
    if isinstance(value, np.ndarray) and value.dtype == dtype and value.ndim == 1:
        return value
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise RecordError(path, f"array of shape {arr.shape}", "must be 1-D")
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if dtype.kind in "iu":
        if arr.dtype.kind not in "iub":
            raise RecordError(path, f"array of {arr.dtype}", f"must hold integers ({dtype})")
        info = np.iinfo(dtype)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise RecordError(path, bad, f"out of range for {dtype}")
    elif arr.dtype.kind not in "iuf":
        raise RecordError(path, f"array of {arr.dtype}", f"must hold numbers ({dtype})")
    return arr.astype(dtype)


def _arrays_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    )


def _check_int(path: str, value: Any, minimum: int | None = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise RecordError(path, value, "must be an int")
    if minimum is not None and value < minimum:
        raise RecordError(path, value, f"must be >= {minimum}")
    if abs(value) > INT32_MAX:
        raise RecordError(path, value, "out of int32 range")


def _check_float(path: str, value: Any) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise RecordError(path, value, "must be a float")
    if not math.isfinite(value):
        raise RecordError(path, value, "must be finite")


def _check_str(path: str, value: Any, non_empty: bool = False) -> None:
    if not isinstance(value, str):
        raise RecordError(path, value, "must be a str")
    if non_empty and not value:
        raise RecordError(path, value, "must not be empty")


def _check_float_dict(path: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise RecordError(path, value, "must be a dict[str, float]")
    for key, item in value.items():
        _check_str(f"{path}.<key>", key, non_empty=True)
        _check_float(f"{path}[{key!r}]", item)


def _check_array(path: str, arr: Any, dtype: np.dtype) -> None:
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise RecordError(path, type(arr).__name__, f"must be a 1-D numpy array of {dtype}")
    if arr.dtype != dtype:
        raise RecordError(path, f"array of {arr.dtype}", f"dtype must be {dtype}")


_I4, _F4, _U1 = np.dtype("<i4"), np.dtype("<f4"), np.dtype("u1")
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # the ufuncs themselves: no Python wrapper per call


_NUMBER = frozenset({float, int})  # exact types: bool (an int subclass) is not a number here
_isfinite = math.isfinite


def _finite(x: Any) -> bool:
    return type(x) in _NUMBER and _isfinite(x)


def _finite_dict(d: Any) -> bool:
    if type(d) is not dict:
        return False
    for k, v in d.items():
        if type(k) is not str or not k or type(v) not in _NUMBER or not _isfinite(v):
            return False
    return True


def _first_bad(path: str, arr: np.ndarray, bad: np.ndarray, reason: str) -> None:
    """Raise naming the first index where the boolean mask ``bad`` (same shape as ``arr``) is set."""
    if bad.any():
        idx = int(np.flatnonzero(bad)[0])
        value = arr[idx].item()
        raise RecordError(f"{path}[{idx}]", value, reason)


@dataclass(eq=False)
class Sample:
    """One completion of a prompt group. Arrays have one entry per output token (length T)."""

    sample_index: int
    output_ids: np.ndarray  # (T,) int32: token ids exactly as the engine returned them
    logprobs: np.ndarray  # (T,) float32: behaviour log-prob of each output token under the sampling policy
    versions: np.ndarray  # (T,) int32: policy version that generated each token
    loss_mask: (
        np.ndarray
    )  # (T,) uint8: 1 = train on this token, 0 = masked (e.g. old-policy resubmitted prefix)
    finish_reason: str  # "stop" | "length" | "abort"
    truncated: bool
    reward: float
    reward_components: dict[str, float] = field(default_factory=dict)
    reward_status: str = "ok"  # "ok" | "timeout" | "error"
    reward_error: str = ""  # "" when ok
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled
    engine_id: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    num_resubmits: int = 0
    # schema v2: (2 x turns,) int32 [start, end) of each model turn in output_ids; empty = single-turn
    turn_bounds: np.ndarray = field(default_factory=lambda: _NO_TURNS)
    episode: dict[str, float] = field(default_factory=dict)  # schema v2: turns, tool_calls, tool_errors, ...

    def __post_init__(self) -> None:
        for name, dtype in ARRAY_DTYPES.items():
            setattr(self, name, as_array(getattr(self, name), dtype, name))
        self.turn_bounds = as_array(self.turn_bounds, TURN_BOUNDS_DTYPE, "turn_bounds")

    def is_multi_turn(self) -> bool:
        """Whether the sample needs schema v2 (turn bounds or episode counters)."""
        return bool(self.turn_bounds.shape[0]) or bool(self.episode)

    def turns(self) -> list[tuple[int, int]]:
        """The model's turns as (start, end) spans of output_ids; a single-turn sample is one span."""
        tb = self.turn_bounds
        if not tb.shape[0]:
            return [(0, self.num_tokens())]
        return [(int(tb[i]), int(tb[i + 1])) for i in range(0, tb.shape[0], 2)]

    def num_tokens(self) -> int:
        """Output tokens of this sample."""
        return int(self.output_ids.shape[0])

    def min_version(self) -> int:
        """Oldest policy version among this sample's tokens: what the staleness bound is checked against."""
        return int(self.versions.min())

    def max_version(self) -> int:
        return int(self.versions.max())

    def validate(self, path: str = "sample") -> None:
        """Raise RecordError naming ``path.field[index]`` for the first violation of schema v1."""
        if not self._valid_fast():
            self._validate_slow(path)

    def _valid_fast(self) -> bool:
        """True only if the sample is valid; cheap (no allocation, one reduction per array). It may say False
        for a valid sample, in which case the slow path decides: the slow path is the specification."""
        o, lp, v, m = self.output_ids, self.logprobs, self.versions, self.loss_mask
        if not (
            type(o) is np.ndarray
            and type(lp) is np.ndarray
            and type(v) is np.ndarray
            and type(m) is np.ndarray
            and o.dtype == _I4
            and lp.dtype == _F4
            and v.dtype == _I4
            and m.dtype == _U1
            and o.ndim == lp.ndim == v.ndim == m.ndim == 1
        ):
            return False
        n = o.shape[0]
        if not (n > 0 and lp.shape[0] == n and v.shape[0] == n and m.shape[0] == n):
            return False
        if (
            _MIN(o) < 0
            or _MIN(v) < 0
            or _MAX(m) > 1
            or not (_MIN(lp) > -math.inf and _MAX(lp) <= LOGPROB_EPS)
        ):
            return False  # NaN fails both comparisons
        si, tk, nr = self.sample_index, self.top_k, self.num_resubmits
        return (
            type(si) is int
            and 0 <= si <= INT32_MAX
            and self.finish_reason in FINISH_REASONS
            and type(self.truncated) is bool
            and _finite(self.reward)
            and _finite_dict(self.reward_components)
            and self.reward_status in REWARD_STATUSES
            and type(self.reward_error) is str
            and (self.reward_status == "ok") == (self.reward_error == "")
            and _finite(self.temperature)
            and self.temperature >= 0
            and _finite(self.top_p)
            and 0 < self.top_p <= 1
            and type(tk) is int
            and (tk == -1 or 1 <= tk <= INT32_MAX)
            and type(self.engine_id) is str
            and _finite_dict(self.timings)
            and type(nr) is int
            and 0 <= nr <= INT32_MAX
            and self.turn_bounds.shape[0] == 0
            and not self.episode
        )  # a multi-turn sample always takes the slow path: its turn structure is checked there

    def _validate_slow(self, path: str) -> None:
        _check_int(f"{path}.sample_index", self.sample_index)
        n = None
        for name, dtype in ARRAY_DTYPES.items():
            arr = getattr(self, name)
            _check_array(f"{path}.{name}", arr, dtype)
            if n is None:
                n = arr.shape[0]
                if n == 0:
                    raise RecordError(f"{path}.{name}", "[]", "must not be empty")
            elif arr.shape[0] != n:
                raise RecordError(
                    f"{path}.{name}", f"length {arr.shape[0]}", f"must equal len(output_ids) = {n}"
                )
        # Fast path: one reduction per array (min/max propagate NaN); masks only to locate a violation.
        if self.output_ids.min() < 0:
            _first_bad(f"{path}.output_ids", self.output_ids, self.output_ids < 0, "token ids must be >= 0")
        lp = self.logprobs
        lo, hi = lp.min(), lp.max()
        if not (np.isfinite(lo) and np.isfinite(hi) and hi <= LOGPROB_EPS):
            _first_bad(f"{path}.logprobs", lp, ~np.isfinite(lp), "log-probs must be finite")
            _first_bad(f"{path}.logprobs", lp, lp > LOGPROB_EPS, f"log-probs must be <= {LOGPROB_EPS}")
        if self.versions.min() < 0:
            _first_bad(f"{path}.versions", self.versions, self.versions < 0, "versions must be >= 0")
        if self.loss_mask.max() > 1:
            _first_bad(f"{path}.loss_mask", self.loss_mask, self.loss_mask > 1, "loss mask must be 0 or 1")
        self._validate_scalars(path)

    def _validate_scalars(self, path: str) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise RecordError(f"{path}.finish_reason", self.finish_reason, f"must be one of {FINISH_REASONS}")
        if not isinstance(self.truncated, bool):
            raise RecordError(f"{path}.truncated", self.truncated, "must be a bool")
        _check_float(f"{path}.reward", self.reward)
        _check_float_dict(f"{path}.reward_components", self.reward_components)
        if self.reward_status not in REWARD_STATUSES:
            raise RecordError(
                f"{path}.reward_status", self.reward_status, f"must be one of {REWARD_STATUSES}"
            )
        _check_str(f"{path}.reward_error", self.reward_error)
        if (self.reward_status == "ok") != (self.reward_error == ""):
            raise RecordError(
                f"{path}.reward_error", self.reward_error, "must be empty exactly when reward_status is 'ok'"
            )
        _check_float(f"{path}.temperature", self.temperature)
        if self.temperature < 0:
            raise RecordError(f"{path}.temperature", self.temperature, "must be >= 0")
        _check_float(f"{path}.top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise RecordError(f"{path}.top_p", self.top_p, "must be in (0, 1]")
        _check_int(f"{path}.top_k", self.top_k, minimum=None)
        if self.top_k == 0 or self.top_k < -1:
            raise RecordError(f"{path}.top_k", self.top_k, "must be -1 (disabled) or >= 1")
        _check_str(f"{path}.engine_id", self.engine_id)
        _check_float_dict(f"{path}.timings", self.timings)
        _check_int(f"{path}.num_resubmits", self.num_resubmits)
        self._validate_turns(path)

    def _validate_turns(self, path: str) -> None:
        tb = self.turn_bounds
        _check_array(f"{path}.turn_bounds", tb, TURN_BOUNDS_DTYPE)
        _check_float_dict(f"{path}.episode", self.episode)
        if not tb.shape[0]:
            return
        n = self.num_tokens()
        if tb.shape[0] % 2:
            raise RecordError(f"{path}.turn_bounds", f"length {tb.shape[0]}", "must hold (start, end) pairs")
        previous_end = 0
        for i in range(0, tb.shape[0], 2):
            start, end = int(tb[i]), int(tb[i + 1])
            if not previous_end <= start < end <= n:
                raise RecordError(
                    f"{path}.turn_bounds[{i}:{i + 2}]",
                    [start, end],
                    f"turns must be non-empty, ordered, disjoint spans within [{previous_end}, {n}]",
                )
            if start > previous_end or i == 0:
                gap = self.loss_mask[previous_end:start]
                if gap.shape[0] and gap.max() != 0:
                    where = previous_end + int(np.flatnonzero(gap)[0])
                    raise RecordError(
                        f"{path}.loss_mask[{where}]", 1, "observation tokens (between turns) must be masked"
                    )
            previous_end = end
        if previous_end != n:
            raise RecordError(
                f"{path}.turn_bounds[{tb.shape[0] - 1}]", previous_end, f"the last turn must end at T = {n}"
            )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True


@dataclass(eq=False)
class TrajectoryGroup:
    """All samples of one prompt: the unit of the stream, because group-relative advantages need the group."""

    run_id: str
    epoch: int
    prompt_index: int
    attempt: int
    prompt_id: str
    task: str
    prompt_ids: np.ndarray  # (P,) int32: prompt token ids as sent to the engine
    samples: list[Sample]
    worker_id: str = ""
    created_at: float = 0.0  # unix seconds
    extra: dict[str, str] = field(default_factory=dict)  # small free-form strings, e.g. the reference answer
    group_id: str = ""  # "" means make_group_id(run_id, epoch, prompt_index, attempt)
    schema_version: int = 0  # 0 means the version the samples need: 1 single-turn, 2 multi-turn

    def __post_init__(self) -> None:
        self.prompt_ids = as_array(self.prompt_ids, PROMPT_DTYPE, "prompt_ids")
        if self.schema_version == 0 and isinstance(self.samples, list):
            self.schema_version = schema_version_for(self.samples)
        if not self.group_id and isinstance(self.run_id, str):
            self.group_id = make_group_id(self.run_id, self.epoch, self.prompt_index, self.attempt)

    def min_version(self) -> int:
        """Oldest policy version of any token in the group (the group's staleness is set by it)."""
        return min(s.min_version() for s in self.samples)

    def max_version(self) -> int:
        return max(s.max_version() for s in self.samples)

    def num_tokens(self) -> int:
        """Output tokens over all samples (prompt tokens not counted)."""
        return sum(s.num_tokens() for s in self.samples)

    def validate(self) -> None:
        """Raise RecordError naming the field path and value of the first violation of schema v1."""
        if self.schema_version not in KNOWN_SCHEMA_VERSIONS:
            raise RecordError(
                "schema_version", self.schema_version, f"unknown; known: {sorted(KNOWN_SCHEMA_VERSIONS)}"
            )
        needed = schema_version_for(self.samples) if isinstance(self.samples, list) else SCHEMA_V1
        if needed > self.schema_version:
            raise RecordError(
                "schema_version",
                self.schema_version,
                f"multi-turn samples (turn_bounds) need schema v{needed}",
            )
        _check_str("run_id", self.run_id, non_empty=True)
        for name in ("epoch", "prompt_index", "attempt"):
            _check_int(name, getattr(self, name))
        expected = make_group_id(self.run_id, self.epoch, self.prompt_index, self.attempt)
        if self.group_id != expected:
            raise RecordError("group_id", self.group_id, f"must be make_group_id(...) = {expected!r}")
        _check_str("prompt_id", self.prompt_id, non_empty=True)
        _check_str("task", self.task)
        _check_array("prompt_ids", self.prompt_ids, PROMPT_DTYPE)
        if self.prompt_ids.shape[0] == 0:
            raise RecordError("prompt_ids", "[]", "must not be empty")
        _first_bad("prompt_ids", self.prompt_ids, self.prompt_ids < 0, "token ids must be >= 0")
        _check_str("worker_id", self.worker_id)
        _check_float("created_at", self.created_at)
        if not isinstance(self.extra, dict):
            raise RecordError("extra", self.extra, "must be a dict[str, str]")
        for key, value in self.extra.items():
            _check_str("extra.<key>", key, non_empty=True)
            _check_str(f"extra[{key!r}]", value)
        self._validate_samples()

    def _validate_samples(self) -> None:
        if not isinstance(self.samples, list) or not self.samples:
            raise RecordError("samples", self.samples, "must be a non-empty list of Sample")
        for i, sample in enumerate(self.samples):
            if type(sample) is not Sample:
                raise RecordError(f"samples[{i}]", type(sample).__name__, "must be a Sample")
            if not sample._valid_fast():
                sample._validate_slow(f"samples[{i}]")  # raises, naming the path
        indices = [s.sample_index for s in self.samples]
        if len(set(indices)) != len(indices):
            seen: set[int] = set()
            for i, index in enumerate(indices):
                if index in seen:
                    raise RecordError(f"samples[{i}].sample_index", index, "duplicate in group")
                seen.add(index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectoryGroup):
            return NotImplemented
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if name == "prompt_ids":
                if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and _arrays_equal(a, b)):
                    return False
            elif a != b:
                return False
        return True


def synthetic_group(
    rng: np.random.Generator,
    run_id: str = "run",
    prompt_index: int = 0,
    num_samples: int = 8,
    num_tokens: int = 64,
    prompt_len: int = 32,
    version: int = 0,
    epoch: int = 0,
    attempt: int = 0,
) -> TrajectoryGroup:
    """A valid group of random tokens with realistic shapes, for tests and benchmarks (never for training)."""
    samples = []
    for i in range(num_samples):
        n = num_tokens
        samples.append(
            Sample(
                sample_index=i,
                output_ids=rng.integers(0, 150_000, n, dtype=np.int32),
                logprobs=-rng.exponential(0.5, n).astype(np.float32),
                versions=np.full(n, version, dtype=np.int32),
                loss_mask=np.ones(n, dtype=np.uint8),
                finish_reason="stop" if i % 2 else "length",
                truncated=i % 2 == 0,
                reward=float(i % 2),
                reward_components={"correct": float(i % 2), "format": 1.0},
                temperature=1.0,
                top_p=1.0,
                top_k=-1,
                engine_id=f"engine-{i % 2}",
                timings={"generate_s": 0.5 + i, "reward_s": 0.01},
            )
        )
    return TrajectoryGroup(
        run_id=run_id,
        epoch=epoch,
        prompt_index=prompt_index,
        attempt=attempt,
        prompt_id=f"prompt-{prompt_index}",
        task="addition",
        prompt_ids=rng.integers(0, 150_000, prompt_len, dtype=np.int32),
        samples=samples,
        worker_id="worker-0",
        created_at=1_700_000_000.0 + prompt_index,
        extra={"answer": str(prompt_index)},
    )
