"""The session's cluster, started once for all the sections (one lab machine
runs them all): a network namespace, three etcd members, the S3 server,
three nodes and two gateways. The sections (test_*.py, run in their numbered
order) share it and leave it as they found it where they can; the bench
figures they measure are printed at the end and written to bench.json in the
work directory.

Env: CARGO_TARGET_DIR (default: the repository's target/), SANDFORK_CLUSTER_WORK
(the directory for logs and data; default a new one under
/var/cache/sandfork/lab-rw, the lab's writable share), SANDFORK_CLUSTER_SDK=all
(see test_02_sdk.py). The nodes get SANDFORK_KERNEL, SANDFORK_ROOTFS and
SANDFORK_VMM from the environment (scripts/cluster-test.sh passes them)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
from _pytest.terminal import TerminalReporter
from harness import (
    S3,
    Cluster,
    CutNet,
    Etcd,
    Processes,
    Tls,
    env_with_sbin,
    free_port,
    log,
    tail,
    tls_wanted,
    wait_until,
)

# httpx logs every request at INFO: the live log is for the sections' own lines.
logging.getLogger("httpx").setLevel(logging.WARNING)

ROOT = Path(__file__).resolve().parents[2]
RW = Path("/var/cache/sandfork/lab-rw")

bench_key = pytest.StashKey[dict[str, float]]()
work_key = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def work(pytestconfig: pytest.Config) -> Iterator[Path]:
    """Logs, bench.json and the members' and nodes' data (removed at the end)."""
    given = os.environ.get("SANDFORK_CLUSTER_WORK")
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
    else:
        RW.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix="cluster-test.", dir=RW))
    pytestconfig.stash[work_key] = path
    log.info("logs in %s", path)
    yield path
    for data in ("n1", "n2", "n3", "etcd", "weed"):
        shutil.rmtree(path / data, ignore_errors=True)


@pytest.fixture(scope="session")
def bench(pytestconfig: pytest.Config) -> dict[str, float]:
    """The lab figures the sections measure (see pytest_terminal_summary)."""
    figures: dict[str, float] = {}
    pytestconfig.stash[bench_key] = figures
    return figures


@pytest.fixture(scope="session")
def base_env() -> dict[str, str]:
    return env_with_sbin()


@pytest.fixture(scope="session")
def cut_net(base_env: dict[str, str]) -> Iterator[CutNet]:
    """Made before etcd and the S3 server, which listen on its host end."""
    pid = os.getpid()
    net = CutNet(ns=f"sfcut{pid}", link=f"sfcut{pid}h", env=base_env)
    net.delete()
    net.create()
    yield net
    net.delete()


@pytest.fixture(scope="session")
def procs(cut_net: CutNet, work: Path) -> Iterator[Processes]:
    """Every process the session starts; stopped before the namespace and
    their data go."""
    started = Processes()
    yield started
    started.stop_all()


def sandfork_bin() -> Path:
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    return target / "debug" / "sandfork"


@pytest.fixture(scope="session")
def tls(work: Path, cut_net: CutNet) -> Tls:
    """A certificate per part: etcd's names the addresses its members are
    reached at (loopback, the cut network's host end); the nodes' and
    gateways' name nothing (their peers check the CA's signature);
    `client` is the tests' own (etcdctl, httpx, the CLI)."""
    out = work / "tls"
    names = f"gw,gw2,n1,n2,n3,node,client,etcd/127.0.0.1/{cut_net.host}"
    done = subprocess.run(
        [str(sandfork_bin()), "cluster", "certs", "--out", str(out), "--names", names],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"sandfork cluster certs: {done.stderr}"
    return Tls(out, on=tls_wanted())


@pytest.fixture(scope="session")
def etcd(
    cut_net: CutNet,
    s3_started: S3,
    procs: Processes,
    work: Path,
    base_env: dict[str, str],
    tls: Tls,
) -> Etcd:
    cluster = Etcd(procs, work, base_env, also_on=cut_net.host, tls=tls)
    for m in (1, 2, 3):
        cluster.start(m)
    try:
        wait_until(cluster.healthy, 120, "etcd's three members have no quorum")
    except AssertionError as e:
        logs = "\n".join(tail(work / f"etcd{m}.log", 20) for m in (1, 2, 3))
        raise AssertionError(f"{e}\n{logs}") from None
    return cluster


@pytest.fixture(scope="session")
def s3_started(procs: Processes, work: Path, base_env: dict[str, str]) -> S3:
    """The object store, started before etcd: both take seconds to come up,
    and it comes up while etcd's members elect a leader."""
    store = S3(procs, work, base_env)
    store.start()
    return store


@pytest.fixture(scope="session")
def s3(s3_started: S3, etcd: Etcd) -> S3:
    """The object store, up before the nodes (each makes sure of its bucket)."""
    store = s3_started
    start = time.monotonic()
    try:
        wait_until(store.bucket_made, 120, "the S3 server did not start", 0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{tail(store.log)}") from None
    log.info("S3 server up %.0f s after etcd", time.monotonic() - start)
    return store


@pytest.fixture(scope="session")
def cluster(
    etcd: Etcd, s3: S3, procs: Processes, cut_net: CutNet, work: Path, base_env: dict[str, str]
) -> Cluster:
    """Three nodes (n3 with room for 3 sandboxes: the fork across nodes needs
    a node with room for a parent and 2 children) and two gateways, all on
    loopback, their sandboxes real microVMs without network (nodes on one
    host would take the same network slot names and ranges)."""
    api_key = f"sandfork_cluster_test_{secrets.token_hex(6)}"
    # The task images' registry (test_11_images.py) listens here later; it
    # speaks plain HTTP, off loopback (so the cut-off node reaches it too).
    registry = f"{cut_net.host}:{free_port()}"
    env = dict(
        base_env,
        SANDFORK_ETCD=etcd.endpoints(),
        SANDFORK_S3=s3.url(),
        SANDFORK_API_KEY=api_key,
        SANDFORK_INSECURE_REGISTRIES=registry,
        # the CLI reaches https:// nodes as the tests' client
        **etcd.tls.env("client"),
    )
    c = Cluster(sandfork_bin(), work, env, api_key, procs, etcd, s3, cut_net, etcd.tls)
    c.registry = registry
    for n in (1, 2, 3):
        c.start_node(f"n{n}", ["--max-sandboxes", "3"] if n == 3 else [])
    c.start_gateway("gw")
    c.start_gateway("gw2")
    start = time.monotonic()
    for url in [node.api for node in c.nodes.values()] + c.gateways:
        left = 800 - (time.monotonic() - start)
        try:
            check = partial(healthy, url, etcd.tls.context())
            wait_until(check, max(left, 0), f"no /health on {url}")
        except AssertionError as e:
            logs = "\n".join(tail(p) for p in sorted(work.glob("*.log")))
            raise AssertionError(f"{e}\n{logs}") from None
    log.info("etcd, 3 nodes and 2 gateways up in %.0f s", time.monotonic() - start)
    return c


@pytest.fixture
def etcd_members_back(cluster: Cluster) -> Iterator[None]:
    """Whatever the test did, every member runs again after it."""
    yield
    down = [m for m, proc in cluster.etcd.members.items() if proc.poll() is not None]
    for m in down:
        cluster.etcd.start(m)
    if down:
        wait_until(cluster.etcd.leader, 60, f"no etcd leader after members {down} came back")


def healthy(url: str, tls: ssl.SSLContext | bool) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10, verify=tls).is_success
    except httpx.HTTPError:
        return False


def pytest_terminal_summary(terminalreporter: TerminalReporter, config: pytest.Config) -> None:
    """The bench line (lab figures, emulated: compare them as ratios within
    one run), also as bench.json in the work directory."""
    figures = config.stash.get(bench_key, None)
    if figures is None:
        return
    line = json.dumps(figures)
    terminalreporter.write_line(f"bench: {line}")
    work = config.stash.get(work_key, None)
    if work is not None:
        (work / "bench.json").write_text(line + "\n")
        terminalreporter.write_line(f"cluster-test: logs and bench.json in {work}")
