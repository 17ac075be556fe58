"""The cluster under test as real processes: three etcd members, SeaweedFS's
S3 server, sandfork nodes and gateways, on loopback and in one network
namespace the session makes; and the ways the tests look at them: etcdctl,
the sandfork CLI, HTTP. conftest.py starts them once for the session."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import polling

log = logging.getLogger("cluster")
T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    failure: str | Callable[[], str],
    interval: float = 1.0,
) -> T:
    """polling.wait_until, probing once a second by default: a probe here is
    often a process (etcdctl, the CLI) in the one emulated CPU."""
    return polling.wait_until(predicate, timeout, failure, interval)


PREFIX = "/sandfork/v1"
# The metadata key nodes and gateways take a create's image under.
IMAGE_KEY = "image"
# Five times etcd's defaults: the lab's one emulated CPU is busy with guests.
ETCD_HEARTBEAT_MS = 500
ETCD_ELECTION_MS = 5000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"({path}: {e})"
    return f"--- {path.name} (last {lines} lines)\n" + "\n".join(text.splitlines()[-lines:])


def run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
    """A setup command that must work (ip, for the namespace)."""
    done = subprocess.run(list(argv), env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}: {done.stderr}"


class Processes:
    """Every long-lived process the session starts; stopped at its end."""

    def __init__(self) -> None:
        self._procs: list[tuple[bool, str, subprocess.Popen[bytes]]] = []

    def start(
        self,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        append: bool = False,
        stop_first: bool = False,
    ) -> subprocess.Popen[bytes]:
        """stop_first: a node or gateway, stopped (SIGTERM) before etcd and
        the store are killed (a node leaves the cluster through etcd on its
        way out)."""
        with open(log_path, "ab" if append else "wb") as out:
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self._procs.append((stop_first, log_path.stem, proc))
        return proc

    def stop_all(self, grace: float = 15) -> None:
        """Nodes and gateways: SIGTERM, then SIGKILL for what still runs
        `grace` seconds later. Then the rest, etcd and the store, SIGKILL:
        their data goes with the session, and a SIGTERM cost 15 s (etcd's
        leader tries to hand its leadership to members stopping with it for
        5 s plus two election timeouts; weed's filer waits 15 s for its gRPC
        streams). Bounded, so that the session's end never runs into the
        lab's timeout."""
        live = [(n, p) for f, n, p in self._procs if f and p.poll() is None]
        for _, proc in live:
            proc.terminate()
        deadline = time.monotonic() + grace
        for name, proc in live:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                log.info("%s did not stop in %g s after SIGTERM: killed", name, grace)
                kill9(proc)
        for first, _, proc in self._procs:
            if not first and proc.poll() is None:
                kill9(proc)


