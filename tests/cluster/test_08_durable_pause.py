"""A durable pause survives its node: a sandbox running a process is paused
(stored in the object store), its node killed with SIGKILL and its data dir
removed, and it resumes through the gateway on another node with its file
and process intact. One paused at its timeout (stored by its node's
reconciler) resumes elsewhere too; one running there, and one paused there
by choice only (`--local`: never stored), are lost with it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness import PREFIX, Cluster, elapsed_ms, log

# (in the guest user's home: commands run as E2B's `user`; the tick is
# renamed into place, so a read never finds it empty halfway through a write)
TICKING = (
    "cd && echo kept > kept.txt && setsid sh -c "
    '"while :; do date +%s%N > ~/tick.new && mv ~/tick.new ~/tick; sleep 0.2; done"'
    " </dev/null >/dev/null 2>&1 & echo $! > ~/loop.pid"
)


@dataclass
class Scene:
    c: str  # paused durably, resumed elsewhere
    loop: str  # the pid of the process running in c
    node: str  # c's node, killed
    ap: str = ""  # paused at its timeout
    running: str = ""  # lost with the node
    local: str = ""  # paused on the node only, lost with it


@pytest.fixture(scope="module")
def scene(cluster: Cluster) -> Iterator[Scene]:
    c = cluster.create(why="create for the pause")
    cluster.sh(c, TICKING)
    loop = cluster.sh(c, "sleep 1; cat ~/loop.pid")
    s = Scene(c, loop, cluster.owner(c))
    yield s
    for sandbox in [s.c, s.ap, s.running, s.local]:  # what a failed test left
        if sandbox and cluster.route(sandbox):
            cluster.cli_run("rm", sandbox)


def test_durable_pause_and_resume_on_its_node(
    cluster: Cluster, scene: Scene, bench: dict[str, float]
) -> None:
    """A durable pause and a resume on the same node, for comparison; then
    the second pause stores only what changed."""
    c = scene.c
    start = time.monotonic()
    cluster.durable_pause(c)
    bench["durable_pause_first_ms"] = elapsed_ms(start)
    start = time.monotonic()
    cluster.cli("resume", c, why=f"resuming {c} on {scene.node}")
    bench["same_node_resume_ms"] = elapsed_ms(start)
    on = cluster.owner(c)
    assert on == scene.node, f"{c} moved to {on} on a resume while {scene.node} lived"
    start = time.monotonic()
    cluster.durable_pause(c)
    bench["durable_pause_again_ms"] = elapsed_ms(start)
    log.info(
        "durable pause %d ms, resume on %s %d ms, pause again %d ms",
        bench["durable_pause_first_ms"], scene.node, bench["same_node_resume_ms"],
        bench["durable_pause_again_ms"],
    )  # fmt: skip
    route = cluster.route(c)
    assert '"paused"' in route, f"the route of {c} records no durable pause: {route}"


def test_a_pause_at_its_timeout_is_stored(cluster: Cluster, scene: Scene) -> None:
    """A sandbox paused at its timeout (no API call) is stored by its node."""
    on = cluster.nodes[scene.node].api
    scene.ap = cluster.cli(
        "create", "--auto-pause", "--timeout", "20", url=on, why=f"create with auto-pause on {on}"
    )
    cluster.sh(scene.ap, "cd && echo auto > auto.txt")
    start = time.monotonic()
    cluster.until_stored(scene.ap, f"the pause of {scene.ap} at its timeout was not stored")
    log.info(
        "%s paused at its timeout, stored %.0f s after the write",
        scene.ap,
        time.monotonic() - start,
    )


def test_a_local_pause_is_not_stored(cluster: Cluster, scene: Scene) -> None:
    on = cluster.nodes[scene.node].api
    scene.running = cluster.create(url=on, why=f"create on {scene.node}")
    scene.local = cluster.create(url=on, why=f"create on {scene.node}")
    answer = cluster.pause(scene.local, {"durable": False})
    said = answer.headers.get("x-sandfork-durable")
    assert said == "false", f"the local pause of {scene.local} says: {dict(answer.headers)}"
    time.sleep(5)  # two reconcile passes, which store what a pause left unstored
    route = cluster.route(scene.local)
    assert '"paused"' not in route, (
        f"the pause of {scene.local}, asked to stay, was stored: {route}"
    )


def lost(cluster: Cluster, sandbox: str) -> str:
    answer = cluster.http("GET", f"{cluster.gateway}/sandboxes/{sandbox}")
    return f"{answer.status_code} {answer.text}"


def test_its_node_killed_loses_what_was_only_there(cluster: Cluster, scene: Scene) -> None:
    assert scene.running and scene.local, "the sandboxes to lose were not made"
    log.info("killing %s (SIGKILL) and removing its data", scene.node)
    cluster.kill_node(scene.node)
    # The running one is lost: a clear answer, and a kill forgets it.
    said = lost(cluster, scene.running)
    assert said.startswith("410 ") and "lost" in said, f"{scene.running} on the dead node: {said}"
    nodes = json.loads(cluster.cli("nodes", "--json"))
    gone = [o["sandboxID"] for o in nodes["withoutNode"] if o["state"] == "lost"]
    assert scene.running in gone, f"sandfork nodes does not show {scene.running} lost: {nodes}"
    cluster.rm(scene.running)
    said = lost(cluster, scene.local)
    assert said.startswith("410 ") and "lost" in said, (
        f"{scene.local}, paused on the dead node only: {said}"
    )
    cluster.rm(scene.local)
    assert not cluster.etcd.exists(f"{PREFIX}/sandboxes/{scene.running}"), (
        f"the lost {scene.running} is still mapped"
    )


def test_resumed_on_another_node_with_its_file_and_process(
    cluster: Cluster, scene: Scene, bench: dict[str, float]
) -> None:
    c = scene.c
    assert scene.node in cluster.dead, f"{scene.node} was not killed"
    start = time.monotonic()
    cluster.cli("resume", c, why=f"resuming {c} through the gateway after its node died")
    bench["cross_node_resume_ms"] = elapsed_ms(start)
    to = cluster.owner(c)
    assert to != scene.node, f"{c} still on {scene.node}"
    assert cluster.sh(c, "cat ~/kept.txt") == "kept", f"the file in {c} is gone"
    still = cluster.sh(c, f"kill -0 {scene.loop} && echo alive")
    assert still == "alive", f"the process {scene.loop} in {c} is gone"
    first = int(cluster.sh(c, "cat ~/tick"))
    time.sleep(1)
    then = int(cluster.sh(c, "cat ~/tick"))
    assert then > first, f"the process in {c} does not run on ({first}, then {then})"
    cluster.rm(c)
    log.info("%s resumed on %s in %d ms", c, to, bench["cross_node_resume_ms"])


def test_paused_at_its_timeout_resumed_on_another_node(cluster: Cluster, scene: Scene) -> None:
    ap = scene.ap
    assert ap, "no sandbox paused at its timeout"
    cluster.cli("resume", ap, why=f"resuming {ap} (paused at its timeout) after its node died")
    to = cluster.owner(ap)
    assert to != scene.node, f"{ap} still on {scene.node}"
    assert cluster.sh(ap, "cat ~/auto.txt") == "auto", f"the file in {ap} is gone"
    cluster.rm(ap)
