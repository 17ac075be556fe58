"""NeMo Gym's `e2b` sandbox provider, the real package (nemo-gym from PyPI,
pinned in requirements.txt), against a sandfork node, set up as its README
says: the package's own `configs/e2b.yaml` (which reads E2B_API_KEY,
E2B_API_URL and E2B_SANDBOX_URL) with the `template_map` its build helper
writes (`python -m nemo_gym.sandbox.providers.e2b.build --image ...`), and
sandboxes driven through NeMo Gym's `AsyncSandbox`, the object its agents use.

`FROM e2bdev/base` is the node's `base` template, so the build helper's image
needs no registry (tests send no traffic off the machine).

NeMo Gym sends the e2b SDK's control-plane requests through its own aiohttp
session, made from its global config on the first request: a process that
`gym env start` spawned finds that config in NEMO_GYM_CONFIG_DICT, a bare one
parses its own command line with Hydra, which fails on the build helper's
`--image` (nemo-gym 0.7.0). So the helper runs with NEMO_GYM_CONFIG_DICT=`{}`,
and this process gets the merged config there, as a spawned server would;
that session is bound to the event loop it was made on, so the rollouts share
one loop, as a server's do. Its provider needs e2b 2.52.1 or older
(requirements.txt says why).

Env: E2B_API_KEY and E2B_API_URL, with E2B_SANDBOX_URL, name the node
(scripts/frameworks-test.sh starts one).
"""

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import e2b
import pytest
from nemo_gym.sandbox import (  # type: ignore[import-untyped]
    AsyncSandbox,
    SandboxSpec,
    SandboxStatus,
    create_provider,
    resolve_provider_config,
    resolve_provider_metadata,
)
from nemo_gym.sandbox.providers.e2b import build as e2b_build  # type: ignore[import-untyped]
from omegaconf import OmegaConf

T = TypeVar("T")

# by module: the venv is built elsewhere and renamed, so its scripts' #! lines
# name a path that is gone
HELPER = (sys.executable, "-m", "nemo_gym.sandbox.providers.e2b.build")

IMAGE = "e2bdev/base"
# The variables that point NeMo Gym (through the e2b SDK) at the node.
E2B_VARIABLES = ("E2B_API_KEY", "E2B_API_URL", "E2B_DOMAIN", "E2B_SANDBOX_URL")
# where `gym env start` hands its servers the merged config
CONFIG_DICT_VARIABLE = "NEMO_GYM_CONFIG_DICT"
# The shipped provider config, as `gym env start --config ...` takes it.
SHIPPED_CONFIG = Path(e2b_build.__file__).resolve().parent / "configs" / "e2b.yaml"
# One template build in the lab: 20-60 s, more beside other lanes.
BUILD_TIMEOUT_S = 900
# A rollout's bound: the lab is 20-50x slower than hardware.
ROLLOUT_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.Runner]:
    """One event loop for the module's rollouts, as a Gym server has: NeMo
    Gym's aiohttp session, made on the first request, is bound to it."""
    with asyncio.Runner() as runner:
        yield runner


def run(loop: asyncio.Runner, make: Callable[[], Awaitable[T]]) -> T:
    """One coroutine to completion on the module's loop, bounded."""

    async def bounded() -> T:
        return await asyncio.wait_for(make(), ROLLOUT_TIMEOUT_S)

    return loop.run(bounded())