def kill9(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@dataclass
class CutNet:
    """The network namespace the cut-off node runs in: one veth pair to the
    root namespace, whose host end the test takes down and up (etcd and the
    S3 server listen on the host end's address too)."""

    ns: str
    link: str
    env: Mapping[str, str]
    host: str = "10.213.0.1"
    node: str = "10.213.0.2"
    peer: str = "sfcutn"

    def create(self) -> None:
        run(["ip", "netns", "add", self.ns], self.env)
        run(["ip", "link", "add", self.link, "type", "veth", "peer", "name", self.peer,
             "netns", self.ns], self.env)  # fmt: skip
        run(["ip", "addr", "add", f"{self.host}/30", "dev", self.link], self.env)
        run(["ip", "link", "set", self.link, "up"], self.env)
        run([*self.enter(), "ip", "addr", "add", f"{self.node}/30", "dev", self.peer], self.env)
        run([*self.enter(), "ip", "link", "set", self.peer, "up"], self.env)
        run([*self.enter(), "ip", "link", "set", "lo", "up"], self.env)

    def delete(self) -> None:
        # (the veth pair goes with its end in the namespace)
        subprocess.run(["ip", "netns", "del", self.ns], env=self.env, capture_output=True)

    def enter(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.ns}"]

    def set_link(self, up: bool) -> None:
        run(["ip", "link", "set", self.link, "up" if up else "down"], self.env)


def tls_wanted() -> bool:
    """Whether the cluster's parts talk TLS: in the long tier, or with
    SANDFORK_CLUSTER_TLS=1 (=0: never). Not in the default tier, as TLS in
    the emulated lab (etcd's peers and clients, fork files, take-ins) about
    doubled the suite's time there (stop 54: 47 % of the suite in 24 min);
    crates/server/tests/tls.rs checks TLS on real listeners in every run."""
    chosen = os.environ.get("SANDFORK_CLUSTER_TLS", "")
    if chosen in ("0", "1"):
        return chosen == "1"
    return os.environ.get("SANDFORK_TEST_TIER") == "long"


@dataclass
class Tls:
    """The cluster's certificates (`sandfork cluster certs`): every part
    (etcd members, nodes, gateways, the tests' own client) holds one of the
    cluster's CA and takes only clients with one. Off (`on` False), every
    part talks plain HTTP and the certificates go unused."""

    dir: Path
    on: bool = True

    @property
    def scheme(self) -> str:
        return "https" if self.on else "http"

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def cert(self, part: str) -> Path:
        return self.dir / f"{part}.pem"

    def key(self, part: str) -> Path:
        return self.dir / f"{part}-key.pem"

    def flags(self, part: str) -> list[str]:
        """A node's or gateway's `serve` flags."""
        if not self.on:
            return []
        return ["--tls-cert", str(self.cert(part)), "--tls-key", str(self.key(part)),
                "--tls-ca", str(self.ca)]  # fmt: skip

    def env(self, part: str) -> dict[str, str]:
        """The CLI's (an https:// node is reached with this part's certificate)."""
        if not self.on:
            return {}
        return {
            "SANDFORK_TLS_CERT": str(self.cert(part)),
            "SANDFORK_TLS_KEY": str(self.key(part)),
            "SANDFORK_TLS_CA": str(self.ca),
        }

    def context(self, part: str | None = "client") -> ssl.SSLContext | bool:
        """What httpx reaches a node with: the CA trusted, names not checked
        (nodes are reached at the addresses etcd holds, which their
        certificates do not name), `part`'s certificate presented (None:
        none). Off: httpx's default (plain HTTP uses none)."""
        if not self.on:
            return True
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.check_hostname = False
        if part is not None:
            ctx.load_cert_chain(self.cert(part), self.key(part))
        return ctx


class Etcd:
    """Three members (a quorum of two), each also on the address the
    cut-off node reaches; with TLS on, clients and peers through TLS, both
    sides authenticated."""

    def __init__(
        self, procs: Processes, work: Path, env: Mapping[str, str], also_on: str, tls: Tls
    ) -> None:
        self.procs = procs
        self.work = work
        self.env = dict(env, ETCDCTL_API="3")
        self.also_on = also_on
        self.tls = tls
        self.clients = [free_port() for _ in range(3)]
        self.peers = [free_port() for _ in range(3)]
        self.members: dict[int, subprocess.Popen[bytes]] = {}

    def endpoints(self, host: str = "127.0.0.1") -> str:
        return ",".join(f"{self.tls.scheme}://{host}:{port}" for port in self.clients)

    def start(self, m: int) -> None:
        """Member m (1-3) on its ports and data dir. The zap logger: with 3.4's
        default (capnslog) a slow read's retry warning dereferences a nil
        logger and the member dies (etcd-io/etcd#14402; seen in a CI run)."""
        client, peer = self.clients[m - 1], self.peers[m - 1]
        sch = self.tls.scheme
        initial = ",".join(f"e{i + 1}={sch}://127.0.0.1:{p}" for i, p in enumerate(self.peers))
        cert, key, ca = self.tls.cert("etcd"), self.tls.key("etcd"), self.tls.ca
        secured = [
            f"--cert-file={cert}",
            f"--key-file={key}",
            f"--trusted-ca-file={ca}",
            "--client-cert-auth",
            f"--peer-cert-file={cert}",
            f"--peer-key-file={key}",
            f"--peer-trusted-ca-file={ca}",
            "--peer-client-cert-auth",
        ]
        argv = [
            "etcd",
            f"--name=e{m}",
            f"--data-dir={self.work / 'etcd' / f'e{m}'}",
            f"--listen-client-urls={sch}://127.0.0.1:{client},{sch}://{self.also_on}:{client}",
            f"--advertise-client-urls={sch}://127.0.0.1:{client}",
            f"--listen-peer-urls={sch}://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls={sch}://127.0.0.1:{peer}",
            *(secured if self.tls.on else []),
            f"--initial-cluster={initial}",
            "--initial-cluster-state=new",
            f"--heartbeat-interval={ETCD_HEARTBEAT_MS}",
            f"--election-timeout={ETCD_ELECTION_MS}",
            "--logger=zap",
            "--log-outputs=stderr",
        ]
        self.members[m] = self.procs.start(argv, self.work / f"etcd{m}.log", self.env, append=True)

    def kill(self, *members: int) -> None:
        for m in members:
            kill9(self.members[m])

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "etcdctl",
                f"--endpoints={self.endpoints()}",
                *self.ctl_tls(),
                *args,
            ],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    def ctl_tls(self) -> list[str]:
        if not self.tls.on:
            return []
        tls = self.tls
        return [f"--cacert={tls.ca}", f"--cert={tls.cert('client')}", f"--key={tls.key('client')}"]

    def healthy(self) -> bool:
        return self.ctl("--command-timeout=5s", "endpoint", "health").returncode == 0

    def get(self, key: str) -> str:
        """The value at key ('' when absent)."""
        done = self.ctl("get", "--print-value-only", key)
        assert done.returncode == 0, f"etcdctl get {key}: {done.stderr}"
        return done.stdout.strip()

    def keys(self, prefix: str) -> list[str]:
        done = self.ctl("get", "--prefix", "--keys-only", prefix)
        assert done.returncode == 0, f"etcdctl get --prefix {prefix}: {done.stderr}"
        return [line for line in done.stdout.splitlines() if line]

    def exists(self, key: str) -> bool:
        done = self.ctl("get", "--keys-only", key)
        assert done.returncode == 0, f"etcdctl get {key}: {done.stderr}"
        return bool(done.stdout.strip())

    def leader(self) -> int | None:
        """The member that leads now (1-3). A member that is down is left out
        of etcdctl's answer (which then fails: its output still counts)."""
        done = self.ctl("endpoint", "status", "-w", "json")
        try:
            status = json.loads(done.stdout or "[]")
        except json.JSONDecodeError:
            return None
        endpoints = self.endpoints().split(",")
        for member in status:
            # (a member still electing has no "leader": JSON leaves out zeros)
            said = member["Status"]
            leader = said.get("leader")
            if leader and said["header"].get("member_id") == leader:
                return endpoints.index(member["Endpoint"]) + 1
        return None


