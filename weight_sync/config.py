"""Config section owned by weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from broker.configlib import Section


class WeightSyncConfig(Section):
    """Moving weights from the learner's rank 0 to every engine."""

    group_name: str = Field("weight_update_group", description="Name (and store prefix) of the update group.")
    bucket_mb: int = Field(256, ge=1, description="Bucket size for the broadcast, MiB.")
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort", description="How engines pause during an update: abort, retract or in_place."
    )
    timeout_s: float = Field(120.0, gt=0, description="Timeout of every broadcast and update call, seconds.")
