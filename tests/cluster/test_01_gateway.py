"""Through the gateway on 3 nodes: create, exec, ls and kill; and a named
snapshot made on one node, found by the gateway for every request naming
it, taken in by name from the object store by a create straight to another
node, creates from it placed on the nodes that have it, deleted
everywhere."""

from __future__ import annotations

import random
import statistics
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from harness import PREFIX, Cluster, log, tls_wanted, wait_until


@dataclass
class Pair:
    a: str
    b: str
    oa: str
    ob: str


@pytest.fixture(scope="module")
def pair(cluster: Cluster) -> Iterator[Pair]:
    """Two creates through the gateway. They live through the timings, the
    snapshot and its forks: on a busy lab that took longer than the default
    300 s once (a's kill found it gone)."""
    a = cluster.create(why="create through the gateway")
    b = cluster.create(why="second create through the gateway")
    oa, ob = cluster.owner(a), cluster.owner(b)
    log.info("%s on %s, %s on %s", a, oa, b, ob)
    yield Pair(a, b, oa, ob)
    for sandbox in (a, b):  # what a failed test left
        if cluster.route(sandbox):
            cluster.cli_run("rm", sandbox)


@dataclass
class Snapshot:
    id: str
    name: str
    maker: str  # the node it was taken on
    other: str  # the node that takes it in by name
    third: str  # the node that never has it


@pytest.fixture(scope="module")
def snapshot(cluster: Cluster, pair: Pair) -> Iterator[Snapshot]:
    """A named snapshot of b, with a file written before it."""
    cluster.sh(pair.b, "cd && echo snapped > snap.txt")
    name = f"warm-{random.randrange(1 << 30)}"
    snap = cluster.cli("snapshot", pair.b, "--name", name, why=f"snapshot of {pair.b}")
    other = pair.oa if pair.oa != pair.ob else "n1"
    third = next(n for n in ("n1", "n2", "n3") if n not in (pair.ob, other))
    yield Snapshot(snap, name, pair.ob, other, third)
    # (what a failed test left; a 404 once the delete's test passed)
    cluster.http("DELETE", f"{cluster.gateway}/templates/{snap}")


def test_three_nodes_registered(cluster: Cluster) -> None:
    registered = cluster.etcd.keys(f"{PREFIX}/nodes/")
    assert len(registered) == 3, f"nodes registered: {registered}, expected 3"


def test_creates_placed_on_different_nodes(pair: Pair) -> None:
    # Placement by free capacity (the gateway counts what it placed until
    # the node's published load shows it).
    assert pair.oa != pair.ob, f"both sandboxes on {pair.oa}"


def exec_ms(cluster: Cluster, sandbox: str, url: str) -> float:
    """The median of 15 whole `sandfork exec`s of `true`."""
    took = []
    for _ in range(15):
        start = time.monotonic()
        done = cluster.cli_run("exec", sandbox, "--", "true", url=url)
        assert done.returncode == 0, f"timing commands through {url}: {done.stderr}"
        took.append((time.monotonic() - start) * 1000)
    return round(statistics.median(took), 1)


def test_exec_through_the_gateway(cluster: Cluster, pair: Pair, bench: dict[str, float]) -> None:
    for sandbox in (pair.a, pair.b):
        out = cluster.cli("exec", sandbox, "--", "echo", f"hello from {sandbox}")
        assert out == f"hello from {sandbox}", f"exec in {sandbox} printed {out!r}"
    # What the gateway adds to a command: through it, and straight to the node.
    via = exec_ms(cluster, pair.a, cluster.gateway)
    direct = exec_ms(cluster, pair.a, cluster.nodes[pair.oa].api)
    bench["gateway_exec_ms"] = via
    bench["direct_exec_ms"] = direct
    log.info(
        "a command in %s: %s ms through the gateway, %s ms straight to %s (medians of 15)",
        pair.a, via, direct, pair.oa,
    )  # fmt: skip


def test_ls_through_the_gateway(cluster: Cluster, pair: Pair) -> None:
    listed = cluster.cli("ls")
    for sandbox in (pair.a, pair.b):
        assert sandbox in listed, f"ls through the gateway lacks {sandbox}: {listed}"


def test_snapshot_listed_once_and_forked_on_its_node(cluster: Cluster, snapshot: Snapshot) -> None:
    snap, maker = snapshot.id, snapshot.maker
    answer = cluster.http("GET", f"{cluster.gateway}/snapshots")
    ids = [s["snapshotID"] for s in answer.json()]
    assert ids.count(snap) == 1, f"the gateway's snapshot list does not show {snap} once: {ids}"
    # Nodes publish the templates they have (a snapshot is one): requests
    # about it go to them first, so its forks run on its maker, which need
    # not take it in.
    wait_until(
        lambda: cluster.has_template(maker, snap) and cluster.has_template(maker, snapshot.name),
        30,
        f"{maker} does not publish that it has {snap} ({snapshot.name})",
    )
    for i in (1, 2):
        answer = cluster.http("POST", f"{cluster.gateway}/snapshots/{snap}/fork", {"count": 1})
        assert answer.is_success, f"fork {i} of snapshot {snap}: {answer.status_code} {answer.text}"
        child = answer.json()[0]["sandbox"]["sandboxID"]
        on = cluster.owner(child)
        assert on == maker, f"a fork of {snap} (on {maker}) ran on {on}"
        out = cluster.cli("exec", child, "--", "echo", f"child {i}")
        assert out == f"child {i}", f"exec in {child} printed {out!r}"
        cluster.rm(child)