class S3:
    """SeaweedFS's `weed server -s3`. Every gRPC port is given: weed's default
    (port + 10000) may not exist. Room for 4 GiB (64 volumes of 64 MiB): every
    node stores its templates, the lifecycle tests their pauses and snapshots
    (1 GiB ran out)."""

    def __init__(self, procs: Processes, work: Path, env: Mapping[str, str]) -> None:
        self.procs = procs
        self.work = work
        self.env = env
        self.port = free_port()
        self.args = [
            "server",
            f"-dir={work / 'weed'}",
            "-ip=127.0.0.1",
            "-ip.bind=0.0.0.0",
            "-s3",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=64",
        ]
        for service in ("master", "volume", "filer", "s3"):
            port = self.port if service == "s3" else free_port()
            self.args += [f"-{service}.port={port}", f"-{service}.port.grpc={free_port()}"]
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}/sandfork"

    def start(self) -> None:
        (self.work / "weed").mkdir(exist_ok=True)
        self.proc = self.procs.start(["weed", *self.args], self.log, self.env, append=True)

    @property
    def log(self) -> Path:
        return self.work / "weed.log"

    def kill(self) -> None:
        assert self.proc is not None
        kill9(self.proc)

    def bucket_made(self) -> bool:
        try:
            code = httpx.put(self.url(), timeout=10).status_code
        except httpx.HTTPError:
            return False
        return code in (200, 409)

    def status(self, path: str) -> int:
        """The HTTP status of an anonymous GET of an object in the bucket."""
        return httpx.get(f"{self.url()}/{path}", timeout=30).status_code


