"""The reward process pool: real worker processes, real SIGKILL on timeout, the pool serving afterwards."""

from __future__ import annotations

import asyncio
import os

import pytest

from rollout_fleet.rewards import RewardFunctionError, RewardPool, SampleLength, normalize, overlong_penalty
from rollout_fleet.tasks import Prompt, get_task
from rollout_fleet.tasks.arithmetic import scratchpad
from rollout_fleet.workflows.base import Scorer
from tests import reward_fns

FNS = reward_fns.__name__
PROMPT = get_task("arithmetic").make_prompt(0, "test")
GOOD = scratchpad(PROMPT.metadata["a"], PROMPT.metadata["b"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child that has been reaped is gone; a zombie would still answer kill(0)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


@pytest.fixture
async def pool():
    async with RewardPool(workers=2, timeout_s=0.5, load_timeout_s=60) as p:
        yield p


async def test_task_verifier_by_name_returns_every_component(pool: RewardPool) -> None:
    right = await pool.score("arithmetic", PROMPT, GOOD)
    assert (right.status, right.reward, dict(right.components)) == (
        "ok",
        1.0,
        {"correct": 1.0, "format": 1.0},
    )
    wrong = await pool.score("arithmetic", PROMPT, GOOD[:-1] + str((int(GOOD[-1]) + 1) % 10))
    assert (wrong.status, wrong.reward, dict(wrong.components)) == (
        "ok",
        0.0,
        {"correct": 0.0, "format": 1.0},
    )
    weighted = await pool.score("arithmetic", PROMPT, "#" + PROMPT.answer, options={"format_weight": 0.1})
    assert weighted.reward == pytest.approx(1.0) and weighted.components["format"] == 0.0


async def test_custom_function_by_import_path_with_options_and_components(pool: RewardPool) -> None:
    result = await pool.score(f"{FNS}:length_reward", PROMPT, "x" + PROMPT.answer, options={"scale": 2.0})
    assert result.status == "ok" and result.error is None
    assert result.reward == 2.0
    assert dict(result.components) == {"hit": 1.0, "length": float(len(PROMPT.answer) + 1)}
    as_result = await pool.score(f"{FNS}:as_result", PROMPT, "")
    assert (as_result.reward, dict(as_result.components)) == (0.25, {"partial": 0.25})


async def test_hanging_function_is_killed_and_replaced_and_pool_keeps_serving(pool: RewardPool) -> None:
    served_by = await asyncio.gather(*(pool.score(f"{FNS}:pid", PROMPT, "") for _ in range(4)))
    before = set(pool.pids())
    assert {int(r.reward) for r in served_by} <= before
    result = await pool.score(f"{FNS}:hang", PROMPT, "")
    assert result.status == "timeout" and result.reward == 0.0 and result.components == {}
    assert "0.5 s" in result.error and "killed" in result.error
    killed = before - set(pool.pids())
    assert len(killed) == 1 and not alive(killed.pop())
    assert len(pool.pids()) == 2  # replaced at once, the pool is back to full strength
    after = await asyncio.gather(*(pool.score("arithmetic", PROMPT, GOOD) for _ in range(20)))
    assert [r.status for r in after] == ["ok"] * 20 and all(r.reward == 1.0 for r in after)
    assert pool.stats["timeout"] == 1 and pool.stats["restarts"] == 1


async def test_two_hangs_at_once_do_not_stall_other_requests() -> None:
    async with RewardPool(workers=3, timeout_s=0.5) as pool:
        hangs = [asyncio.create_task(pool.score(f"{FNS}:hang", PROMPT, "")) for _ in range(2)]
        await asyncio.sleep(0)
        quick = await asyncio.gather(*(pool.score("arithmetic", PROMPT, GOOD) for _ in range(10)))
        assert all(r.status == "ok" for r in quick)
        assert [r.status for r in await asyncio.gather(*hangs)] == ["timeout", "timeout"]
        assert (await pool.score("arithmetic", PROMPT, GOOD)).status == "ok"


async def test_raising_function_gives_error_with_message(pool: RewardPool) -> None:
    result = await pool.score(f"{FNS}:boom", PROMPT, "")
    assert result.status == "error" and result.reward == 0.0
    assert "RuntimeError" in result.error and f"verifier exploded on {PROMPT.prompt_id}" in result.error
    assert (await pool.score("arithmetic", PROMPT, GOOD)).reward == 1.0


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("nan_reward", "non-finite reward: nan"),
        ("inf_component", "non-finite component 'bonus': inf"),
        ("not_a_number", "reward = 'high', not a number"),
        ("NOT_CALLABLE", "not callable"),
        ("no_such_function", "has no attribute"),
    ],
)
async def test_unusable_rewards_are_errors_with_clear_messages(
    pool: RewardPool, fn: str, message: str
) -> None:
    result = await pool.score(f"{FNS}:{fn}", PROMPT, "")
    assert result.status == "error" and result.reward == 0.0 and result.components == {}
    assert message in result.error


async def test_unknown_task_name_is_an_error_not_a_crash(pool: RewardPool) -> None:
    result = await pool.score("no-such-task", PROMPT, "")
    assert result.status == "error" and "unknown task 'no-such-task'" in result.error


async def test_worker_that_dies_is_an_error_and_is_replaced(pool: RewardPool) -> None:
    result = await pool.score(f"{FNS}:die", PROMPT, "")
    assert result.status == "error" and "died (exit code 3)" in result.error
    assert len(pool.pids()) == 2
    assert (await pool.score("arithmetic", PROMPT, GOOD)).status == "ok"


