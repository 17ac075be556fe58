"""A node cut off from etcd: only one copy serves. The node the durable
pause's section killed comes back, fresh, in the network namespace, with
three sandboxes; one paused durably. Its only link goes down: it
unregisters, what runs there answers "lost", a kill of one through the
gateway holds, and the paused one resumes and changes on another node. Once
the link is up again the node never serves its stale copy (a resume is
refused: the route is the other node's) and removes it, removes the killed
one, and serves its other running sandbox again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from harness import PREFIX, Cluster, Node, log, tail, wait_until


@dataclass
class Cut:
    node: Node
    e: str  # paused there, resumed elsewhere while it is cut off
    g: str  # running there
    k: str  # running there, killed while it is cut off
    e_to: str = ""


@pytest.fixture(scope="module")
def cut(cluster: Cluster) -> Iterator[Cut]:
    if not cluster.dead:  # (the durable pause's section did not get that far)
        cluster.kill_node("n1")
    node_id = sorted(cluster.dead)[0]
    node = cluster.start_cut_off_node(node_id)
    try:
        wait_until(
            lambda: healthy(cluster, node) and cluster.registered(node_id),
            800,
            f"{node_id} did not come back",
        )
    except AssertionError as e:
        raise AssertionError(f"{e}\n{tail(node.log_path)}") from None
    made = [cluster.create(url=node.api, why=f"create {i} on {node_id}") for i in (1, 2, 3)]
    scene = Cut(node, *made)
    yield scene
    cluster.cut.set_link(True)
    for sandbox in made:  # what a failed test left
        if cluster.route(sandbox):
            cluster.cli_run("rm", sandbox)


def healthy(cluster: Cluster, node: Node) -> bool:
    try:
        return cluster.http("GET", f"{node.api}/health", timeout=10).is_success
    except httpx.HTTPError:
        return False


def code_on_node(cluster: Cluster, node: Node, sandbox: str) -> int:
    return cluster.http("GET", f"{node.api}/sandboxes/{sandbox}").status_code


def test_cut_off_its_sandboxes_are_lost(cluster: Cluster, cut: Cut) -> None:
    node = cut.node.id
    cluster.sh(cut.e, "cd && echo before > state.txt")
    cluster.durable_pause(cut.e)
    cluster.cut.set_link(False)
    wait_until(
        lambda: not cluster.registered(node),
        30,
        f"node {node} is still registered with its link down",
        0.5,
    )
    # What runs there is out of reach meanwhile.
    answer = cluster.http("GET", f"{cluster.gateway}/sandboxes/{cut.g}")
    assert answer.status_code == 410 and "lost" in answer.text, (
        f"sandbox {cut.g} on the cut-off node: {answer.status_code} {answer.text}"
    )
    # A kill of a lost one through the gateway holds when its node is back.
    cluster.rm(cut.k)


def test_its_paused_sandbox_resumes_elsewhere(cluster: Cluster, cut: Cut) -> None:
    """Its pause is in the store: it resumes on another node and changes there."""
    cluster.cli("resume", cut.e, why=f"resuming {cut.e} while {cut.node.id} is cut off")
    cut.e_to = cluster.owner(cut.e)
    assert cut.e_to != cut.node.id, f"{cut.e} resumed on {cut.node.id}, which is cut off"
    out = cluster.sh(cut.e, "cd && cat state.txt && echo after > state.txt")
    assert "before" in out.splitlines(), f"{cut.e} lost its file on {cut.e_to}: {out!r}"


def test_back_it_removes_its_stale_copy(cluster: Cluster, cut: Cut) -> None:
    """Back, the node must not serve its old copy (a resume is refused: the
    route is the other node's) and removes it."""
    node, e = cut.node, cut.e
    assert cut.e_to, f"{e} was not resumed elsewhere"
    cluster.cut.set_link(True)
    deadline = time.monotonic() + 120
    while code_on_node(cluster, node, e) != 404:
        answer = cluster.http("POST", f"{node.api}/sandboxes/{e}/resume", {})
        assert not answer.is_success, f"{node.id} resumed its stale copy of {e}: {answer.text}"
        assert time.monotonic() < deadline, (
            f"{node.id} still holds its copy of {e}\n{tail(node.log_path, 20)}"
        )
        time.sleep(1)
    # its files go after its record (the kill's removal of the directory)
    while (node.data_dir / "sandboxes" / e).exists():
        assert time.monotonic() < deadline, f"{node.id} left the files of its stale copy of {e}"
        time.sleep(1)
    said = f"sandbox {e} is node {cut.e_to}'s now"
    assert said in node.log_path.read_text(), f"{node.id} did not say why it removed {e}"
    assert cluster.registered(node.id), f"{node.id} did not register again"
    on = cluster.owner(e)
    assert on == cut.e_to, f"{e} moved to {on} after the link came back"
    got = cluster.sh(e, "cat ~/state.txt")
    assert got == "after", f"{e} is not the copy on {cut.e_to}: {got!r}"


def test_back_it_serves_its_running_sandbox(cluster: Cluster, cut: Cut) -> None:
    """What ran there is its again, under its new lease."""
    wait_until(
        lambda: cluster.cli_run("exec", cut.g, "--", "echo", "back").stdout.strip() == "back",
        60,
        f"{cut.g} on {cut.node.id} is not reachable after the link came back",
    )


def test_back_the_killed_one_stays_killed(cluster: Cluster, cut: Cut) -> None:
    """The node removes its copy of the one killed meanwhile (and then its
    tombstone) instead of claiming it again."""

    def tombstones() -> list[str]:
        return cluster.etcd.keys(f"{PREFIX}/killed/")

    wait_until(
        lambda: code_on_node(cluster, cut.node, cut.k) == 404 and not tombstones(),
        60,
        lambda: (
            f"{cut.node.id} still holds {cut.k}, killed while it was cut off"
            f" (tombstones: {tombstones()})"
        ),
    )
    assert not cluster.etcd.exists(f"{PREFIX}/sandboxes/{cut.k}"), (
        f"{cut.k}, killed while {cut.node.id} was cut off, is mapped again"
    )


def test_kills_after_it_came_back(cluster: Cluster, cut: Cut) -> None:
    cluster.rm(cut.e, cut.g)
    assert not cluster.etcd.exists(f"{PREFIX}/sandboxes/{cut.g}"), (
        f"the kill of {cut.g} left its route"
    )
    log.info("%s cut off from etcd: only one copy of %s served", cut.node.id, cut.e)
