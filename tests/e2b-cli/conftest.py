"""The session's CLI, against the node the environment names as for any E2B
user (E2B_API_URL, E2B_API_KEY; scripts/sdk-test.sh sets them), run by the
Node.js in E2B_CLI_NODE from the entry point in E2B_CLI_ENTRY (the cached
`npm ci` of package.json: scripts/sdk-setup.sh's setup_node and
setup_e2b_cli). The tests run in their files' order, and in a file in
their order: a file's sandbox (or template) is made once, by a fixture, for
the steps that need it."""

from __future__ import annotations

import os
import shutil

import pytest
from e2bcli import E2bCli

NEEDED = ("E2B_API_URL", "E2B_API_KEY", "E2B_CLI_NODE", "E2B_CLI_ENTRY")


def pytest_configure(config: pytest.Config) -> None:
    missing = [name for name in NEEDED if not os.environ.get(name)]
    if missing:
        raise pytest.UsageError(f"set {', '.join(missing)} (scripts/sdk-test.sh --suite cli does)")
    if shutil.which("tmux") is None:
        raise pytest.UsageError("tmux is missing: run scripts/deps.sh")


@pytest.fixture(scope="session")
def cli(tmp_path_factory: pytest.TempPathFactory) -> E2bCli:
    return E2bCli(
        node=os.environ["E2B_CLI_NODE"],
        entry=os.environ["E2B_CLI_ENTRY"],
        home=tmp_path_factory.mktemp("home"),
        api_url=os.environ["E2B_API_URL"],
        api_key=os.environ["E2B_API_KEY"],
    )