@dataclass
class Node:
    id: str
    port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    host: str = "127.0.0.1"
    scheme: str = "https"

    @property
    def api(self) -> str:
        """Under TLS: only the cluster's parts (and the tests' client) get
        an answer."""
        return f"{self.scheme}://{self.host}:{self.port}"


@dataclass
class Cluster:
    """What the tests drive: the running parts and how to reach them."""

    bin: Path
    work: Path
    env: dict[str, str]
    api_key: str
    procs: Processes
    etcd: Etcd
    s3: S3
    cut: CutNet
    tls: Tls
    # The task images' registry (test_11_images.py), `host:port`: on the cut
    # network's host end, which every node reaches (the cut-off one too).
    registry: str = ""
    nodes: dict[str, Node] = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)

    @property
    def gateway(self) -> str:
        return self.gateways[0]

    # --- processes ---------------------------------------------------------
    def serve_argv(self, node_id: str, listen: str, extra: Sequence[str] = ()) -> list[str]:
        return [
            str(self.bin), "serve", "--in-lab", "--role", "node", "--node-id", node_id,
            "--listen", listen, "--data-dir", str(self.work / node_id), "--no-network",
            "--pool-size", "1", "--lease-ttl-secs", "3", "--image-metadata-key", IMAGE_KEY,
            *self.tls.flags(node_id if self.tls.cert(node_id).exists() else "node"),
            *extra,
        ]  # fmt: skip

    def start_node(self, node_id: str, extra: Sequence[str] = ()) -> Node:
        port = free_port()
        log_path = self.work / f"{node_id}.log"
        argv = self.serve_argv(node_id, f"127.0.0.1:{port}", extra)
        proc = self.procs.start(argv, log_path, self.env, stop_first=True)
        node = Node(node_id, port, self.work / node_id, log_path, proc, scheme=self.tls.scheme)
        self.nodes[node_id] = node
        return node

    def start_gateway(self, name: str) -> str:
        port = free_port()
        argv = [str(self.bin), "serve", "--role", "gateway", "--listen", f"127.0.0.1:{port}",
                "--image-metadata-key", IMAGE_KEY, *self.tls.flags(name)]  # fmt: skip
        self.procs.start(argv, self.work / f"{name}.log", self.env, stop_first=True)
        url = f"http://127.0.0.1:{port}"
        self.gateways.append(url)
        return url

    def kill_node(self, node_id: str) -> None:
        """SIGKILL, its data dir removed, until its lease has run out (3 s
        TTL; until then the gateway routes to it)."""
        node = self.nodes[node_id]
        kill9(node.proc)
        shutil.rmtree(node.data_dir, ignore_errors=True)
        self.dead.add(node_id)
        wait_until(
            lambda: not self.registered(node_id), 30, f"node {node_id} is still registered", 0.5
        )

    def start_cut_off_node(self, node_id: str) -> Node:
        """Node node_id, fresh, inside the namespace whose link the test
        takes down; it reaches etcd and the store on the veth's host end."""
        port = free_port()
        env = dict(
            self.env,
            SANDFORK_ETCD=self.etcd.endpoints(self.cut.host),
            SANDFORK_S3=self.s3.url(self.cut.host),
        )
        log_path = self.work / f"{node_id}-cut.log"
        argv = [*self.cut.enter(), *self.serve_argv(node_id, f"{self.cut.node}:{port}")]
        proc = self.procs.start(argv, log_path, env, stop_first=True)
        node = Node(
            node_id, port, self.work / node_id, log_path, proc, self.cut.node, self.tls.scheme
        )
        self.nodes[node_id] = node
        self.dead.discard(node_id)
        return node

    def node_logs(self) -> str:
        """Every node's log so far (those of restarted nodes too)."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.work.glob("n*.log")))

    # --- the CLI -----------------------------------------------------------
    def cli_env(self, url: str | None = None, key: str | None = None) -> dict[str, str]:
        return dict(
            self.env, SANDFORK_API_URL=url or self.gateway, SANDFORK_API_KEY=key or self.api_key
        )

    def cli_run(
        self, *args: str, url: str | None = None, key: str | None = None, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin), *args],
            env=self.cli_env(url, key),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def cli(self, *args: str, url: str | None = None, key: str | None = None, why: str = "") -> str:
        """`sandfork ARGS` (through the first gateway unless url), its stdout
        without the trailing newline; a failure fails the test, saying why."""
        done = self.cli_run(*args, url=url, key=key)
        what = why or f"sandfork {' '.join(args)}"
        assert done.returncode == 0, f"{what}: exit {done.returncode}: {done.stderr.strip()}"
        return done.stdout.rstrip("\n")

    def create(self, *args: str, url: str | None = None, why: str = "") -> str:
        return self.cli("create", "--timeout", "900", *args, url=url, why=why or "create")

    def sh(self, sandbox: str, script: str, url: str | None = None) -> str:
        """A shell command in the sandbox (as its user), its stdout."""
        return self.cli(
            "exec", sandbox, "--", "sh", "-c", script, url=url, why=f"exec in {sandbox}"
        )

    def rm(self, *sandboxes: str) -> None:
        self.cli("rm", *sandboxes, why=f"kill {' '.join(sandboxes)}")

    # --- HTTP --------------------------------------------------------------
    def http(
        self,
        method: str,
        url: str,
        body: Any = None,
        key: str | None = None,
        timeout: float | httpx.Timeout = 300,
    ) -> httpx.Response:
        """One request with the admin's key (or key), JSON body if any."""
        headers = {"X-API-Key": key or self.api_key}
        return httpx.request(
            method, url, json=body, headers=headers, timeout=timeout, verify=self.tls.context()
        )

    def pause(self, sandbox: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """A pause through the gateway; its answer (headers say whether it
        is durable)."""
        answer = self.http("POST", f"{self.gateway}/sandboxes/{sandbox}/pause", body or {})
        assert answer.is_success, f"pausing {sandbox}: {answer.status_code} {answer.text}"
        return answer

    def durable_pause(self, sandbox: str) -> None:
        answer = self.pause(sandbox)
        durable = answer.headers.get("x-sandfork-durable")
        assert durable == "true", f"the pause of {sandbox} is not durable: {dict(answer.headers)}"

    # --- etcd's view -------------------------------------------------------
    def route(self, sandbox: str) -> str:
        return self.etcd.get(f"{PREFIX}/sandboxes/{sandbox}")

    def owner(self, sandbox: str) -> str:
        route = self.route(sandbox)
        assert route, f"{sandbox} has no route"
        return str(json.loads(route)["node_id"])

    def routes(self) -> int:
        return len(self.etcd.keys(f"{PREFIX}/sandboxes/"))

    def registered(self, node_id: str) -> bool:
        return self.etcd.exists(f"{PREFIX}/nodes/{node_id}")

    def has_template(self, node_id: str, name: str) -> bool:
        record = self.etcd.get(f"{PREFIX}/nodes/{node_id}")
        return bool(record) and name in json.loads(record)["load"].get("templates", [])

    def until_stored(self, sandbox: str, failure: str) -> None:
        """Until the sandbox's route records a stored pause (180 s at most)."""
        wait_until(lambda: '"paused"' in self.route(sandbox), 180, failure)


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line]


def elapsed_ms(since: float) -> int:
    return int((time.monotonic() - since) * 1000)


def env_with_sbin() -> dict[str, str]:
    """The environment with sbin on PATH (`ip` is there)."""
    return dict(os.environ, PATH=os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin")
