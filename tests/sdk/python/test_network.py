"""Sandbox networking through the SDK: every sandbox has eth0 at the fixed
guest address; `allow_internet_access=False` and `network={...}` are kept
(get_info) and `update_network` replaces them; bad rules are refused. Which
traffic passes is the lab test's part (crates/server/tests/lab_network.rs,
against an internet of its own): this suite sends none off the machine."""

import pytest
from e2b import Sandbox, SandboxException

from conftest import create


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
