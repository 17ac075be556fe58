"""Shared fixtures: the server under test comes from the environment, as for
any E2B user (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY); scripts/sdk-test.sh
sets them. Every sandbox a test creates carries the run's metadata so the
session can kill whatever a failed test left behind."""

import os
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox, SandboxQuery

API_URL = os.environ.get("E2B_API_URL", "")
API_KEY = os.environ.get("E2B_API_KEY", "")
TEMPLATE = os.environ.get("SDK_TEST_TEMPLATE", "base")
RUN_ID = secrets.token_hex(4)
RUN_META = {"sdk_suite": "python", "sdk_run": RUN_ID}


def pytest_configure(config: pytest.Config) -> None:
    if not API_URL or not API_KEY or not os.environ.get("E2B_SANDBOX_URL"):
        raise pytest.UsageError(
            "set E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (scripts/sdk-test.sh does)"
        )


def create(**kwargs: Any) -> Sandbox:
    """Sandbox.create with the run's metadata merged in."""
    meta = dict(RUN_META)
    meta.update(kwargs.pop("metadata", {}) or {})
    kwargs.setdefault("timeout", 600)
    return Sandbox.create(TEMPLATE, metadata=meta, **kwargs)


def delete_template(name: str) -> None:
    httpx.delete(f"{API_URL}/templates/{name}", headers={"X-API-KEY": API_KEY}, timeout=120)


def last_build_status(name: str) -> dict[str, Any]:
    """The status of the template's last build, its reason when it failed."""
    h = {"X-API-KEY": API_KEY}
    t = httpx.get(f"{API_URL}/templates/{name}", headers=h, timeout=60).json()
    r = httpx.get(
        f"{API_URL}/templates/{t['templateID']}/builds/{t['buildID']}/status",
        headers=h,
        timeout=60,
    )
    status: dict[str, Any] = r.json()
    return status


@pytest.fixture(scope="session")
def api() -> Iterator[httpx.Client]:
    """Raw control-plane client, for routes and errors the SDK does not reach."""
    with httpx.Client(base_url=API_URL, headers={"X-API-KEY": API_KEY}, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    """One sandbox per test module (booting one in the lab is slow)."""
    sbx = create(envs={"SDK_SANDBOX_ENV": "from-create"})
    yield sbx
    sbx.kill()


@pytest.fixture(scope="session", autouse=True)
def _reap_leftovers() -> Iterator[None]:
    yield
    try:
        paginator = Sandbox.list(query=SandboxQuery(metadata={"sdk_run": RUN_ID}))
        while paginator.has_next:
            for info in paginator.next_items():
                Sandbox.kill(info.sandbox_id)
    except Exception as e:  # cleanup must not mask the real results
        print(f"cleanup of run {RUN_ID} failed: {e}")
