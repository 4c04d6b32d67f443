"""``streamrl export RUN_DIR [--step N] [--out DIR]``: a Hugging Face directory of a run's policy, built offline
from one of its DCP checkpoints (no process group, no GPU), so the run itself never has to export."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.configlib import ConfigError, load_config
from streamrl.config import StreamRLConfig


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl export",
        description="Write a Hugging Face model directory (safetensors, config, tokenizer) of a run's policy at "
        "a checkpoint; LoRA adapters are merged into their base layers.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (holds config.toml and checkpoints/)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: the newest)")
    parser.add_argument(
        "--out", type=Path, default=None, help="where to write it (default: RUN_DIR/export/step-N)"
    )
    return parser


def run_config(run_dir: Path) -> StreamRLConfig:
    """The config a run's learner ran with: RUN_DIR/config.toml (``streamrl up``), else the one a standalone
    ``streamrl learner`` wrote (RUN_DIR/config.learner.toml)."""
    for name in ("config.toml", "config.learner.toml"):
        if (run_dir / name).is_file():
            return load_config(
                StreamRLConfig, ["--config", str(run_dir / name), f"--shared.run_dir={run_dir}"]
            )
    raise ConfigError(f"RUN_DIR = {str(run_dir)!r}: no config.toml or config.learner.toml there")


def main(args: list[str]) -> int:
    # here, not at the top: torch is not for run_config's callers (streamrl replay's launcher)
    from learner.checkpoint import checkpoint_of_step, export_checkpoint

    options = _parser().parse_args(args)
    run_dir = options.run_dir.resolve()
    try:
        config = run_config(run_dir)
        if config.shared.model_path is None:
            raise ConfigError(f"{run_dir / 'config.toml'}: shared.model_path is not set")
        checkpoint = checkpoint_of_step(run_dir / "checkpoints", options.step)
    except (ConfigError, ValueError) as exc:
        print(f"streamrl export: {exc}", file=sys.stderr)
        return 2
    meta = json.loads((checkpoint / "meta.json").read_text())
    out = options.out or run_dir / "export" / f"step-{meta['step']:06d}"
    started = time.monotonic()
    print(
        f"streamrl export: reading {checkpoint} (step {meta['step']}, policy version {meta['policy_version']})"
    )
    export_checkpoint(checkpoint, Path(config.shared.model_path), out, config.learner.lora)
    info = {"step": meta["step"], "policy_version": meta["policy_version"], "checkpoint": checkpoint.name}
    info["source"] = "checkpoint"  # not the learner's: its learner.keep_exports never deletes it
    (out / "export.json").write_text(json.dumps(info))
    print(f"streamrl export: wrote {out} in {time.monotonic() - started:.1f} s")
    return 0
