"""Multi-turn (agentic) rollouts: the environment interface, the episode runner, tool calls and tools.

See :mod:`rollout_fleet.envs.base` for the contract and :mod:`rollout_fleet.envs.episode` for how an episode
becomes one token sequence with masks, versions and turn boundaries (record schema v2).
"""
