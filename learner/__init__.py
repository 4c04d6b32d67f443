"""learner: the FSDP2 trainer, staleness filter, advantages and losses, checkpoints."""
