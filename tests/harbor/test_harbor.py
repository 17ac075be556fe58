"""Harbor, the real package, against a sandfork node: `harbor run --env e2b
-a oracle` on the tasks in tasks/ (Harbor's own format), configured by the
E2B variables alone, at concurrency 4 (two attempts per task) and then, in
the long tier, 1.

Harbor exits 0 even when every trial errored, so the test reads Harbor's
result files: each task ran as often as asked, no trial raised, every reward
is 1.0.

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

import pytest

TASKS = Path(__file__).resolve().parent / "tasks"
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
    the package (both would reach out of the machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    env.update({k: os.environ[k] for k in E2B_VARIABLES if k in os.environ})
    env["HARBOR_TELEMETRY"] = "0"
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
    names = task_names()
    assert len(names) >= 3, f"tasks missing in {TASKS}"
    job = f"oracle-n{concurrency}-k{attempts}"
    jobs_dir = out_dir / "jobs"
    log = out_dir / f"{job}.log"
    argv = [*HARBOR, "run", "--path", str(TASKS), "--agent", "oracle", "--env", "e2b"]
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
    print(f"\nharbor run -n {concurrency} -k {attempts}: {took:.1f} s (log: {log})")
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
