"""Harbor, the real package, against a sandfork node: `harbor run --env e2b
-a oracle` on the tasks in tasks/ (Harbor's own format), configured by the
E2B variables alone, at concurrency 4 (two attempts per task) and then, in
the long tier, 1.

Harbor exits 0 even when every trial errored, so the test reads Harbor's
result files: each task ran as often as asked, no trial raised, every reward
is 1.0. Then the same with sandfork's adapter (fork per group:
`--env sandfork.integrations.harbor:ForkingE2B`), checked on the node's
lifecycle events: one set-up sandbox per task, every trial a fork of it,
each set-up sandbox gone at the job's end.

Env: E2B_API_KEY and E2B_API_URL (or E2B_DOMAIN), with E2B_SANDBOX_URL as
the SDK tests set it, name the node (scripts/harbor-test.sh starts one).
HARBOR_TEST_OUT: where Harbor's job directories and logs go (default: a
pytest temporary directory).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

TASKS = Path(__file__).resolve().parent / "tasks"
# the sandfork package (pure Python), for its Harbor adapter
PACKAGE = Path(__file__).resolve().parents[2] / "python" / "src"
# by module: the venv is built elsewhere and renamed, so its scripts' #! lines
# name a path that is gone
HARBOR = (sys.executable, "-m", "harbor.cli.main")
# The variables that point Harbor's E2B environment at the node: nothing else
# of E2B's is passed on.
E2B_VARIABLES = ("E2B_API_KEY", "E2B_API_URL", "E2B_DOMAIN", "E2B_SANDBOX_URL")
# A whole job's bound: the lab is 20-50x slower than hardware.
JOB_TIMEOUT_S = 1500


def task_names() -> list[str]:
    return sorted(p.name for p in TASKS.iterdir() if (p / "task.toml").is_file())


def harbor_env() -> dict[str, str]:
    """This process's environment without E2B's variables but those naming
    the node, with Harbor's telemetry off and litellm's price list read from
    the package (both would reach out of the machine), and the sandfork
    package importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({k: os.environ[k] for k in E2B_VARIABLES if k in os.environ})
    env["HARBOR_TELEMETRY"] = "0"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE), env.get("PYTHONPATH")]))
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not os.environ.get("E2B_API_KEY") or not (
        os.environ.get("E2B_API_URL") or os.environ.get("E2B_DOMAIN")
    ):
        pytest.fail("E2B_API_KEY and E2B_API_URL (or E2B_DOMAIN) must name a node")
    named = os.environ.get("HARBOR_TEST_OUT")
    if named:
        out = Path(named).resolve()
        out.mkdir(parents=True, exist_ok=True)
        return out
    return tmp_path_factory.mktemp("harbor")


def read_json(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path}: not a JSON object"
    return data


def trial_problem(result: dict[str, Any]) -> str | None:
    """What is wrong with one trial's result.json, or None when it solved its task."""
    exc = result.get("exception_info")
    if exc:
        return f"raised {exc.get('exception_type')}: {exc.get('exception_message')}"
    verifier = result.get("verifier_result") or {}
    rewards = verifier.get("rewards") or {}
    if rewards.get("reward") != 1.0:
        return f"rewards {rewards}"
    return None


# Concurrency 4 first, two attempts per task: a fresh node builds the
# templates at once (Harbor polls each build, then creates from
# `<name>:<buildID>`, two trials from each build); then, in the long tier
# (SANDFORK_TEST_TIER=long: 1.5 min more), 1, one attempt, which finds each
# template's build by its tag and creates from it.
@pytest.mark.parametrize(
    ("concurrency", "attempts"),
    [
        (4, 2),
        pytest.param(
            1,
            1,
            marks=pytest.mark.skipif(
                os.environ.get("SANDFORK_TEST_TIER") != "long",
                reason="long tier (scripts/test.sh --only harbor_long)",
            ),
        ),
    ],
)
def test_oracle_solves_every_task(out_dir: Path, concurrency: int, attempts: int) -> None:
    run_oracle(
        out_dir, f"oracle-n{concurrency}-k{attempts}", ["--env", "e2b"], concurrency, attempts
    )


