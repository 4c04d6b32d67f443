"""rollout_fleet: engines (built-in and SGLang), routing, rollout workers, tasks and rewards."""