async def test_cancelled_call_kills_the_busy_worker_so_no_late_answer_leaks(pool: RewardPool) -> None:
    call = asyncio.create_task(pool.score(f"{FNS}:hang", PROMPT, ""))
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    results = await asyncio.gather(
        *(pool.score(f"{FNS}:length_reward", PROMPT, PROMPT.answer) for _ in range(6))
    )
    assert [r.reward for r in results] == [1.0] * 6


async def test_worker_limits_torch_to_one_thread_and_spawn_works() -> None:
    async with RewardPool(workers=1, timeout_s=60, start_method="spawn") as pool:
        result = await pool.score(f"{FNS}:torch_threads", PROMPT, "")
    assert (result.status, result.reward) == ("ok", 1.0)


def test_bad_pool_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="start_method"):
        RewardPool(start_method="fork")
    with pytest.raises(ValueError, match="workers"):
        RewardPool(workers=0)


def test_normalize_accepts_numbers_mappings_and_results() -> None:
    assert normalize(1, "f") == (1.0, {})
    assert normalize({"reward": 0.5, "a": 1}, "f") == (0.5, {"a": 1.0})
    with pytest.raises(RewardFunctionError, match="without a 'reward' key"):
        normalize({"a": 1.0}, "f")
    with pytest.raises(RewardFunctionError, match="not a number"):
        normalize(True, "f")
    assert isinstance(PROMPT, Prompt)


async def test_memory_hog_hits_the_workers_address_space_limit() -> None:
    async with RewardPool(workers=1, timeout_s=30, max_memory_bytes=1 << 30) as pool:
        pid = pool.pids()[0]
        with open(f"/proc/{pid}/limits") as f:
            line = next(ln for ln in f if ln.startswith("Max address space"))
        assert line.split()[3] == str(1 << 30)
        result = await pool.score(f"{FNS}:memory_hog", PROMPT, "")
        assert result.status == "error" and "memory limit (1073741824 bytes)" in result.error
        assert pool.pids() == [pid]  # the worker survived its MemoryError and keeps serving
        assert (await pool.score("arithmetic", PROMPT, GOOD)).status == "ok"
    with pytest.raises(ValueError, match="max_memory_bytes"):
        RewardPool(max_memory_bytes=1000)


async def test_a_reward_function_gets_the_samples_length_when_it_names_it(pool: RewardPool) -> None:
    length = SampleLength(truncated=True, output_tokens=64, max_output_tokens=64)
    echoed = await pool.score(f"{FNS}:length_echo", PROMPT, "x", length=length)
    assert echoed.status == "ok", echoed.error
    assert dict(echoed.components) == {"truncated": 1.0, "output_tokens": 64.0, "max_output_tokens": 64.0}
    every = await pool.score(f"{FNS}:length_kwargs", PROMPT, "x", length=length)
    assert (every.reward, every.components["budget"]) == (3.0, 64.0)
    # a two-argument function (with its options) and a task's verifier keep working when the length is given
    old = await pool.score(f"{FNS}:length_reward", PROMPT, PROMPT.answer, {"scale": 2.0}, length)
    assert (old.status, old.reward) == ("ok", 2.0)
    task = await pool.score("arithmetic", PROMPT, GOOD, length=length)
    assert (task.status, task.reward) == ("ok", 1.0)
    # a function that asks for the length, scored without one (held-out evaluation): an error with the reason
    missing = await pool.score(f"{FNS}:length_echo", PROMPT, "x")
    assert missing.status == "error" and "output_tokens" in missing.error


def test_dapos_overlong_penalty_by_hand() -> None:
    # budget 100, buffer 20: free up to 80 tokens, then -1/20 a token, -factor at the budget
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (10, 80, 81, 90, 100)] == [0.0, 0.0, -0.05, -0.5, -1.0]
    assert overlong_penalty(100, 100, 20, 0.5) == -0.5 and overlong_penalty(100, 100, 0, 1.0) == 0.0


async def test_the_training_scorer_adds_the_overlong_component_to_a_verified_sample(pool: RewardPool) -> None:
    scorer = Scorer(pool, "arithmetic", {}, overlong_buffer=8, overlong_penalty_factor=1.0)
    cut = await scorer.score(PROMPT, GOOD, SampleLength(True, 64, 64))
    assert (cut.reward, dict(cut.components)) == (0.0, {"correct": 1.0, "format": 1.0, "overlong": -1.0})
    short = await scorer.score(PROMPT, GOOD, SampleLength(False, 10, 64))
    assert (short.reward, short.components["overlong"]) == (1.0, 0.0)
    failed = await Scorer(pool, f"{FNS}:boom", {}, 8).score(PROMPT, GOOD, SampleLength(True, 64, 64))
    assert (
        failed.status == "error" and "overlong" not in failed.components
    )  # an error stays an error, reward 0
    off = await Scorer(pool, "arithmetic", {}).score(PROMPT, GOOD, SampleLength(True, 64, 64))
    assert "overlong" not in off.components


def test_an_overlong_buffer_must_leave_room_below_the_budget() -> None:
    from common.configlib import ConfigError
    from streamrl.config import load

    with pytest.raises(ConfigError, match="reward.overlong_buffer = 64 must be below max_new_tokens = 64"):
        load(["--rollout.max_new_tokens=64", "--rollout.reward.overlong_buffer=64"])
