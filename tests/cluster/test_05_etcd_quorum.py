"""etcd loses its quorum: two of the three members killed (SIGKILL). A
running sandbox still answers through both gateways (each routes by the map
it last had; its node answers for it); a create answers 503 (etcd failing is
the same on every node, so the gateway does not try each) and leaves nothing
behind. Once the members are back, creates work, the sandbox answers,
nothing was lost and every node is registered."""

from __future__ import annotations

import time

from harness import Cluster, log, wait_until


def held_by_nodes(cluster: Cluster) -> list[list[str]]:
    """What every node lists, asked directly (not through etcd)."""
    held = []
    for node in cluster.nodes.values():
        answer = cluster.http("GET", f"{node.api}/sandboxes")
        assert answer.is_success, f"{node.id}'s list: {answer.status_code} {answer.text}"
        held.append(sorted(s["sandboxID"] for s in answer.json()))
    return held


def test_quorum_lost_and_back(cluster: Cluster, etcd_members_back: None) -> None:
    q = cluster.create(why="create before the quorum loss")
    cluster.sh(q, "cd && echo kept > q.txt")
    mapped = cluster.routes()
    held_before = held_by_nodes(cluster)
    cluster.etcd.kill(1, 2)
    for gateway in cluster.gateways:
        got = cluster.sh(q, "cat ~/q.txt", url=gateway)
        assert got == "kept", f"{q} read {got!r} through {gateway} without an etcd quorum"
    start = time.monotonic()
    answer = cluster.http(
        "POST", f"{cluster.gateway}/sandboxes", {"templateID": "base", "timeout": 300}, timeout=120
    )
    took = time.monotonic() - start
    assert answer.status_code == 503, (
        f"a create without a quorum answered {answer.status_code}: {answer.text}"
    )
    assert "cluster state" in answer.text, f"the 503 of a create without a quorum: {answer.text}"
    held = held_by_nodes(cluster)
    assert held == held_before, (
        f"the nodes hold {held} after a create refused without a quorum, not {held_before}"
    )
    cluster.etcd.start(1)
    cluster.etcd.start(2)
    wait_until(cluster.etcd.leader, 60, "no etcd leader after the members came back")

    said = [""]  # the last failure, for the message

    def create() -> str:
        done = cluster.cli_run("create", "--timeout", "900")
        said[0] = done.stderr.strip()
        return done.stdout.strip() if done.returncode == 0 else ""

    back = wait_until(create, 60, lambda: f"no create after the quorum came back: {said[0]}", 2)

    # (a node whose lease ran out meanwhile registers anew and moves its
    # routes to the new lease within a reconcile)
    def answers() -> bool:
        done = cluster.cli_run("exec", q, "--", "sh", "-c", "cat ~/q.txt")
        said[0] = done.stderr.strip()
        return done.stdout.strip() == "kept"

    wait_until(answers, 60, lambda: f"{q} after the quorum came back: {said[0]}")
    routes = cluster.routes()
    assert routes == mapped + 1, (
        f"after the quorum loss {routes} sandboxes are mapped, not {mapped} + 1"
    )
    for n in ("n1", "n2", "n3"):
        assert cluster.registered(n), f"node {n} is not registered after the quorum came back"
    cluster.rm(q, back)
    log.info("etcd without a quorum: a create answered 503 in %.0f s and left nothing", took)
