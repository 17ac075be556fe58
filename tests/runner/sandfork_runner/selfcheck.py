"""The runner's own check (the quick check `runner`): ruff's format and lint,
mypy and the unit tests, with the tools pinned in tests/runner/requirements.txt
in a venv under $SANDFORK_CACHE/runner/, keyed by that file and the
interpreter, built once (whole or not at all) and shared by concurrent runs."""

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # tests/runner
ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "requirements.txt"


def venv() -> Path:
    key = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SANDFORK_CACHE", "/var/cache/sandfork")) / "runner"
    path = cache / f"venv-{key}"
    if (path / "bin/python").exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"venv-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "bin/python").exists():
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f"venv-{key}.tmp.", dir=cache))
        try:
            print(f"runner: creating the tools' venv {path}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
            pip = [str(tmp / "bin/python"), "-m", "pip", "install", "-q"]
            subprocess.run(
                [*pip, "--disable-pip-version-check", "-r", str(REQUIREMENTS)], check=True
            )
            # `python -m` runs the tools, so the venv works under its final
            # name (its scripts' #! lines would not)
            tmp.rename(path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return path


def main() -> int:
    python = str(venv() / "bin/python")
    checks = [
        ("ruff format", [python, "-m", "ruff", "format", "--no-cache", "--check", str(HERE)]),
        ("ruff check", [python, "-m", "ruff", "check", "--no-cache", str(HERE)]),
        ("mypy", [python, "-m", "mypy"]),
        ("unit tests", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider"]),
    ]
    failed = []
    for name, argv in checks:
        # from tests/runner: mypy's and pytest's settings are in its pyproject.toml;
        # ruff's in the root's ruff.toml
        if subprocess.run(argv, cwd=HERE).returncode != 0:
            failed.append(name)
    if failed:
        print(f"runner: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
