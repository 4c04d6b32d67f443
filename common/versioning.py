"""The weight-version protocol, pure (no I/O): the one definition every role imports.

- A *policy version* is the number of optimizer steps' weights published so far (``broker.version`` keeps it in
  Redis). Engines carry it as their SGLang ``weight_version`` *label*: :func:`encode_label` writes it,
  :func:`decode_label` reads it back (SGLang's initial ``"default"`` is the initial policy, version 0).
- The *lineage* (:class:`Lineage`): which weights each version holds, as a position on the learner's line of
  optimizer updates. Versions are never reused, so a resume from a checkpoint publishes old weights under a new
  version; staleness is measured in positions, never in raw versions.
- *Behind-ness* (:meth:`Lineage.behind`): whether a version's weights are beyond the staleness bound ``eta`` of
  a reference version's. The learner drops tokens by it and the rollout workers keep engines out of routing
  by it, so both sides agree on what is too old.
- *Announcing* (:func:`may_announce`): a version is announced once every engine of the pool has it.
- *Admission capacity* (:func:`admission_capacity`): the groups that may be started beyond those consumed,
  ``(eta + 1) * groups_per_step``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_LABELS = frozenset({"default"})  # SGLang's label before any update: the initial policy, version 0
INITIAL_LABEL = "0"  # the label our own engines start with (the initial policy)


class LabelError(ValueError):
    """A ``weight_version`` label that is not a policy version."""


def encode_label(version: int) -> str:
    """The ``weight_version`` label of policy ``version`` (engines are labelled ``str(version)``)."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise LabelError(f"policy version {version!r}: must be an int >= 0")
    return str(version)


def decode_label(label: Any, where: str = "weight_version") -> int:
    """The policy version a ``weight_version`` label names (an int, or a string :func:`encode_label` wrote, or
    SGLang's ``"default"``: 0). Raises :class:`LabelError` naming ``where`` and the bad value."""
    if isinstance(label, bool):
        raise LabelError(f"{where} = {label!r}: not a policy version")
    if isinstance(label, int):
        value = label
    elif isinstance(label, str) and label in DEFAULT_LABELS:
        return 0
    elif isinstance(label, str) and label.strip().lstrip("-").isdigit():
        value = int(label)
    else:
        raise LabelError(
            f"{where} = {label!r}: not an int policy version (engines must be labelled str(version))"
        )
    if value < 0:
        raise LabelError(f"{where} = {label!r}: policy versions are >= 0")
    return value


def answer_version(answer: Mapping[str, Any], where: str = "weight_version") -> int:
    """The policy version an engine's answer (``GET /model_info``, a ``/generate`` ``meta_info``) reports in its
    ``weight_version``; an answer without one is from the initial policy."""
    return decode_label(answer.get("weight_version", "default"), where)


@dataclass(frozen=True)
class ResumePoint:
    """A resume: ``version`` was published with the weights of lineage position ``position`` (the checkpoint's),
    and the learner had reached ``rollback`` positions beyond them on the branch it lost."""

    version: int
    position: int
    rollback: int = 0


@dataclass(frozen=True)
class Lineage:
    """Which weights each policy version holds, as a position on the learner's line of optimizer updates.

    Without resumes a version's position is the version itself. A resume publishes a checkpoint's weights under
    a fresh version (versions are never reused), so the version number jumps while the weights go back:
    position(v) = p + (v - v_r) for the last resume point (v_r, p) at or below v. A version of the branch the
    crash lost keeps the position it had on that branch.

    Staleness is measured in positions, ``position(learner) - position(token)``, which is exactly
    ``learner_version - token_version`` in a run that never resumed. A resume that stops cleanly (its last
    checkpoint is its last step) loses nothing: the groups waiting in the stream are as stale as they were. A
    crash rolls the learner back to its last checkpoint; the groups generated before the resume on the branch
    it lost are valid off-policy data (the engines' log-probs are theirs), so they are kept as long as they
    are within ``eta`` plus that rollback, in either direction, of the weights being trained; groups generated
    after the resume are held to ``eta``."""

    points: tuple[ResumePoint, ...] = ()

    def _point(self, version: int) -> ResumePoint:
        below = [p for p in self.points if p.version <= version]
        return max(below, key=lambda p: p.version) if below else ResumePoint(0, 0)

    def position(self, version: int) -> int:
        """Where ``version``'s weights are on the learner's line of updates."""
        point = self._point(version)
        return point.position + (version - point.version)

    def distance(self, learner_version: int, token_version: int) -> int:
        """Signed staleness: updates from the token's weights to the learner's (negative: the token's branch
        is ahead of the weights the learner restored)."""
        return self.position(learner_version) - self.position(token_version)

    def allowance(self, learner_version: int, token_version: int) -> int:
        """Extra staleness a token is allowed: the rollback of the learner's latest resume, for tokens generated
        before it."""
        point = self._point(learner_version)
        return point.rollback if token_version < point.version else 0

    def behind(self, learner_version: int, version: int, eta: int) -> bool:
        """Whether ``version``'s weights are out of the staleness bound of ``learner_version``'s: more than
        ``eta`` (plus :meth:`allowance`) positions away, in either direction. A version above
        ``learner_version`` is never behind (the learner refuses such tokens as not yet published; an engine has
        a version before it is announced)."""
        if eta < 0:
            raise ValueError(f"eta = {eta} must be >= 0")
        if version > learner_version:
            return False
        d = self.distance(learner_version, version)
        bound = eta + self.allowance(learner_version, version)
        return d > bound or -d > bound

    def resumed(self, version: int, restored: int, published: int | None) -> Lineage:
        """The lineage after a resume that publishes the weights of checkpoint version ``restored`` as
        ``version``, the last published version before it being ``published``."""
        position = self.position(restored)
        lost = 0 if published is None else max(0, self.position(published) - position)
        return Lineage((*self.points, ResumePoint(version, position, lost)))


def may_announce(pool: Collection[str], reached: Collection[str], known: bool) -> bool:
    """Whether a synced version may be announced: every engine of the ``pool`` (the healthy ones) confirmed it
    (``reached``), and at least one did; with no engine ``known`` at all there is nobody to wait for (engines
    that register later get the current weights when they join)."""
    return set(pool) <= set(reached) and (bool(reached) or not known)


def admission_capacity(eta: int, groups_per_step: int) -> int:
    """``(eta + 1) * groups_per_step``: the groups that may be accepted or running beyond those the announced
    policy contains, so that a group started now is trained at most ``eta`` versions later."""
    if eta < 0:
        raise ValueError(f"eta = {eta} must be >= 0")
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step = {groups_per_step} must be >= 1")
    return (eta + 1) * groups_per_step