def helper_env() -> dict[str, str]:
    """This process's environment with only the E2B variables naming the node,
    and an empty NeMo Gym config (see the module's doc)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({k: os.environ[k] for k in E2B_VARIABLES if k in os.environ})
    env[CONFIG_DICT_VARIABLE] = "{}"
    return env


def build_helper(out: Path) -> subprocess.CompletedProcess[str]:
    """NeMo Gym's template build helper, as its README runs it."""
    return subprocess.run(
        [*HELPER, "--image", IMAGE, "--output", str(out)],
        env=helper_env(),
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def template_map(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The helper's `template_map` for IMAGE, built on the node."""
    if not os.environ.get("E2B_API_KEY") or not os.environ.get("E2B_API_URL"):
        pytest.fail("E2B_API_KEY and E2B_API_URL must name a node")
    out = tmp_path_factory.mktemp("nemo-gym") / "template_map.yaml"
    started = time.monotonic()
    done = build_helper(out)
    print(f"build helper: {time.monotonic() - started:.1f} s, exit {done.returncode}")
    assert done.returncode == 0, f"build helper failed:\n{done.stdout}\n{done.stderr}"
    loaded = OmegaConf.to_container(OmegaConf.load(out))
    assert isinstance(loaded, dict), f"{out}: {loaded!r}"
    mapping = loaded["template_map"]
    assert isinstance(mapping, dict), f"{out}: {loaded!r}"
    return {str(k): str(v) for k, v in mapping.items()}


@pytest.fixture(scope="module")
def sandbox_block(template_map: dict[str, str]) -> dict[str, Any]:
    """The merged config's `sandbox` block: the shipped e2b.yaml with the
    helper's mapping pasted under `create`, resolved as Hydra resolves it."""
    merged = OmegaConf.merge(
        OmegaConf.load(SHIPPED_CONFIG),
        {"sandbox": {"e2b": {"create": {"template_map": template_map}}}},
    )
    os.environ[CONFIG_DICT_VARIABLE] = OmegaConf.to_yaml(merged)
    resolved = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(resolved, dict)
    return {str(k): v for k, v in resolved.items()}


def provider_config(block: dict[str, Any]) -> dict[str, Any]:
    config = resolve_provider_config("sandbox", block)
    assert isinstance(config, dict)
    return config


def node_template(alias: str) -> dict[str, Any]:
    """The node's entry for a template (`GET /templates`, E2B's list)."""
    request = urllib.request.Request(
        os.environ["E2B_API_URL"].rstrip("/") + "/templates",
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        templates = json.load(answer)
    found = [t for t in templates if alias in t.get("aliases", []) + t.get("names", [])]
    assert len(found) == 1, f"{alias} in {templates}"
    entry = found[0]
    assert isinstance(entry, dict)
    return entry


def node_info(sandbox_id: str) -> Any:
    """What the node says of a sandbox (the e2b SDK's own call, not NeMo Gym's)."""
    return e2b.Sandbox.get_info(sandbox_id)


def test_the_build_helper_maps_the_image_and_finds_it_again(
    template_map: dict[str, str], tmp_path: Path
) -> None:
    alias = e2b_build.derive_alias(IMAGE)
    assert template_map == {IMAGE: alias}
    built = node_template(alias)
    assert (built["buildStatus"], built["cpuCount"], built["memoryMB"]) == (
        "ready",
        e2b_build.DEFAULT_CPU_COUNT,
        e2b_build.DEFAULT_MEMORY_MB,
    ), built
    # a second run finds the template by its alias and builds nothing
    started = time.monotonic()
    again = build_helper(tmp_path / "again.yaml")
    took = time.monotonic() - started
    assert again.returncode == 0, again.stderr
    assert OmegaConf.to_container(OmegaConf.load(tmp_path / "again.yaml")) == {
        "template_map": template_map
    }
    assert node_template(alias)["buildID"] == built["buildID"], "built again"
    print(f"second build helper run: {took:.1f} s")


def test_the_shipped_config_names_the_node(sandbox_block: dict[str, Any]) -> None:
    connection = provider_config(sandbox_block)["e2b"]["connection"]
    assert connection["api_key"] == os.environ["E2B_API_KEY"]
    assert connection["api_url"] == os.environ["E2B_API_URL"]
    assert connection["sandbox_url"] == os.environ.get("E2B_SANDBOX_URL")
    assert resolve_provider_metadata("sandbox", sandbox_block) == {"sandbox-api": "e2b"}


def test_a_rollout_runs_commands_and_files_and_is_killed(
    sandbox_block: dict[str, Any], loop: asyncio.Runner, tmp_path: Path
) -> None:
    """One rollout as an agent drives it: a sandbox from the mapped image with
    an environment, a working directory and a task file, commands (exit codes,
    stderr, a timeout), files both ways, a second process attaching by the
    serialized handle, and the kill."""
    config = provider_config(sandbox_block)
    metadata = {**resolve_provider_metadata("sandbox", sandbox_block), "rollout": "r-41"}
    spec = SandboxSpec(
        image=IMAGE,
        workdir="/tmp/task",
        env={"TASK_SEED": "41"},
        files={"/tmp/task/input.txt": "6 7\n"},
        metadata=metadata,
        ttl_s=900,
    )
    payload = bytes(range(256)) * 64
    (tmp_path / "payload.bin").write_bytes(payload)

    async def rollout() -> str:
        sandbox = AsyncSandbox(config, spec)
        await sandbox.start()
        try:
            sandbox_id = str(sandbox._handle.sandbox_id)
            assert await sandbox.status() == SandboxStatus.RUNNING

            info = await asyncio.to_thread(node_info, sandbox_id)
            assert info.template_id, info
            assert info.metadata == metadata, info.metadata

            first = await sandbox.exec("pwd; echo $TASK_SEED; cat input.txt")
            assert (first.return_code, first.stdout) == (0, "/tmp/task\n41\n6 7\n"), first

            solve = await sandbox.exec("read a b < input.txt && echo $((a * b)) > answer.txt")
            assert solve.return_code == 0, solve
            (tmp_path / "answer.txt").unlink(missing_ok=True)
            await sandbox.download("/tmp/task/answer.txt", tmp_path / "answer.txt")
            assert (tmp_path / "answer.txt").read_text() == "42\n"

            await sandbox.upload(tmp_path / "payload.bin", "/tmp/task/payload.bin")
            digest = await sandbox.exec("sha256sum payload.bin | cut -d' ' -f1")
            assert digest.stdout == hashlib.sha256(payload).hexdigest() + "\n", digest

            failed = await sandbox.exec("echo out; echo err >&2; exit 7")
            assert (failed.return_code, failed.stdout, failed.stderr) == (7, "out\n", "err\n")

            other = await sandbox.exec("pwd", cwd="/", env={"TASK_SEED": "0"})
            assert (other.return_code, other.stdout) == (0, "/\n"), other

            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await sandbox.exec("sleep 60", timeout_s=3)
            assert time.monotonic() - started < 45

            # another worker attaches by the serialized handle, sees the same files
            descriptor = await sandbox.serialize()
            assert descriptor == {"sandbox_id": sandbox_id, "workdir": "/tmp/task"}
            attached = await AsyncSandbox.connect(descriptor, provider=create_provider(config))
            try:
                seen = await attached.exec("cat answer.txt")
                assert (seen.return_code, seen.stdout) == (0, "42\n"), seen
            finally:
                await attached.disconnect()
            still = await sandbox.exec("true")
            assert still.return_code == 0
            return sandbox_id
        finally:
            await sandbox.stop()

    sandbox_id = run(loop, rollout)
    with pytest.raises(e2b.NotFoundException):
        node_info(sandbox_id)


def test_a_group_of_rollouts_shares_one_provider(
    sandbox_block: dict[str, Any], loop: asyncio.Runner
) -> None:
    """A rollout group as a resources server runs it: one provider, four
    sandboxes at once (two from the mapped image, two by the direct template
    name `base`), each with its own seed, all killed."""
    config = provider_config(sandbox_block)
    group = 4

    async def one(provider: Any, index: int) -> tuple[str, str]:
        image = IMAGE if index % 2 == 0 else "base"
        spec = SandboxSpec(image=image, env={"SEED": str(1000 + index)}, ttl_s=900)
        sandbox = AsyncSandbox(provider, spec, owns_provider=False)
        async with await sandbox.start():
            wrote = await sandbox.exec('echo "$SEED" > /tmp/seed && cat /tmp/seed')
            assert (wrote.return_code, wrote.stdout) == (0, f"{1000 + index}\n"), wrote
            return str(sandbox._handle.sandbox_id), str(wrote.stdout).strip()

    async def rollouts() -> list[tuple[str, str]]:
        provider = create_provider(config)
        try:
            return list(await asyncio.gather(*(one(provider, i) for i in range(group))))
        finally:
            await provider.aclose()

    results = run(loop, rollouts)
    assert [seed for _, seed in results] == [str(1000 + i) for i in range(group)]
    ids = [sandbox_id for sandbox_id, _ in results]
    assert len(set(ids)) == group, ids
    for sandbox_id in ids:
        with pytest.raises(e2b.NotFoundException):
            node_info(sandbox_id)
