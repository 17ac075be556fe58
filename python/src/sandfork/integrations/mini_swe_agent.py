"""A mini-swe-agent environment on a sandfork sandbox.

mini-swe-agent loads any environment class by import path, so a config
needs no code::

    environment:
      environment_class: sandfork.integrations.mini_swe_agent.SandforkEnvironment
      template: base
      cwd: /home/user
      timeout: 60

with ``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_API_KEY`` and
``E2B_VALIDATE_API_KEY=false`` pointing at the node (``sandfork.configure``).
It behaves as mini-swe-agent's own environments do: ``execute`` returns
``output`` (stdout, then stderr), ``returncode`` and ``exception_info``, and
raises mini-swe-agent's ``Submitted`` when a command's output starts with
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. Added: ``fork(n)``, ``n``
environments on forks of this one's sandbox (a tree search branches the
agent's messages itself), and ``close()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from e2b import CommandExitException

from ..sandbox import Sandbox

#: A command whose output starts with this line ends the episode.
SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class SandforkEnvironmentConfig:
    template: str = "base"
    #: where commands run unless ``execute`` is given a ``cwd``
    cwd: str = "/home/user"
    env: dict[str, str] = field(default_factory=dict)
    #: per command, in seconds
    timeout: int = 30
    #: the sandbox's lifetime, in seconds
    sandbox_timeout: int = 3600
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    #: run in this existing sandbox (resumed if paused) instead of a new one
    sandbox_id: str | None = None


class SandforkEnvironment:
    """mini-swe-agent's ``Environment`` protocol on a ``sandfork.Sandbox``."""

    def __init__(
        self,
        *,
        sandbox: Sandbox | None = None,
        config_class: type = SandforkEnvironmentConfig,
        **kwargs: Any,
    ) -> None:
        self.config = config_class(**kwargs)
        if sandbox is None:
            cfg = self.config
            if cfg.sandbox_id:
                sandbox = Sandbox.resume(cfg.sandbox_id, timeout=cfg.sandbox_timeout)
            else:
                sandbox = Sandbox.create(
                    cfg.template, timeout=cfg.sandbox_timeout, metadata=cfg.metadata, envs=cfg.env
                )
        self.sandbox: Sandbox = sandbox
        self._uname: dict[str, str] | None = None

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """Runs ``action["command"]`` in the sandbox."""
        command = action.get("command", "")
        cfg = self.config
        output: dict[str, Any]
        try:
            res = self.sandbox.commands.run(
                command,
                cwd=cwd or cfg.cwd,
                envs=cfg.env,
                user=cfg.user,
                timeout=timeout or cfg.timeout,
            )
            output = {"output": res.stdout + res.stderr, "returncode": res.exit_code}
            output["exception_info"] = ""
        except CommandExitException as e:
            output = {
                "output": (e.stdout or "") + (e.stderr or ""),
                "returncode": e.exit_code,
                "exception_info": "",
            }
        except Exception as e:  # a timeout or a lost sandbox: the agent sees it
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        _check_finished(output)
        return output

    def _guest_uname(self) -> dict[str, str]:
        """The guest's ``uname`` (mini-swe-agent's prompts name the system)."""
        if self._uname is None:
            res = self.sandbox.commands.run("uname -s; uname -n; uname -r; uname -v; uname -m")
            keys = ("system", "node", "release", "version", "machine")
            self._uname = dict(zip(keys, res.stdout.splitlines(), strict=False))
        return self._uname

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.config),
            **self._guest_uname(),
            "sandbox_id": self.sandbox.sandbox_id,
            **kwargs,
        }

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": dataclasses.asdict(self.config),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                    "sandbox_id": self.sandbox.sandbox_id,
                    "lineage": self.sandbox.lineage.to_dict(),
                }
            }
        }

    def fork(self, n: int) -> list[SandforkEnvironment]:
        """``n`` environments on forks of this sandbox, as it is now (call it
        between steps). All or ``sandfork.ForkError``."""
        kids = self.sandbox.fork_all(n, timeout=self.config.sandbox_timeout)
        out = []
        for k in kids:
            env = SandforkEnvironment(sandbox=k, config_class=type(self.config))
            env.config = dataclasses.replace(self.config, sandbox_id=k.sandbox_id)
            env._uname = self._uname
            out.append(env)
        return out

    def close(self) -> None:
        """Kills the sandbox."""
        self.sandbox.kill()


def _check_finished(output: dict[str, Any]) -> None:
    """Ends the episode as mini-swe-agent's own environments do."""
    lines = output.get("output", "").lstrip().splitlines(keepends=True)
    if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
        from minisweagent.exceptions import Submitted

        submission = "".join(lines[1:])
        raise Submitted(
            {
                "role": "exit",
                "content": submission,
                "extra": {"exit_status": "Submitted", "submission": submission},
            }
        )