def test_snapshot_taken_in_by_name(cluster: Cluster, snapshot: Snapshot) -> None:
    """A create from its name straight to another node takes it in from the
    store (found by the name) and sees the file written before it."""
    snap, other = snapshot.id, snapshot.other
    wait_until(
        lambda: cluster.s3.status(f"templates/{snap}.json") == 200,
        300,
        f"snapshot {snap} is not in the object store",
    )
    code = cluster.s3.status(f"template-names/{snapshot.name}.json")
    assert code == 200, f"the object store has no index of the name {snapshot.name} ({code})"
    taken = cluster.cli(
        "create", snapshot.name, "--timeout", "300", url=cluster.nodes[other].api,
        why=f"create from {snapshot.name} straight to {other} (its maker: {snapshot.maker})",
    )  # fmt: skip
    on = cluster.owner(taken)
    assert on == other, f"{taken} is on {on}, not {other}"
    got = cluster.sh(taken, "cat ~/snap.txt")
    assert got == "snapped", f"{taken} (from {snapshot.name}, taken in on {other}) read {got!r}"
    said = f"template {snap} taken in from node {snapshot.maker}"
    assert said in cluster.nodes[other].log_path.read_text(), (
        f"{other} does not say it took {snap} in"
    )
    cluster.rm(taken)


def test_creates_from_the_name_go_where_it_is(cluster: Cluster, snapshot: Snapshot) -> None:
    """To its maker and the node that took it in, not the third (freer: a
    and b run on the others), until those are clearly fuller."""
    name, have, third = snapshot.name, (snapshot.maker, snapshot.other), snapshot.third
    wait_until(
        lambda: all(cluster.has_template(n, name) for n in have),
        30,
        f"{' and '.join(have)} do not publish that they have {name}",
    )
    assert not cluster.has_template(third, name), f"{third} publishes {name}, never taken in"
    made = [
        cluster.cli("create", name, "--timeout", "300", why=f"create {i} from {name}")
        for i in (1, 2)
    ]
    for sandbox in made:
        on = cluster.owner(sandbox)
        assert on != third, f"a create from {name} went to {third}, which lacks it ({have} have it)"
    cluster.rm(*made)


def test_snapshot_deleted_everywhere(cluster: Cluster, snapshot: Snapshot) -> None:
    """A delete through the gateway reaches both copies and the store's."""
    snap = snapshot.id
    answer = cluster.http("DELETE", f"{cluster.gateway}/templates/{snap}")
    assert answer.is_success, f"delete of {snap}: {answer.status_code} {answer.text}"
    for node in cluster.nodes.values():
        code = cluster.http("GET", f"{node.api}/templates/{snap}").status_code
        assert code == 404, f"{node.id} answers {code} for the deleted {snap}"
    assert cluster.s3.status(f"templates/{snap}.json") == 404, f"the deleted {snap} is still stored"
    code = cluster.s3.status(f"template-names/{snapshot.name}.json")
    assert code == 404, f"the deleted {snap}'s name {snapshot.name} is still stored ({code})"
    code = cluster.http("DELETE", f"{cluster.gateway}/templates/{snap}").status_code
    assert code == 404, f"a second delete of {snap} answered {code}"


def test_kill_through_the_gateway(cluster: Cluster, pair: Pair) -> None:
    cluster.rm(pair.a)
    cluster.rm(pair.b)
    # A node's 2 s reconcile may claim a sandbox it listed just before the
    # kill; its next pass releases it again.
    wait_until(lambda: cluster.routes() == 0, 10, "records left after the kills", 0.5)
    listed = cluster.cli("ls")
    assert pair.a not in listed, f"{pair.a} still listed after its kill: {listed}"


@pytest.mark.skipif(not tls_wanted(), reason="TLS off: the long tier, or SANDFORK_CLUSTER_TLS=1")
def test_a_node_port_refuses_clients_without_a_certificate(cluster: Cluster) -> None:
    """Nodes' ports are under TLS with both sides authenticated: the tests'
    client (a certificate of the cluster's CA) is answered; one without a
    certificate, plain HTTP and the CLI without the cluster's certificate
    get nothing."""
    node = cluster.nodes["n1"]
    assert cluster.http("GET", f"{node.api}/health", timeout=30).is_success
    with pytest.raises(httpx.HTTPError):
        anonymous = httpx.get(f"{node.api}/health", timeout=30, verify=cluster.tls.context(None))
        pytest.fail(f"a client without a certificate was answered {anonymous.status_code}")
    with pytest.raises(httpx.HTTPError):
        plain = httpx.get(f"http://{node.host}:{node.port}/health", timeout=30)
        pytest.fail(f"plain HTTP was answered {plain.status_code}")
    env = {k: v for k, v in cluster.cli_env(node.api).items() if not k.startswith("SANDFORK_TLS_")}
    done = subprocess.run(
        [str(cluster.bin), "ls"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0, f"the CLI without a certificate listed: {done.stdout}"
    done = subprocess.run(
        [str(cluster.bin), "ls"], env=cluster.cli_env(node.api), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"the CLI with the cluster's certificate: {done.stderr}"