def test_trials_fork_from_one_set_up_sandbox_per_task(out_dir: Path) -> None:
    """sandfork's fork per group for Harbor (sandfork.integrations.harbor):
    every trial of a task is a fork of one set-up sandbox, kept paused while
    the job runs and removed at its end by the job plugin."""
    before = {e["id"] for e in node_events()}
    adapter = "sandfork.integrations.harbor"
    env_args = ["--env", f"{adapter}:ForkingE2B", "--plugin", f"{adapter}:CloseTaskStates"]
    run_oracle(out_dir, "oracle-forks-n4-k2", env_args, concurrency=4, attempts=2)

    events = [e for e in node_events() if e["id"] not in before]
    by_type: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_type.setdefault(e["type"].removeprefix("sandbox.lifecycle."), []).append(e)
    setups = {
        e["sandboxId"]
        for e in by_type.get("created", [])
        if "sandfork.harbor.template" in e["eventData"]["sandbox_metadata"]
    }
    assert len(setups) == len(task_names()), f"set-up sandboxes {setups}"
    parents = [e["eventData"].get("parent_sandbox_id") for e in by_type.get("forked", [])]
    assert sorted(parents) == sorted(list(setups) * 2), f"forks from {parents}"
    # the job plugin removed the set-up sandboxes at the job's end
    killed = {e["sandboxId"] for e in by_type.get("killed", [])}
    assert setups <= killed, f"left on the node: {setups - killed}"


def node_events() -> list[dict[str, Any]]:
    """The node's recent lifecycle events (GET /events/sandboxes, every page)."""
    url = os.environ.get("E2B_API_URL") or f"https://api.{os.environ['E2B_DOMAIN']}"
    headers = {"X-API-Key": os.environ["E2B_API_KEY"]}
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        while True:
            page = client.get("/events/sandboxes", params={"limit": 100, "offset": len(events)})
            page.raise_for_status()
            got = page.json()
            assert isinstance(got, list)
            events += got
            if len(got) < 100:
                return events


def run_oracle(
    out_dir: Path, job: str, env_args: list[str], concurrency: int, attempts: int
) -> None:
    """`harbor run -a oracle` on every task, then Harbor's result files: each
    task ran as often as asked, no trial raised, every reward is 1.0."""
    names = task_names()
    assert len(names) >= 3, f"tasks missing in {TASKS}"
    jobs_dir = out_dir / "jobs"
    log = out_dir / f"{job}.log"
    argv = [*HARBOR, "run", "--path", str(TASKS), "--agent", "oracle", *env_args]
    argv += ["--n-concurrent", str(concurrency), "--n-attempts", str(attempts)]
    argv += ["--jobs-dir", str(jobs_dir)]
    argv += ["--job-name", job, "--quiet", "--yes"]
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            argv,
            env=harbor_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=JOB_TIMEOUT_S,
            check=False,
        )
    took = time.monotonic() - started
    print(f"\nharbor run {job}: {took:.1f} s (log: {log})")
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert proc.returncode == 0, f"harbor exited {proc.returncode}:\n{tail}"

    job_dir = jobs_dir / job
    results = {p.parent.name: read_json(p) for p in sorted(job_dir.glob("*/result.json"))}
    ran = sorted(str(r.get("task_name", "")).split("/")[-1] for r in results.values())
    # Harbor leaves out, silently, a task whose task.toml does not validate
    assert ran == sorted(names * attempts), f"trials {ran}, tasks {names}:\n{tail}"
    problems = {
        trial: problem
        for trial, result in results.items()
        if (problem := trial_problem(result)) is not None
    }
    for trial, problem in problems.items():
        print(f"{trial}: {problem}")
    assert not problems, f"trials not solved: {problems}"

    stats = read_json(job_dir / "result.json").get("stats") or {}
    assert stats.get("n_errored_trials") == 0, f"job stats: {stats}"
