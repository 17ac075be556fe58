"""sandfork: branching E2B sandboxes for agentic RL.

``Sandbox`` / ``AsyncSandbox`` are the unmodified e2b SDK's classes plus
fork trees (lineage, ``fork_all``, ``after_fork``, checkpoints, suspend and
resume, capability fallbacks); ``SandboxEnv`` / ``SyncSandboxEnv`` are text
environments on them; ``sandfork.rollout`` runs a policy over a tree of
forks (fixed widths, Tree-GRPO's expansion, or a callback);
``TaskState`` sets a task up once and forks every rollout group from it
(running, paused or a snapshot); ``sandfork.gym`` (extra ``gym``) is the
Gymnasium wrapper.
"""

from __future__ import annotations

import os

from ._common import Capabilities, Checkpoint, ForkError, Strategy, reseed
from ._lineage import LINEAGE_PATH, SEED_PATH, Lineage
from .env import (
    EnvConfig,
    EpisodeState,
    Reward,
    SandboxEnv,
    StepContext,
    StepResult,
    SyncSandboxEnv,
    Task,
    Transition,
)
from .group import SEED_ENV, Keep, TaskState, group_seeds
from .rollout import (
    Action,
    BranchingRunner,
    FixedSchedule,
    Node,
    PolicyInput,
    Trajectory,
    TrajectoryTree,
    TreeGRPOSchedule,
)
from .sandbox import Sandbox
from .sandbox_async import AsyncSandbox

__version__ = "0.1.0"


def configure(api_url: str, api_key: str, *, validate_api_key: bool = False) -> None:
    """Points every E2B client in this process (and libraries built on the
    SDK) at a sandfork node: sets ``E2B_API_URL``, ``E2B_SANDBOX_URL``,
    ``E2B_API_KEY`` and ``E2B_VALIDATE_API_KEY``."""
    os.environ["E2B_API_URL"] = api_url
    os.environ["E2B_SANDBOX_URL"] = api_url
    os.environ["E2B_API_KEY"] = api_key
    os.environ["E2B_VALIDATE_API_KEY"] = "true" if validate_api_key else "false"


__all__ = [
    "LINEAGE_PATH",
    "SEED_ENV",
    "SEED_PATH",
    "Action",
    "AsyncSandbox",
    "BranchingRunner",
    "Capabilities",
    "Checkpoint",
    "EnvConfig",
    "EpisodeState",
    "FixedSchedule",
    "ForkError",
    "Keep",
    "Lineage",
    "Node",
    "PolicyInput",
    "Reward",
    "Sandbox",
    "SandboxEnv",
    "StepContext",
    "StepResult",
    "Strategy",
    "SyncSandboxEnv",
    "Task",
    "TaskState",
    "Trajectory",
    "TrajectoryTree",
    "Transition",
    "TreeGRPOSchedule",
    "__version__",
    "configure",
    "group_seeds",
    "reseed",
]
