"""A server the sandbox runs is reachable at sandbox.get_host(port), as on
E2B: the node routes `<port>-<id>.<domain>` to that TCP port in the guest.
A sandbox created with `allow_public_traffic=False` answers there only with
its traffic token; `mask_request_host` is the Host its server sees; a port in
`https_ports` is reached over TLS, its self-signed certificate taken."""

import os

import httpx
from conftest import create
from e2b import Sandbox
from polling import wait_until

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


# Answers every GET with the Host and X-Forwarded-Host it was sent.
ECHO_HOST_SERVER = """
import http.server

class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = "%s|%s" % (self.headers.get("Host"), self.headers.get("X-Forwarded-Host"))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

http.server.HTTPServer(("0.0.0.0", 8090), Echo).serve_forever()
"""


def test_a_private_sandbox_needs_its_traffic_token_and_masks_the_host():
    sbx = create(network={"allow_public_traffic": False, "mask_request_host": "${PORT}-app.test"})
    try:
        token = sbx.traffic_access_token
        assert token, "a private sandbox has a traffic access token"
        # envd's own port needs no traffic token (the SDK sends none).
        sbx.files.write("/tmp/echo.py", ECHO_HOST_SERVER)
        server = sbx.commands.run("python3 /tmp/echo.py", background=True)
        host = sbx.get_host(8090)

        def get(headers: dict[str, str]) -> httpx.Response:
            return httpx.get(SANDBOX_URL + "/", headers={"Host": host, **headers}, timeout=60)

        def answered():
            try:
                r = get({"e2b-traffic-access-token": token})
            except httpx.HTTPError:
                return None
            return r if r.status_code == 200 else None

        r = wait_until(answered, timeout=60, what="the private sandbox's server")
        # The guest sees the mask, the client's host beside it.
        assert r.text == f"8090-app.test|{host}", r.text
        missing = get({})
        assert missing.status_code == 403, missing.text
        assert "is missing" in missing.json()["message"]
        wrong = get({"e2b-traffic-access-token": token[:-1] + "x"})
        assert wrong.status_code == 403, wrong.text
        assert "is invalid" in wrong.json()["message"]

        info = sbx.get_info()
        assert info.network is not None
        assert info.network.get("allow_public_traffic") is False, info.network
        assert info.network.get("mask_request_host") == "${PORT}-app.test", info.network
        # The same sandbox, the same token (a connect answers it again).
        assert Sandbox.connect(sbx.sandbox_id).traffic_access_token == token
        server.kill()
    finally:
        sbx.kill()


def test_a_public_sandbox_has_no_traffic_token(sandbox):
    assert sandbox.traffic_access_token is None


# A self-signed certificate for localhost, made with openssl for this test
# (the same as crates/server/src/http/proxy/testdata/guest-tls.*).
TLS_CERT = """\
-----BEGIN CERTIFICATE-----
MIIBlDCCATugAwIBAgIUTuBnowg/Ls3/jQargnLjorPPkQowCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJbG9jYWxob3N0MCAXDTI2MTIwNzA1MjkzNloYDzIxMjYxMTEz
MDUyOTM2WjAUMRIwEAYDVQQDDAlsb2NhbGhvc3QwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAATAjPv9UTIZDTEPL2MRChcC/iICbNbDNZRU3LtZWCKEbUM2fplR0JtU
XnkBkLHf+qTAK9ecWxAOZHcWeuzqvhzDo2kwZzAdBgNVHQ4EFgQU6hEL6mTSG7zo
TWEXNEEQ7XOsYlQwHwYDVR0jBBgwFoAU6hEL6mTSG7zoTWEXNEEQ7XOsYlQwDwYD
VR0TAQH/BAUwAwEB/zAUBgNVHREEDTALgglsb2NhbGhvc3QwCgYIKoZIzj0EAwID
RwAwRAIgJ01LkP5x0PZzMRDX8raCApxS6nrpYYmoxRVdPWbaMtICIHRNT+SBtbTF
IDUqa6vG5K+/IJ8qxgvPmQDf8ofu8lV+
-----END CERTIFICATE-----
"""
TLS_KEY = """\
-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgRog1TrVabrPUIwWK
kRYlGGhG0Llg1QjSJpMH/1Hjl9GhRANCAATAjPv9UTIZDTEPL2MRChcC/iICbNbD
NZRU3LtZWCKEbUM2fplR0JtUXnkBkLHf+qTAK9ecWxAOZHcWeuzqvhzD
-----END PRIVATE KEY-----
"""

TLS_SERVER = """
import http.server, ssl

class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"over tls"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

server = http.server.HTTPServer(("0.0.0.0", 8443), Hello)
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain("/tmp/tls.crt", "/tmp/tls.key")
server.socket = context.wrap_socket(server.socket, server_side=True)
server.serve_forever()
"""


def test_an_https_port_is_reached_over_tls():
    sbx = create(network={"https_ports": [8443]})
    try:
        assert (sbx.get_info().network or {}).get("https_ports") == [8443]
        sbx.files.write("/tmp/tls.crt", TLS_CERT)
        sbx.files.write("/tmp/tls.key", TLS_KEY)
        sbx.files.write("/tmp/tls.py", TLS_SERVER)
        server = sbx.commands.run("python3 /tmp/tls.py", background=True)
        host = sbx.get_host(8443)

        def answered():
            try:
                r = get_via_node(host, "/")
            except httpx.HTTPError:
                return None
            return r if r.status_code == 200 else None

        r = wait_until(answered, timeout=60, what="the sandbox's HTTPS server")
        assert r.text == "over tls"
        server.kill()
    finally:
        sbx.kill()
