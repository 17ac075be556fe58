"""A Gymnasium environment on a sandbox (``pip install sandfork[gym]``).

Importing this module registers ``sandfork/Shell-v0``; without an import
first, ``gymnasium.make("sandfork.gym:sandfork/Shell-v0")`` does both.
Observations and actions are ``spaces.Text`` over printable ASCII; output
outside it is shown as ``?``. Extensions beyond the Gymnasium API (which has
no clone or restore): ``fork(n)``, ``get_state()`` and ``set_state(state)``.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any, SupportsFloat

import gymnasium
from gymnasium import spaces

from ._common import Checkpoint
from .env import EnvConfig, SyncSandboxEnv, Task

#: The characters of both text spaces.
CHARSET = string.printable

ENV_ID = "sandfork/Shell-v0"

_ALLOWED = frozenset(CHARSET)


def to_charset(text: str) -> str:
    return "".join(c if c in _ALLOWED else "?" for c in text)


class SandboxGymEnv(gymnasium.Env[str, str]):
    """A shell episode: ``reset`` starts a sandbox for a task (from
    ``options={"task": ...}``, else one of ``tasks`` picked with the reset
    seed, else ``task``), ``step(command)`` runs it."""

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}  # noqa: RUF012 (Gymnasium's shape)

    def __init__(
        self,
        task: str | Task | None = None,
        *,
        tasks: Sequence[str | Task] | None = None,
        render_mode: str | None = None,
        max_action_chars: int = 4096,
        config: EnvConfig | None = None,
        **options: Any,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}")
        self.render_mode = render_mode
        self.env = SyncSandboxEnv(config, **options)
        self.task = task
        self.tasks = list(tasks or [])
        self.max_observation_chars = self.env.config.max_observation_chars
        self.max_action_chars = max_action_chars
        self.observation_space = spaces.Text(
            max_length=self.max_observation_chars, min_length=0, charset=CHARSET
        )
        self.action_space = spaces.Text(max_length=max_action_chars, min_length=1, charset=CHARSET)
        self._last = ""

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        task = (options or {}).get("task")
        if task is None and self.tasks:
            task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        if task is None:
            task = self.task
        obs, info = self.env.reset(task, seed=seed)
        self._last = to_charset(obs)[: self.max_observation_chars]
        return self._last, info

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        r = self.env.step(action)
        self._last = to_charset(r.observation)
        return self._last, float(r.reward), r.terminated, r.truncated, r.info

    def render(self) -> str | None:
        return self._last if self.render_mode == "ansi" else None

    def close(self) -> None:
        self.env.close()

    # --- extensions ---------------------------------------------------------

    def fork(self, n: int) -> list[SandboxGymEnv]:
        """``n`` copies of this environment at this step."""
        out = []
        for child in self.env.fork(n):
            g = SandboxGymEnv(
                self.task,
                tasks=self.tasks,
                render_mode=self.render_mode,
                max_action_chars=self.max_action_chars,
                config=self.env.config,
            )
            g.env = child
            g._last = self._last
            out.append(g)
        return out

    def get_state(self) -> Checkpoint:
        """A checkpoint of the sandbox and the episode."""
        return self.env.checkpoint()

    def set_state(self, state: Checkpoint) -> None:
        """Back to a checkpoint from ``get_state``."""
        self.env.restore(state)
        hist = self.env.state.history
        self._last = to_charset(hist[-1].observation) if hist else ""


def register() -> None:
    """Registers ``sandfork/Shell-v0`` (idempotent)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="sandfork.gym:SandboxGymEnv")


register()
