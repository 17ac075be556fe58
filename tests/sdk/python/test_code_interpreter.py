"""The unmodified `e2b_code_interpreter` SDK against sandfork's `code-interpreter`
template (its own server on port 49999 over Jupyter kernels): `Sandbox.create()`
with the SDK's default template name, then `run_code` of Python with its
outputs, errors, figures, dataframes, contexts, and state kept across calls and
forks. The template is built first if the node has none (minutes; once per
machine for the venv, which is cached by content)."""

import base64
import re
import sys
import time
from dataclasses import dataclass

import pytest
from conftest import RUN_META
from e2b_code_interpreter import Execution, Sandbox
from polling import wait_until

# The first build of the template in an emulated lab takes long.
pytestmark = pytest.mark.timeout(5400)

NAME = "code-interpreter"


def _ready_template(api) -> dict | None:
    for t in api.get("/templates").json():
        if NAME in t["names"]:
            return t
    return None


@pytest.fixture(scope="module")
def template(api):
    """The template, built through sandfork's route if missing (its build
    time printed)."""
    started = time.monotonic()
    r = api.post("/templates", json={"name": NAME, "from": {"builtin": NAME}})
    if r.status_code == 202:
        tid, bid = r.json()["templateID"], r.json()["buildID"]

        def finished():
            s = api.get(f"/templates/{tid}/builds/{bid}/status").json()
            return s if s["status"] != "building" else None

        status = wait_until(finished, timeout=5000, interval=2, what="the template build")
        took = time.monotonic() - started
        tail = "\n".join(status["logs"][-40:])
        assert status["status"] == "ready", f"{status.get('reason')}\n{tail}"
        marks = [line for line in status["logs"] if " built in " in line or " cached" in line]
        print(f"\ncode-interpreter template built in {took:.1f} s; {marks}", file=sys.stderr)
    else:
        assert r.status_code == 409, r.text  # built already
    t = wait_until(lambda: _ready_template(api), timeout=60, what="the template listed")
    assert "code-interpreter-v1" in t["names"]
    assert t["buildStatus"] == "ready"
    return t


def _create() -> Sandbox:
    # No template named: the SDK's default, code-interpreter-v1.
    return Sandbox.create(metadata=dict(RUN_META), timeout=900)


@dataclass
class Fresh:
    """A sandbox and the first code it ran, right after its create."""

    sandbox: Sandbox
    first: Execution
    create_s: float
    first_run_s: float


@pytest.fixture(scope="module")
def fresh(template):
    # The module's tests share this one sandbox (a create and a kernel's
    # start are half a minute in the lab); its first run_code is made here,
    # before any test uses it, so that it is the one right after the create.
    t0 = time.monotonic()
    s = _create()
    try:
        created = time.monotonic()
        first = s.run_code("print('hello from the kernel')\n6 * 7")
        ran = time.monotonic()
        yield Fresh(s, first, created - t0, ran - created)
    finally:
        s.kill()


@pytest.fixture(scope="module")
def sbx(fresh):
    return fresh.sandbox


def test_run_code_answers_right_after_create(fresh):
    print(
        f"\ncreate {fresh.create_s:.2f} s, first run_code {fresh.first_run_s:.2f} s",
        file=sys.stderr,
    )
    ex = fresh.first
    assert ex.error is None, ex.error
    assert ex.logs.stdout == ["hello from the kernel\n"]
    assert ex.text == "42"
    assert ex.results[0].is_main_result
    assert ex.execution_count is not None


def test_stdout_stderr_and_callbacks(sbx):
    seen: list[str] = []
    ex = sbx.run_code(
        "import sys\nprint('out'); print('err', file=sys.stderr)",
        on_stdout=lambda m: seen.append(m.line),
    )
    assert ex.error is None
    assert ex.logs.stdout == ["out\n"]
    assert ex.logs.stderr == ["err\n"]
    assert seen == ["out\n"]
    assert ex.results == []


def test_an_error_has_its_name_value_and_traceback(sbx):
    ex = sbx.run_code("def f():\n    return 1 / 0\nf()")
    assert ex.error is not None
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    # IPython colours its tracebacks with ANSI escapes, as E2B's do.
    traceback = re.sub(r"\x1b\[[0-9;]*m", "", ex.error.traceback)
    assert "ZeroDivisionError" in traceback
    assert "return 1 / 0" in traceback
    # the context goes on
    assert sbx.run_code("'still here'").text == "still here"


