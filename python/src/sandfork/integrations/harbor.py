"""Harbor (``harbor run --env e2b``) with fork per group: each trial starts as
a fork of one set-up sandbox per task build, not as a create of its own.

``harbor run --env sandfork.integrations.harbor:ForkingE2B --plugin
sandfork.integrations.harbor:CloseTaskStates ...`` with the E2B variables
naming a node. Harbor builds each task's template as with ``--env e2b``; the
first trial of a build creates a sandbox from it, runs ``setup_commands``
(none here: a subclass of ``ForkingE2B`` in your own module names them, e.g.
a dependency install every trial would repeat) and keeps it paused (a
``TaskState``); that trial and every later one of the same build is a fork
of it, with a fresh seed. The plugin
removes the paused sandboxes when the job ends (without it they stay on the
node: ``metadata["sandfork.harbor.job"]`` names the job).

What a fork cannot take from Harbor's create: the trial's metadata (children
carry the set-up sandbox's, which names the job and the template) and the
startup environment (Harbor passes it to every command anyway). The network
policy is applied to each child after the fork, as Harbor's
``update_network`` would.

This overrides a private method of Harbor's (``E2BEnvironment._create_sandbox``,
as of 0.26.0): pin Harbor. Needs Python 3.12 or later (Harbor's).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from harbor.environments.e2b import E2BEnvironment

from ..env import Task
from ..group import TaskState


class ForkingE2B(E2BEnvironment):
    """Harbor's E2B environment whose trials are forks of one set-up
    sandbox per template build (see the module)."""

    # One set-up state per template build, shared by the job's trials (one
    # process, one event loop: Harbor runs its trials as tasks of one loop).
    states: ClassVar[dict[str, TaskState]] = {}
    _making: ClassVar[dict[str, asyncio.Lock]] = {}
    #: commands every trial of a task would repeat, run once in the set-up
    #: sandbox before it is kept (a checkout, a dependency install)
    setup_commands: ClassVar[tuple[str, ...]] = ()

    async def _create_sandbox(self) -> None:
        ref = self.template_ref
        lock = self._making.setdefault(ref, asyncio.Lock())
        async with lock:
            state = self.states.get(ref)
            if state is None:
                metadata = {"sandfork.harbor.template": ref}
                if self.job_id is not None:
                    metadata["sandfork.harbor.job"] = str(self.job_id)
                state = await TaskState.prepare(
                    Task("", setup=self.setup_commands) if self.setup_commands else None,
                    keep="paused",
                    template=ref,
                    metadata=metadata,
                    sandbox_timeout=self._sandbox_timeout_sec,
                )
                self.states[ref] = state
        (env,) = await state.group(1)
        child = env._live()
        self._sandbox = child
        # what Harbor's create would have asked (empty: the default, open)
        network = self._sandbox_network_update()
        if network:
            await child.update_network(network)


class CloseTaskStates:
    """A Harbor job plugin (``--plugin``): removes ``ForkingE2B``'s set-up
    sandboxes when the job ends."""

    def __init__(self, **kwargs: Any) -> None:
        del kwargs

    async def on_job_start(self, job: Any) -> None:
        del job

    async def on_job_end(self, job_result: Any) -> None:
        del job_result
        states = list(ForkingE2B.states.values())
        ForkingE2B.states.clear()
        ForkingE2B._making.clear()
        await asyncio.gather(*(s.close() for s in states))
