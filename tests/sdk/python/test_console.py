"""The web console (/console) end to end: a sandbox and a fork of 2 made
through the SDK, then Debian's Chromium, driven headless by Playwright, logs
in (a wrong key first), sees them in the table, opens the fork tree, finds
the children drawn under the parent, kills one child from the tree (the
node then reports that child gone), opens the parent's page and the
templates.

Screenshots land in target/console-screenshots/ (CONSOLE_SCREENSHOTS
overrides), named by step; docs/src/console.md describes them. Chromium
comes from scripts/sdk-test.sh's set-up (`apt-get install chromium`):
Playwright's own browser download is not used."""

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import RUN_META
from e2b import Sandbox, SandboxNotFoundException
from playwright.sync_api import Browser, Dialog, Page, expect, sync_playwright

pytestmark = pytest.mark.lifecycle

API_URL = os.environ.get("E2B_API_URL", "")
API_KEY = os.environ.get("E2B_API_KEY", "")
TEMPLATE = os.environ.get("SDK_TEST_TEMPLATE", "base")
SHOTS = Path(
    os.environ.get("CONSOLE_SCREENSHOTS")
    or Path(__file__).resolve().parents[3] / "target" / "console-screenshots"
)
# The lab is slow: a page's calls wait on a node under emulation.
WAIT_MS = 60_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    chromium = shutil.which("chromium")
    assert chromium, (
        "chromium is missing: scripts/sdk-test.sh installs it (apt-get install chromium)"
    )
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    pg = context.new_page()
    pg.set_default_timeout(WAIT_MS)
    yield pg
    context.close()


def shot(page: Page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def node(page: Page, sandbox_id: str) -> str:
    return f'#tree li[data-sandbox-id="{sandbox_id}"]'


def test_console_shows_the_fork_tree_and_kills_a_child(page: Page) -> None:
    run = RUN_META["sdk_run"]
    parent = Sandbox.create(TEMPLATE, metadata={**RUN_META, "case": "console"}, timeout=600)
    children: list[Sandbox] = []
    try:
        forked = parent.fork(count=2, timeout=600)
        children = [c for c in forked if isinstance(c, Sandbox)]
        assert len(children) == 2, forked
        ids = [c.sandbox_id for c in children]

        page.goto(f"{API_URL}/console/")
        # A wrong key is refused, and says so.
        page.fill("#api-key", "not-a-key")
        page.click("#login button[type=submit]")
        expect(page.locator("#login-error")).to_contain_text("401")
        shot(page, "01-login-refused")

        page.fill("#api-key", API_KEY)
        page.click("#login button[type=submit]")
        expect(page.locator("#login")).to_be_hidden()
        # The table, filtered down to this run's sandboxes by metadata.
        page.fill("input[name=metadata]", f"sdk_run={run}, case=console")
        page.press("input[name=metadata]", "Tab")
        for sid in [parent.sandbox_id, *ids]:
            row = page.locator(f'#sandboxes tr[data-sandbox-id="{sid}"]')
            expect(row.locator("[data-state]")).to_have_text("running")
        expect(page.locator("#sandboxes tbody tr")).to_have_count(3)
        shot(page, "02-sandboxes")

        page.locator(f'#sandboxes tr[data-sandbox-id="{parent.sandbox_id}"]').get_by_text(
            "Fork tree"
        ).click()
        root = node(page, parent.sandbox_id)
        for n, sid in enumerate(ids):
            # Drawn under the parent, with the branch index the fork gave it.
            child = page.locator(f'{root} > ul > li[data-sandbox-id="{sid}"]')
            expect(child).to_have_attribute("data-state", "running")
            expect(child.locator(".branch").first).to_have_text(f"branch {n}")
        expect(page.locator(f"{root} > .node .branch")).to_have_text("root")
        shot(page, "03-fork-tree")

        # Kill the first child from the tree: the page asks first.
        def accept(dialog: Dialog) -> None:
            dialog.accept()

        page.once("dialog", accept)
        page.locator(f'{node(page, ids[0])} > .node button[data-action="kill"]').click()
        expect(page.locator(node(page, ids[0]))).to_have_attribute("data-state", "gone")
        expect(page.locator(node(page, ids[1]))).to_have_attribute("data-state", "running")
        shot(page, "04-fork-tree-after-kill")
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(ids[0])

        # The parent's page: its details, the charts and the log tail.
        page.locator(f"{root} > .node a.id").click()
        expect(page.locator("#view h1")).to_contain_text(parent.sandbox_id)
        details = page.locator("dl.details")
        expect(details).to_contain_text("case=console")
        expect(details).to_contain_text("256 MiB")
        expect(page.locator("#metrics svg")).to_have_count(2)
        expect(page.locator("#logs")).to_be_visible()
        shot(page, "05-sandbox")

        # The templates: the suite's own among them.
        page.locator("#nav").get_by_text("Templates").click()
        expect(page.locator("#templates tbody")).to_contain_text(TEMPLATE)
        shot(page, "06-templates")
    finally:
        for c in children:
            with contextlib.suppress(SandboxNotFoundException):
                c.kill()
        parent.kill()
