"""Task images across the cluster (issue 39): a create that names a registry
image through a gateway converts it on one node, which stores the template
in the object store; a create of that image straight on another node takes
the template in from the store instead of pulling and converting the image
again (the registry is not asked for anything); creates of it through the
gateway, by the image metadata key, go to the nodes that have its template;
two creates of a new image at once, on two nodes, convert it once; a
second tag of the image, on a node that has its template, is that template;
and on a node that lacks it, is that template taken in, found by the
image's digest.

The registry is Debian's `docker-registry` on the cut network's host end
(every node reaches it, the cut-off node's namespace too), holding the
small image tests/support/oci_registry.py makes (the SDK's image tests'),
its access log counting what the nodes ask it for."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import oci_registry
import pytest
from harness import IMAGE_KEY, Cluster, Node, elapsed_ms, log, wait_until

# A conversion in the lab: pull, one layer, boot and snapshot (emulated KVM).
CONVERT_TIMEOUT = 600


@dataclass
class Registry:
    host: str
    access_log: Path

    def requests(self) -> int:
        """The requests the nodes sent it (their user agent is `sandfork`):
        a manifest at least for each pull (the layers may be in the nodes'
        blob cache already, which the lab's nodes share)."""
        text = self.access_log.read_text(errors="replace")
        return len(re.findall(r'"(?:GET|HEAD) /v2/[^"]+" \d+ \d+ "[^"]*" "sandfork"', text))


@pytest.fixture(scope="module")
def registry(cluster: Cluster) -> Iterator[Registry]:
    """The registry, holding `task/img:v1`."""
    assert cluster.registry, "the session's cluster names no registry"
    host, port = cluster.registry.rsplit(":", 1)
    dir = cluster.work / "registry"
    access_log = cluster.work / "registry.log"
    proc, where = oci_registry.serve(dir, host, int(port), log=access_log)
    try:
        oci_registry.push(dir / "layout", f"{where}/task/img:v1")
        yield Registry(where, access_log)
    finally:
        proc.kill()
        proc.wait()


def live_nodes(cluster: Cluster) -> list[Node]:
    return [cluster.nodes[i] for i in sorted(cluster.nodes) if cluster.registered(i)]


def create(cluster: Cluster, url: str, body: dict[str, object]) -> str:
    """A create (through url, a gateway or a node), waiting out "being
    built" answers as a client would; its sandbox's id."""
    body = {"timeout": 900, **body}
    deadline = time.monotonic() + CONVERT_TIMEOUT
    while True:
        answer = cluster.http("POST", f"{url}/sandboxes", body, timeout=CONVERT_TIMEOUT)
        if answer.status_code == 201:
            return str(answer.json()["sandboxID"])
        busy = answer.status_code == 503 and "being built" in answer.text
        assert busy and time.monotonic() < deadline, (
            f"create {body} through {url}: {answer.status_code} {answer.text}"
        )
        time.sleep(2)


def sees_the_image(cluster: Cluster, sandbox: str) -> None:
    got = cluster.cli("exec", sandbox, "--user", "root", "--", "cat", "/srv/hello.txt")
    assert got + "\n" == oci_registry.HELLO, f"{sandbox} read {got!r}"


def converted(cluster: Cluster, image: str) -> int:
    """How many nodes started a conversion of `image` (their logs)."""
    said = f"({image}): converting the image for a create"
    return cluster.node_logs().count(said)


def taken_in(node: Node, image: str) -> bool:
    said = f"cluster: image {image}: template "
    return any(
        said in line and "taken in from the object store, not pulled" in line
        for line in node.log_path.read_text(errors="replace").splitlines()
    )


@dataclass
class First:
    image: str
    sandbox: str
    maker: str  # the node that converted it


@pytest.fixture(scope="module")
def first(cluster: Cluster, registry: Registry, bench: dict[str, float]) -> Iterator[First]:
    image = f"{registry.host}/task/img:v1"
    start = time.monotonic()
    sandbox = create(cluster, cluster.gateway, {"templateID": image})
    bench["cluster_image_convert_ms"] = elapsed_ms(start)
    maker = cluster.owner(sandbox)
    log.info("%s converted on %s in %d ms", image, maker, bench["cluster_image_convert_ms"])
    yield First(image, sandbox, maker)
    if cluster.route(sandbox):  # what a failed test left
        cluster.cli_run("rm", sandbox)


def test_a_create_by_image_through_the_gateway_converts_it(
    cluster: Cluster, registry: Registry, first: First
) -> None:
    sees_the_image(cluster, first.sandbox)
    assert converted(cluster, first.image) == 1, f"{first.image} converted more than once"
    assert registry.requests() > 0, "the registry's access log shows no request of a node"
    wait_until(
        lambda: cluster.has_template(first.maker, first.image),
        30,
        f"{first.maker} does not publish that it has {first.image}",
    )


def test_another_node_takes_it_in_from_the_store(
    cluster: Cluster, registry: Registry, first: First, bench: dict[str, float]
) -> None:
    # Found by the image once its manifest is stored.
    index = f"template-images/{hashlib.sha256(first.image.encode()).hexdigest()}.json"
    wait_until(
        lambda: cluster.s3.status(index) == 200,
        300,
        f"{first.maker} did not store the template of {first.image}",
    )
    other = next(n for n in live_nodes(cluster) if n.id != first.maker)
    asked = registry.requests()
    start = time.monotonic()
    sandbox = create(cluster, other.api, {"templateID": first.image})
    bench["cluster_image_take_in_ms"] = elapsed_ms(start)
    try:
        assert cluster.owner(sandbox) == other.id
        sees_the_image(cluster, sandbox)
        assert taken_in(other, first.image), f"{other.id} does not say it took the template in"
        assert converted(cluster, first.image) == 1, f"{other.id} converted {first.image} again"
        more = registry.requests() - asked
        assert more == 0, f"{other.id} asked the registry for {first.image} ({more} requests)"
        wait_until(
            lambda: cluster.has_template(other.id, first.image),
            30,
            f"{other.id} does not publish that it has {first.image}",
        )
    finally:
        cluster.rm(sandbox)
    log.info(
        "take-in on %s: %d ms (the conversion: %d ms)",
        other.id,
        bench["cluster_image_take_in_ms"],
        bench["cluster_image_convert_ms"],
    )


def test_creates_by_the_metadata_key_go_where_its_template_is(
    cluster: Cluster, first: First
) -> None:
    """(The first sandbox goes first: on n3, which holds 3, it would make its
    maker clearly fuller than a node without the template.)"""
    cluster.rm(first.sandbox)
    have = [n.id for n in live_nodes(cluster) if cluster.has_template(n.id, first.image)]
    assert len(have) >= 2, f"only {have} have {first.image}"
    made = [
        create(cluster, cluster.gateway, {"metadata": {IMAGE_KEY: first.image}}) for _ in (1, 2)
    ]
    try:
        for sandbox in made:
            on = cluster.owner(sandbox)
            assert on in have, f"a create of {first.image} went to {on}, which lacks it ({have})"
        sees_the_image(cluster, made[0])
    finally:
        cluster.rm(*made)


def test_a_new_image_created_on_two_nodes_at_once_is_converted_once(
    cluster: Cluster, registry: Registry
) -> None:
    # Another image (its own manifest digest), not a second tag of v1's,
    # which a node holding v1's template would just name it by.
    image = f"{registry.host}/task/img:twice"
    oci_registry.push(cluster.work / "registry-twice", image, variant="twice")
    two = live_nodes(cluster)[:2]
    with ThreadPoolExecutor(2) as pool:
        made = list(pool.map(lambda n: create(cluster, n.api, {"templateID": image}), two))
    try:
        assert [cluster.owner(s) for s in made] == [n.id for n in two]
        assert converted(cluster, image) == 1, f"{image} converted more than once"
        assert sum(taken_in(n, image) for n in two) == 1, f"no node took {image} in"
        for sandbox in made:
            sees_the_image(cluster, sandbox)
    finally:
        cluster.rm(*made)


def test_a_second_tag_of_an_image_is_its_template(
    cluster: Cluster, registry: Registry, first: First
) -> None:
    """Created on the node that holds v1's template, another tag of the same
    image (its manifest digest) is that template, named by the tag too:
    nothing is booted, and the node publishes the new name."""
    image = f"{registry.host}/task/img:again"
    oci_registry.retag(first.image, image)
    maker = cluster.nodes[first.maker]
    sandbox = create(cluster, maker.api, {"templateID": image})
    try:
        assert cluster.owner(sandbox) == maker.id
        said = f"named {image} too, the same image"
        assert said in maker.log_path.read_text(errors="replace"), f"{maker.id} booted {image}"
        sees_the_image(cluster, sandbox)
        wait_until(
            lambda: cluster.has_template(maker.id, image),
            30,
            f"{maker.id} does not publish that it has {image}",
        )
    finally:
        cluster.rm(sandbox)


def test_a_tag_no_node_has_seen_is_taken_in_by_its_digest(
    cluster: Cluster, registry: Registry, first: First
) -> None:
    """Created on a node that lacks v1's template, a tag of the same image
    that no node has seen: the node asks the registry for the tag's
    manifest only (its digest) and takes v1's template in from the store,
    found by that digest: no conversion, no layer fetched."""
    image = f"{registry.host}/task/img:digest"
    oci_registry.retag(first.image, image)
    lacking = [n for n in live_nodes(cluster) if not cluster.has_template(n.id, first.image)]
    assert lacking, f"every live node has {first.image}: none to take it in"
    node = lacking[0]
    asked = registry.requests()
    sandbox = create(cluster, node.api, {"templateID": image})
    try:
        assert cluster.owner(sandbox) == node.id
        assert taken_in(node, image), f"{node.id} does not say it took {image}'s template in"
        assert converted(cluster, image) == 0, f"{node.id} converted {image}"
        # The tag's manifest (a HEAD or a GET, and a retry on a token's
        # challenge at most): no blob.
        more = registry.requests() - asked
        assert 1 <= more <= 3, f"{node.id} asked the registry {more} times for {image}"
        sees_the_image(cluster, sandbox)
        wait_until(
            lambda: cluster.has_template(node.id, image),
            30,
            f"{node.id} does not publish that it has {image}",
        )
    finally:
        cluster.rm(sandbox)


def test_the_claims_are_given_back(cluster: Cluster) -> None:
    """Each conversion's claim in etcd goes once its template is stored."""
    wait_until(
        lambda: not cluster.etcd.keys("/sandfork/v1/images/"),
        120,
        lambda: f"claims left: {cluster.etcd.keys('/sandfork/v1/images/')}",
    )
