"""A server the sandbox runs is reachable at sandbox.get_host(port), as on
E2B: the node routes `<port>-<id>.<domain>` to that TCP port in the guest."""

import os

import httpx

from conftest import wait_until

SANDBOX_URL = os.environ.get("E2B_SANDBOX_URL", "")


def get_via_node(host: str, path: str) -> httpx.Response:
    # get_host names E2B's domain; the node behind E2B_SANDBOX_URL routes by
    # the Host header, as E2B's proxy does.
    return httpx.get(SANDBOX_URL + path, headers={"Host": host}, timeout=60)


def test_a_server_in_the_sandbox_answers_at_its_host(sandbox):
    sandbox.files.write("/tmp/www/index.html", "hello from the sandbox\n")
    server = sandbox.commands.run(
        "python3 -m http.server 8080 --directory /tmp/www", background=True
    )
    try:
        host = sandbox.get_host(8080)
        assert host.startswith(f"8080-{sandbox.sandbox_id}.")

        def answered():
            try:
                return get_via_node(host, "/index.html")
            except httpx.HTTPError:
                return None

        r = wait_until(
            lambda: (a := answered()) is not None and a.status_code == 200 and a,
            timeout=60,
            what="the sandbox's server",
        )
        assert r.text == "hello from the sandbox\n"
        # Again, on the node's kept connection to the guest.
        for _ in range(3):
            assert get_via_node(host, "/index.html").text == "hello from the sandbox\n"
    finally:
        server.kill()


def test_a_port_nothing_listens_on_is_a_502(sandbox):
    r = get_via_node(sandbox.get_host(8081), "/")
    assert r.status_code == 502
    assert "port is not open" in r.json()["message"]
