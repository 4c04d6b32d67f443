"""A rollout worker running the verifiers task, started by tests/test_verifiers.py in the verifiers virtualenv
(`.venv-verifiers`): ``python -m tests.vf_worker '{"model_dir": ..., "engine_url": ..., "redis_url": ...}'``.
It prints the worker's stats as one JSON line. The task config and the worker's settings are the ones every
worker test uses (tests/test_rollout_worker.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from rollout_fleet.envs.verifiers_env import VerifiersTask
from rollout_fleet.tasks.config import task_config
from tests.agentic_tasks import TURN_END
from tests.test_rollout_worker import configs, run_worker


class OneTokenTurns(VerifiersTask):
    """The verifiers task with every printable character ending a turn, so the untrained tiny model's turns are
    one token each and its episodes reach the environment (the task config has no such field)."""

    turn_end_tokens = TURN_END


def main() -> None:
    args = json.loads(sys.argv[1])
    task = task_config(name="tests.vf_worker:OneTokenTurns", **args["task"])
    shared, engine, rollout = configs(
        Path(args["model_dir"]), [args["engine_url"]], task=task, **args["rollout"]
    )
    stats = asyncio.run(run_worker(args["redis_url"], shared, engine, rollout))
    print(json.dumps({"finished": stats.finished, "turns": stats.turns, "episodes": stats.episodes}))


if __name__ == "__main__":
    main()