def test_state_is_kept_between_calls(sbx):
    sbx.run_code("counter = 10")
    sbx.run_code("counter += 1")
    assert sbx.run_code("counter").text == "11"


def test_a_matplotlib_figure_comes_as_png(sbx):
    ex = sbx.run_code(
        """
        import matplotlib.pyplot as plt
        plt.plot([1, 2, 3], [1, 4, 9])
        plt.title("squares")
        plt.show()
        """
    )
    assert ex.error is None, ex.error
    figures = [r for r in ex.results if r.png]
    assert len(figures) == 1, ex.results
    assert base64.b64decode(figures[0].png).startswith(b"\x89PNG\r\n\x1a\n")
    assert figures[0].text and "Figure" in figures[0].text
    assert not figures[0].is_main_result


def test_a_pandas_dataframe_has_html_and_data(sbx):
    ex = sbx.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', 'z']})")
    assert ex.error is None, ex.error
    [r] = ex.results
    assert r.is_main_result
    assert "<table" in r.html
    assert r.data["a"] == {"0": 1, "1": 2, "2": 3}
    assert len(r.data["b"]) == 3
    assert "data" in r.formats()


def test_env_vars_hold_for_one_execution(sbx):
    code = "import os\nos.environ.get('SDK_CI_VAR', 'unset')"
    assert sbx.run_code(code, envs={"SDK_CI_VAR": "set"}).text == "set"
    assert sbx.run_code(code).text == "unset"


def test_contexts_are_kept_apart(sbx):
    a = sbx.create_code_context()
    b = sbx.create_code_context(cwd="/tmp")
    try:
        assert a.language == "python" and a.cwd == "/home/user"
        assert b.cwd == "/tmp"
        sbx.run_code("x = 'in a'", context=a)
        sbx.run_code("x = 'in b'", context=b)
        assert sbx.run_code("x", context=a).text == "in a"
        assert sbx.run_code("x", context=b).text == "in b"
        assert sbx.run_code("import os; os.getcwd()", context=b).text == "/tmp"
        # the default context has neither
        assert sbx.run_code("x").error.name == "NameError"
        ids = {c.id for c in sbx.list_code_contexts()}
        assert {a.id, b.id} <= ids
        sbx.restart_code_context(a)
        assert sbx.run_code("x", context=a).error.name == "NameError"
        assert sbx.run_code("x", context=b).text == "in b"
    finally:
        sbx.remove_code_context(a)
        sbx.remove_code_context(b)
    ids = {c.id for c in sbx.list_code_contexts()}
    assert a.id not in ids and b.id not in ids


def test_unknown_context_and_language_are_refused(sbx):
    from e2b import NotFoundException, SandboxException

    with pytest.raises(NotFoundException):
        sbx.restart_code_context("nosuchcontext")
    with pytest.raises(SandboxException, match="not available"):
        sbx.run_code("1", language="cobol")


@pytest.mark.lifecycle
def test_state_is_kept_across_a_fork_and_children_diverge(template):
    parent = _create()
    children: list = []
    try:
        ctx = parent.create_code_context()
        parent.run_code("value = 'parent'; import os; pid = os.getpid()")
        parent.run_code("other = 'in context'", context=ctx)
        results = parent.fork(count=2, timeout=900)
        children = [r for r in results if not isinstance(r, Exception)]
        assert len(children) == 2, results
        for n, child in enumerate(children):
            assert isinstance(child, Sandbox)
            # the kernel's state (and the kernel itself) came along
            assert child.run_code("value").text == "parent"
            assert child.run_code("os.getpid() == pid").text == "True"
            assert child.run_code("other", context=ctx).text == "in context"
            child.run_code(f"value = 'child {n}'")
        for n, child in enumerate(children):
            assert child.run_code("value").text == f"child {n}"
        assert parent.run_code("value").text == "parent"
        assert parent.run_code("other", context=ctx).text == "in context"
    finally:
        for c in children:
            c.kill()
        parent.kill()
