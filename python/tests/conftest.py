"""Tests marked ``node`` run against a real sandfork node, found as any E2B
user finds one (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY; scripts/rl-test.sh
sets them); without it they are skipped, the pure tests still run. Every
sandbox a test makes carries the run's metadata, and the session checks at
the end that none is left (a leak is a failure) and removes them."""

import os
import secrets
import tempfile

import pytest

# mini-swe-agent prints a banner and makes a config directory on import:
# quiet, and in a temporary directory rather than the user's.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="sandfork-mswea-"))

NODE = all(os.environ.get(v) for v in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"))
TEMPLATE = os.environ.get("SDK_TEST_TEMPLATE", "base")
RUN_ID = secrets.token_hex(4)
RUN_META = {"sdk_suite": "python-rl", "sdk_run": RUN_ID}


def pytest_collection_modifyitems(config, items):
    if NODE:
        return
    skip = pytest.mark.skip(
        reason="no sandfork node: set E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY"
    )
    for item in items:
        if "node" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend():
    return "asyncio"


def live_ids() -> list[str]:
    from e2b import Sandbox, SandboxQuery

    ids = []
    paginator = Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID}))
    while paginator.has_next:
        ids.extend(i.sandbox_id for i in paginator.next_items())
    return ids


@pytest.fixture
def no_leaks():
    """Fails the test if it left a sandbox of this run behind."""
    yield
    left = live_ids()
    for sid in left:
        from e2b import Sandbox

        Sandbox.kill(sid)
    assert not left, f"sandboxes left running: {left}"
