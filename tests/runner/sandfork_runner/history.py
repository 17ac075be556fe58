"""Every full run's outcome kept outside the checkout, and the flake table read
from the last few (`scripts/test.sh --flakes`).

CI runs each landing on a fresh clone, whose `target/test-runs` goes with it;
the history lives under $SANDFORK_CACHE/runner/ so that consecutive CI runs on
this machine add up to the table issue 38 asks for: each job's pass, fail and
retries over the last five full runs. Only a full run (no `--only`, no
`--lab-only`) is recorded: a partial one says nothing of the jobs it left out.
"""

import fcntl
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a job that needed its retry in this many of the runs read is a defect to fix
DEFECT_RETRIES = 2


def path() -> Path:
    cache = Path(os.environ.get("SANDFORK_CACHE", "/var/cache/sandfork"))
    return cache / "runner" / "history.jsonl"


def commit(root: Path) -> str | None:
    out = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def entry(summary: dict[str, Any], commit_id: str | None) -> dict[str, Any]:
    """One run as a line of the history: per job its result and tries, and
    whether a re-run followed a try during which the lab stood still."""
    return {
        "started": summary["started"],
        "duration_s": summary["duration_s"],
        "commit": commit_id,
        "passed": summary["passed"],
        "jobs": {
            job["name"]: {
                "result": job["result"],
                "tries": len(job["tries"]),
                "stall": any(t["lab_stood_still"] for t in job["tries"][:-1]),
                # tests a pytest suite ran again in place (retry.py)
                "rerun": sum(len(t.get("rerun_tests") or []) for t in job["tries"]),
                # where the minutes go, run after run (--flakes shows them)
                "s": round(job["duration_s"]),
                "lane": job["lane"],
            }
            for job in summary["jobs"]
        },
    }


def append(line: dict[str, Any], to: Path) -> None:
    """Appends under a lock: two runs on one machine may end together."""
    to.parent.mkdir(parents=True, exist_ok=True)
    with open(to, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(line, separators=(",", ":")) + "\n")


def read(source: Path, last: int) -> list[dict[str, Any]]:
    """The last `last` runs recorded, oldest first; a torn line (a run killed
    while writing) is passed over."""
    if not source.exists():
        return []
    runs = []
    for raw in source.read_text().splitlines():
        try:
            runs.append(json.loads(raw))
        except json.JSONDecodeError:
            continue
    return runs[-last:] if last > 0 else []


@dataclass(frozen=True)
class Row:
    job: str
    cells: tuple[str, ...]
    retried: int
    failed: int
    # the job's minutes in the newest run that recorded them
    minutes: float | None = None

    @property
    def defect(self) -> bool:
        return self.retried >= DEFECT_RETRIES or self.failed > 0


def cell(job: dict[str, Any] | None) -> str:
    """ok, ok/t (passed with tests run again in place), ok/r (passed on its
    retry; /rs: a try after a lab stall), FAIL, skip (it could not run on the
    machine), or - (not in that run or not run)."""
    if job is None or job["result"] == "not run":
        return "-"
    if job["result"] == "failed":
        return "FAIL"
    if job["result"] == "skipped":
        return "skip"
    if job["tries"] <= 1:
        return "ok/t" if job.get("rerun") else "ok"
    return "ok/rs" if job["stall"] else "ok/r"


def retried(job: dict[str, Any]) -> bool:
    """A second try, or tests run again inside one."""
    return bool(job["tries"] > 1 or job.get("rerun"))


def rows(runs: list[dict[str, Any]]) -> list[Row]:
    names: list[str] = []
    for run in runs:
        names.extend(n for n in run["jobs"] if n not in names)
    out = []
    for name in names:
        jobs = [run["jobs"].get(name) for run in runs]
        out.append(
            Row(
                job=name,
                cells=tuple(cell(j) for j in jobs),
                retried=sum(1 for j in jobs if j is not None and retried(j)),
                failed=sum(1 for j in jobs if j is not None and j["result"] == "failed"),
                minutes=next(
                    (j["s"] / 60 for j in reversed(jobs) if j is not None and "s" in j), None
                ),
            )
        )
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """The flake table: a job a row, a run a column (oldest first)."""
    if not runs:
        return f"no full run recorded in {path()} yet"
    width = 7
    head = f"{'job':<12} " + " ".join(f"{'run' + str(i + 1):<{width}}" for i in range(len(runs)))
    lines = [head + " retried failed   min"]
    for row in rows(runs):
        cells = " ".join(f"{c:<{width}}" for c in row.cells)
        minutes = "" if row.minutes is None else f"{row.minutes:.1f}"
        mark = "  <- defect" if row.defect else ""
        lines.append(f"{row.job:<12} {cells} {row.retried:>7} {row.failed:>6} {minutes:>5}{mark}")
    lines.append("")
    for i, run in enumerate(runs):
        minutes = run["duration_s"] / 60
        verdict = "passed" if run["passed"] else "failed"
        lines.append(
            f"run{i + 1}: {run['started']} {run['commit'] or '?'} {minutes:.1f} min {verdict}"
        )
    defects = [r.job for r in rows(runs) if r.defect]
    lines.append(
        f"defects (a retry in {DEFECT_RETRIES}+ runs, or a failure): "
        + (", ".join(defects) if defects else "none")
    )
    return "\n".join(lines)
