"""Sandbox networking through the SDK: every sandbox has eth0 at the fixed
guest address; `allow_internet_access=False` and `network={...}` are kept
(get_info) and `update_network` replaces them; bad rules are refused. Which
traffic passes is the lab test's part (crates/server/tests/lab_network.rs,
against an internet of its own); domain rules are checked here only by what
the node answers itself (names refused, the egress proxy's 403). One test
goes off the machine as a user would: a plain `pip install` of a small package
from the package index this host's pip is configured for (read at run time, never
written here), through the sandbox's slot, the node's DNS forwarder and the
lab's own network."""

import shlex
import socket
from urllib.parse import urlsplit

import pytest
from conftest import create
from e2b import ALL_TRAFFIC, Sandbox, SandboxException
from rl_bench import guest_pip_env, host_pip_settings

# A pure-Python wheel of a few kB with no dependencies.
SMALL_PACKAGE = "six"


def index_host(settings: dict[str, str]) -> str:
    url = settings.get("index-url") or pip_default_index()
    return urlsplit(url).hostname or ""


def pip_default_index() -> str:
    """The index pip uses when none is configured, as pip itself names it."""
    from pip._internal.models.index import PyPI

    return str(PyPI.simple_url)


def test_pip_install_from_the_package_index():
    settings = host_pip_settings()
    host = index_host(settings)
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        pytest.skip(f"this host does not resolve its package index ({host})")
    sbx = create()
    try:
        env, trust_store = guest_pip_env(settings)
        if trust_store is not None:
            # The host's trust store (it may hold the CA of a TLS-inspecting
            # egress proxy the guest's bundle does not know).
            sbx.files.write(env["PIP_CERT"], trust_store)
        # As E2B's snippets do it: a plain `pip install` (Debian's PEP 668
        # marker would refuse it), as the default user and as root.
        for user in ("user", "root"):
            r = sbx.commands.run(
                "pip install --quiet "
                + shlex.quote(SMALL_PACKAGE)
                + f" && python3 -c 'import {SMALL_PACKAGE}; print({SMALL_PACKAGE}.__file__)'",
                envs=env,
                user=user,
                timeout=420,
            )
            assert r.exit_code == 0, (user, r.stderr)
            where = r.stdout.strip().splitlines()[-1]
            # root's goes to the system's site-packages, a user's to ~/.local
            expected = "/usr/local/lib/" if user == "root" else "/home/user/.local/"
            assert where.startswith(expected), (user, where, r.stderr)
    finally:
        sbx.kill()


def test_sandboxes_have_the_fixed_guest_network_and_keep_their_rules():
    sbx = create(allow_internet_access=False)
    try:
        addr = sbx.commands.run("cat /proc/net/fib_trie | grep -c 169.254.0.21; true")
        assert int(addr.stdout.strip() or "0") > 0, addr.stdout
        route = sbx.commands.run("cat /proc/net/route")
        assert "eth0\t00000000" in route.stdout, route.stdout
        info = sbx.get_info()
        assert info.allow_internet_access is False
        Sandbox.update_network(
            sbx.sandbox_id, {"allow_out": ["1.1.1.1"], "deny_out": ["0.0.0.0/0"]}
        )
        info = sbx.get_info()
        assert info.network is not None
        assert info.network.get("allow_out") == ["1.1.1.1"], info.network
        assert info.network.get("deny_out") == ["0.0.0.0/0"], info.network
    finally:
        sbx.kill()


def test_bad_network_rules_are_refused():
    with pytest.raises(SandboxException) as e:
        create(network={"deny_out": ["0.0.0.0"]}, timeout=60)
    assert "address must be specified" in str(e.value)
    with pytest.raises(SandboxException) as e:
        create(network={"allow_out": ["example.com"]}, timeout=60)
    assert "ALL_TRAFFIC" in str(e.value)


def test_domain_rules_are_kept_and_other_names_refused_by_the_node():
    allowed = ["allowed.sandfork.test", "*.wild.sandfork.test"]
    sbx = create(network={"allow_out": allowed, "deny_out": [ALL_TRAFFIC]})
    try:
        info = sbx.get_info()
        assert info.network is not None
        assert info.network.get("allow_out") == allowed, info.network
        # The node's DNS forwarder resolves only allowed names.
        r = sbx.commands.run("getent hosts other.sandfork.test; echo rc=$?")
        assert not r.stdout.strip().endswith("rc=0"), r.stdout
        # The egress proxy refuses another name itself: the address
        # (TEST-NET-1) is never dialled, nothing leaves the node.
        r = sbx.commands.run("curl -s -m 20 -H 'Host: other.sandfork.test' http://192.0.2.1/; true")
        assert "do not allow other.sandfork.test" in r.stdout, (r.stdout, r.stderr)
        # An allowed name only reaches what the node's DNS answered for it.
        r = sbx.commands.run(
            "curl -s -m 20 -H 'Host: allowed.sandfork.test' http://192.0.2.1/; true"
        )
        assert "192.0.2.1 is not an address" in r.stdout, (r.stdout, r.stderr)
        r = sbx.commands.run(
            "curl -sk -m 20 --resolve other.sandfork.test:443:192.0.2.1 "
            "https://other.sandfork.test/ >/dev/null; echo rc=$?"
        )
        assert r.stdout.strip() not in ("", "rc=0"), r.stdout  # the TLS handshake fails
    finally:
        sbx.kill()
