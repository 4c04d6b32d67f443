"""Rollout workflows: how a worker turns a leased prompt into a group of scored samples.

The worker shell (:mod:`rollout_fleet.worker`) leases, renews, produces and reports; a workflow generates. Every
workflow reaches the engines through one :class:`~rollout_fleet.workflows.session.EngineSession`, which owns the
HTTP calls, retries and resubmission.

:data:`WORKFLOWS` is the registry, keyed by the kind :func:`workflow_kind` reads off the task (today: a
multi-turn :class:`~rollout_fleet.envs.base.EnvironmentTask` runs episodes, every other task single turns).
Adding a workflow is one module with its :class:`~rollout_fleet.workflows.base.GroupWorkflow` subclass and its
line here.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_fleet.envs.base import is_multi_turn
from rollout_fleet.generate_client import SamplingConfig
from rollout_fleet.router import Router
from rollout_fleet.tasks import Task
from rollout_fleet.workflows.base import GroupWorkflow, WorkflowContext
from rollout_fleet.workflows.multi_turn import EpisodeWorkflow
from rollout_fleet.workflows.session import EngineSession, PublishedVersion
from rollout_fleet.workflows.single_turn import SingleTurnWorkflow

WORKFLOWS: dict[str, type[GroupWorkflow]] = {
    "single_turn": SingleTurnWorkflow,
    "episode": EpisodeWorkflow,
}


def workflow_kind(task: Task) -> str:
    """The registry key of the workflow that runs ``task``'s samples."""
    return "episode" if is_multi_turn(task) else "single_turn"


def build_workflow(
    context: WorkflowContext,
    router: Router,
    versions: PublishedVersion,
    adapter_name: Callable[[int], str] | None = None,
) -> GroupWorkflow:
    """The task's workflow over an engine session of its own sampling parameters (its stop tokens)."""
    kind = WORKFLOWS[workflow_kind(context.task)]
    rollout = context.rollout
    stops = set(rollout.stop_token_ids) | kind.stop_ids(context.task, context.tokenizer)
    sampling = SamplingConfig(rollout.temperature, rollout.top_p, rollout.top_k, tuple(sorted(stops)))
    session = EngineSession(
        router, sampling, context.stats, versions, rollout.max_request_failures, adapter_name
    )
    return kind(context, session)
