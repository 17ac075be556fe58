"""Adapters for agent and RL frameworks, each imported on its own so that
none forces another's dependencies:

- ``sandfork.integrations.mini_swe_agent``: ``SandforkEnvironment``, a
  mini-swe-agent environment (``environment_class:`` takes its import path).
- ``sandfork.integrations.skyrl``: ``SandforkTextEnv``, a skyrl-gym
  ``BaseTextEnv`` registered as ``sandfork`` by ``register()``.

Frameworks that speak E2B already need no code (slime, Harbor's ``e2b``
environment type): see the package README.
"""
