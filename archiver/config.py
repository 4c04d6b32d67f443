"""The archiver's config section (``streamrl archive``). Every field carries a one-line doc that
``streamrl archive --help`` shows."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from common.config import SharedConfig
from common.configlib import Section


class ArchiveConfig(Section):
    """The trajectory archive (``streamrl archive``): every group of the stream, with its learner outcome, in
    Parquet files under the run directory."""

    enabled: bool = Field(
        True,
        description="Run the archiver under `streamrl up` (its consumer group holds entries until archived).",
    )
    dir: Path | None = Field(None, description="Directory of the Parquet parts; default RUN_DIR/archive.")
    part_bytes: int = Field(
        64 * 2**20, ge=1, description="Roll to a new Parquet part once this many bytes of rows are waiting."
    )
    flush_s: float = Field(
        30.0,
        gt=0,
        description="Longest a finished group waits in memory before its part is written, seconds.",
    )
    poll_s: float = Field(
        1.0,
        gt=0,
        description="The archiver reads the stream and the learner's outcomes once per this many seconds.",
    )
    read_count: int = Field(
        512, ge=1, description="Most entries the archiver reads from the stream in one round."
    )
    recent: int = Field(
        24, ge=0, description="Latest samples kept in Redis for the dashboard's live sample viewer (0: none)."
    )
    nice: int = Field(
        19,
        ge=0,
        le=19,
        description="Nice increment of the archiver process, so it never takes CPU from the learner.",
    )
    wandb_artifact: bool = Field(
        True,
        description="Add the archive to the run's wandb run as an artifact when the dashboard stops "
        "(learner.wandb_mode on).",
    )

    def directory(self, shared: SharedConfig) -> Path:
        """Where the parts are written."""
        return Path(self.dir) if self.dir is not None else Path(shared.run_dir) / "archive"
