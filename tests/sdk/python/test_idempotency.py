"""Idempotent creates (E2B's `Idempotency-Key`) and the retry advice
(`Retry-After`, `Should-Retry`) of the node's refusals, which the SDK's own
retry obeys."""

import os
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, API_URL, RUN_ID, RUN_META, TEMPLATE, create
from e2b import Sandbox, SandboxException

SCRIPTS = Path(__file__).resolve().parents[3] / "scripts"


def _key() -> str:
    return f"sdk-{uuid.uuid4()}"


def test_a_create_retried_with_its_key_returns_the_same_sandbox() -> None:
    key = _key()
    first = create(idempotency_key=key)
    try:
        again = create(idempotency_key=key)
        assert again.sandbox_id == first.sandbox_id
        # The replay's answer works as the first did (the same envd token).
        assert again.commands.run("echo same").stdout.strip() == "same"
        # The key with another request: E2B's 409, not a second sandbox.
        with pytest.raises(SandboxException) as e:
            create(idempotency_key=key, metadata={"changed": "yes"})
        assert "409" in str(e.value) and "different request" in str(e.value)
    finally:
        first.kill()


@pytest.mark.lifecycle
def test_a_create_retried_after_the_node_restarts_returns_the_same_sandbox() -> None:
    node_dir = os.environ.get("SDK_NODE_DIR")
    if not node_dir:
        pytest.skip("the node is not this run's (--server): it cannot be restarted here")
    key = _key()
    first = create(idempotency_key=key)
    try:
        subprocess.run([str(SCRIPTS / "node-restart.sh"), node_dir], check=True, timeout=900)
        again = create(idempotency_key=key)
        assert again.sandbox_id == first.sandbox_id
        with pytest.raises(SandboxException, match="different request"):
            create(idempotency_key=key, metadata={"changed": "yes"})
        # Whether the sandbox itself lived through the restart is another
        # matter (a node in the lab takes its VMs down with it): the replay,
        # as E2B's, answers what the first create answered either way.
    finally:
        first.kill()


def test_concurrent_replays_make_one_sandbox() -> None:
    key = _key()
    body = {"templateID": TEMPLATE, "timeout": 300, "metadata": RUN_META}

    def post() -> httpx.Response:
        return httpx.post(
            f"{API_URL}/v2/sandboxes",
            headers={"X-API-KEY": API_KEY, "Idempotency-Key": key},
            json=body,
            timeout=300,
        )

    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: post(), range(3)))
    try:
        assert [a.status_code for a in answers] == [201] * 3, [a.text for a in answers]
        assert answers[0].json() == answers[1].json() == answers[2].json()
    finally:
        for a in answers:
            if a.status_code == 201:
                Sandbox.kill(a.json()["sandboxID"])


def test_a_malformed_key_is_a_400_that_says_why(api: httpx.Client) -> None:
    # The SDK refuses such a key itself: sent raw.
    r = api.post(
        "/v2/sandboxes",
        # the run's metadata: a node that took it would have it reaped
        json={"templateID": TEMPLATE, "metadata": RUN_META},
        headers={"Idempotency-Key": "Not_A_Key"},
    )
    assert r.status_code == 400, r.text
    assert "Idempotency-Key" in r.json()["message"]


def test_a_team_at_its_limit_answers_retry_after_and_the_sdk_retry_gets_in(
    api: httpx.Client,
) -> None:
    r = api.post("/admin/teams", json={"name": f"sdk-limit-{RUN_ID}", "maxSandboxes": 1})
    assert r.status_code == 201, r.text
    team = r.json()["teamID"]
    r = api.post(f"/admin/teams/{team}/keys", json={"name": "sdk"})
    assert r.status_code == 201, r.text
    team_key = r.json()["key"]
    first = create(api_key=team_key)
    second: Sandbox | None = None
    try:
        refused = httpx.post(
            f"{API_URL}/v2/sandboxes",
            headers={"X-API-KEY": team_key},
            json={"templateID": TEMPLATE},
            timeout=60,
        )
        assert refused.status_code == 429, refused.text
        assert refused.headers.get("retry-after") == "1", refused.headers
        assert refused.headers.get("should-retry") == "true", refused.headers
        # Room frees a second from now; the SDK's retry (Retry-After: 1 s
        # apart) gets in then. Retries above the default 3: a lab's kill
        # can take seconds.
        threading.Timer(1.0, first.kill).start()
        second = create(api_key=team_key, retries=10)
        assert second.sandbox_id != first.sandbox_id
    finally:
        for sbx in (first, second):
            if sbx is not None:
                try:
                    sbx.kill()
                except Exception as e:  # cleanup must not mask the result
                    print(f"kill {sbx.sandbox_id}: {e}")
