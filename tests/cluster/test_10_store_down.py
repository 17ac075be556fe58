"""The object store down: a pause stays on its node (not durable, with a
warning), and is stored once the store is back (its node tries again every
30 s)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from harness import Cluster, log


@pytest.fixture
def store_back(cluster: Cluster) -> Iterator[None]:
    """Whatever the test did, the store runs again after it."""
    yield
    if cluster.s3.proc is not None and cluster.s3.proc.poll() is not None:
        cluster.s3.start()


def test_a_pause_with_the_store_down_stays_and_is_stored_later(
    cluster: Cluster, store_back: None
) -> None:
    cluster.s3.kill()
    f = cluster.create(why="create with the object store down")
    cluster.sh(f, "cd && echo local > local.txt")
    answer = cluster.pause(f)
    said = answer.headers.get("x-sandfork-durable")
    assert said == "false", f"the pause of {f} with the store down says: {dict(answer.headers)}"
    route = cluster.route(f)
    assert '"paused"' not in route, f"the route of {f} records a durable pause: {route}"
    warning = f"sandbox {f}: its pause is not in the object store"
    assert warning in cluster.node_logs(), f"no warning for the pause of {f}"
    cluster.s3.start()
    start = time.monotonic()
    cluster.until_stored(f, f"the pause of {f} was not stored once the object store was back")
    stored_after = time.monotonic() - start
    cluster.cli("resume", f, why=f"resuming {f} on its node")
    assert cluster.sh(f, "cat ~/local.txt") == "local", f"{f} lost its file"
    cluster.rm(f)
    log.info("the pause of %s was stored %.0f s after the store came back", f, stored_after)
