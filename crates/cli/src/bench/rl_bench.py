"""The `rl` phase of `sandfork bench` (`--only rl`): when does fork pay?

For each N (children) and k (steps), a stateful episode runs to step k in a
fresh parent sandbox and is branched N ways, each way on its own:

  fork        `POST /sandboxes/{id}/fork` (count N), each child connected and
              answering a command: the parent's first fork (it pays for
              writing the parent's memory out once);
  fork_again  a second fork of the same parent (a node returned to: only what
              changed since is written); reported, not in the comparison;
  snapshot    `create_snapshot()` of another fresh parent, then N creates from
              it (at once, one thread each), each answering;
  replay      N fresh creates of the template (at once), each running the
              episode's k steps again.

Measured per (N, k, way): the time until all N children are ready, the
parent's pause (fork: the node's `sandfork-parent-paused-ms` header;
snapshot: the snapshot call, an upper bound; replay: none), the node's
memory per child (Pss over the node's processes and the drop of
MemAvailable, with the children up minus before them), and fidelity: does
every child see the parent's files, its background process, and the value
that process holds in memory.

The episode (bash only, as cheap as an agent's shell step can be): step 1
starts a background process holding a running total in its memory (a bash
loop behind two FIFOs, nothing on disk) and writes a random token (the
stand-in for a step whose result is not reproducible: a generated key, a
timestamp, a download); every step i appends to a log, writes a file of
i * 50 lines and adds i * i to the total. Replay reproduces all but the
token; fork and snapshot copy it. The node's first fork and snapshot (of a
throwaway sandbox) are a warm-up, not counted.

Imported by sdk_bench.py (written next to it by `sandfork bench`), and by
tests/sdk/python/test_network.py for its pip helpers (host_pip_settings,
guest_pip_env).
"""

import functools
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

EPISODE = "/home/user/episode"
WAYS = ("fork", "snapshot", "replay")
# How long the node's VMM count must hold still before and after a way (the
# warm pool refilled, the children's VMMs up): 48 waits in the full phase.
SETTLE_S = 2.0
# Not a way of its own: a second fork of the same parent (not in `crossover`).
AGAIN = "fork_again"

# The background process: the total lives in the loop's variable only; a
# request on `in` is answered on `out` (both FIFOs, so nothing is stored).
_SERVER = (
    "s=0; while true; do read -r cmd < in; "
    'case "$cmd" in add\\ *) s=$((s + ${cmd#add })) ;; esac; '
    'echo "$s" > out; done'
)

START = (
    f"mkdir -p {EPISODE} && cd {EPISODE} && mkfifo in out && "
    "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n' > token && "
    f"(setsid bash -c '{_SERVER}' </dev/null >/dev/null 2>&1 & echo $! > pid)"
)

# What a child (and the parent) sees: the total the process holds, a digest
# of the files, and whether the recorded process is alive.
CHECK = (
    f"cd {EPISODE} && "
    'p=$(cat pid) && if kill -0 "$p" 2>/dev/null; then echo proc=alive; else echo proc=gone; fi; '
    "echo files=$(cat token log f_* | sha256sum | cut -c1-16); "
    # bounded: a copy without the process would wait for a reader for ever
    "timeout 20 bash -c 'echo get > in && read -r v < out && echo mem=$v'"
)


def step_command(i):
    """Step i (1-based) of the episode; it prints the total after it."""
    start = f"{START} && " if i == 1 else ""
    return (
        f"{start}cd {EPISODE} && echo step {i} >> log && seq 1 {i * 50} > f_{i:03d} && "
        f"echo 'add {i * i}' > in && read -r v < out && echo total=$v"
    )


def expected_total(k):
    return sum(i * i for i in range(1, k + 1))


def parse_check(stdout):
    """`CHECK`'s answer as a dict: mem, files, proc."""
    seen = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            seen[key.strip()] = value.strip()
    return seen


def fidelity(parent, children):
    """How many children match the parent in each respect; `all` when every
    child matches in all of them."""
    counts = {
        "files": sum(c.get("files") == parent.get("files") for c in children),
        "process": sum(c.get("proc") == "alive" for c in children),
        "memory": sum(c.get("mem") == parent.get("mem") for c in children),
    }
    counts["children"] = len(children)
    counts["all"] = bool(children) and all(v == len(children) for v in counts.values())
    return counts


def crossover(cases, counts, steps):
    """From the cases measured: per N, the smallest k from which fork was the
    fastest way to N ready children at that k and every larger k (None if
    it never was), and every case where another way was faster or fork
    failed."""
    by = {(c["n"], c["k"]): c for c in cases}
    wins_from, losses = {}, []
    for n in counts:
        won = {}
        for k in steps:
            case = by.get((n, k))
            if case is None:
                continue
            ready = {w: case[w].get("ready_ms") for w in WAYS if w in case}
            fork = ready.get("fork")
            others = {w: v for w, v in ready.items() if w != "fork" and v is not None}
            best = min(others.items(), key=lambda kv: kv[1]) if others else None
            won[k] = fork is not None and (best is None or fork < best[1])
            if not won[k]:
                losses.append(
                    {
                        "n": n,
                        "k": k,
                        "faster": best[0] if best else None,
                        "fork_ms": fork,
                        "faster_ms": best[1] if best else None,
                    }
                )
        measured = [k for k in steps if k in won]
        wins_from[str(n)] = next(
            (k for i, k in enumerate(measured) if all(won[j] for j in measured[i:])), None
        )
    return wins_from, losses


class RlBench:
    """The phase, on the SDK bench's helpers (`Bench`: create, answer, kill,
    settle, cleanup, the bounded samples and the node's memory)."""

    def __init__(
        self, bench, counts, steps, node_memory, mem_available_kib, progress=None, budget_s=0.0
    ):
        self.b = bench
        self.counts = counts
        self.steps = sorted(steps)
        self.node_memory = node_memory
        self.mem_available_kib = mem_available_kib
        # called with the cases so far after each one (the bench saves them:
        # a phase cut short by the bench's --timeout keeps what it measured)
        self.progress = progress or (lambda cases: None)
        self.budget_s = budget_s

    def log(self, msg):
        from sdk_bench import log

        log(f"rl: {msg}")

    def run(self, cmd, sbx, timeout=300):
        return sbx.commands.run(cmd, timeout=timeout, request_timeout=timeout)

    def run_env(self, cmd, sbx, envs, timeout=300):
        return sbx.commands.run(cmd, envs=envs, timeout=timeout, request_timeout=timeout)

    def check(self, sbx):
        return parse_check(self.run(CHECK, sbx).stdout)

    def episode(self, k):
        """A fresh parent run to step k: (the sandbox, what it sees, ms)."""
        b = self.b
        from sdk_bench import bounded, ms

        parent = bounded(b.create, b.sample_timeout(), "an episode's parent")
        with b.lock:
            b.created.remove(parent)  # not for `cleanup`: it outlives each way
        try:
            t0 = time.perf_counter()
            for i in range(1, k + 1):
                out = self.run(step_command(i), parent).stdout.strip()
                if out != f"total={expected_total(i)}":
                    raise RuntimeError(f"step {i} of the parent answered {out!r}")
            took = ms(time.perf_counter() - t0)
            return parent, self.check(parent), took
        except BaseException:
            b.kill(parent)
            raise

    def way(self, case, key, way, parent, n, k, state):
        """One way of one case, bounded; its figures (or error) in `case`."""
        b = self.b
        from sdk_bench import bounded, describe

        try:
            case[key] = bounded(
                functools.partial(self.branch, way, parent, n, k, state),
                b.sample_timeout(),
                f"{key} of {n} at step {k}",
            )
        except Exception as e:
            case[key] = {"error": describe(e)}
        finally:
            b.cleanup()
        self.log(f"n={n} k={k} {key}: {case[key].get('ready_ms', case[key].get('error'))}")

    def warm_up(self):
        """The node's first fork and first snapshot, not counted: what a node
        does once (not once per episode) is not a branch's cost."""
        b = self.b
        from sdk_bench import describe, ms

        t0 = time.perf_counter()
        try:
            parent, state, _ = self.episode(1)
            try:
                for way in ("fork", "snapshot"):
                    self.branch(way, parent, 1, 1, state)
            finally:
                b.kill(parent)
                b.cleanup()
            return {"ms": ms(time.perf_counter() - t0)}
        except Exception as e:
            self.log(f"warm-up failed: {describe(e)}")
            return {"error": describe(e)}

    def measure(self):
        """Per (N, k): a fresh episode forked (its first branch), then forked
        again (`fork_again`: a node returned to); another fresh episode
        snapshotted, and the replay checked against it."""
        b = self.b
        started = time.monotonic()
        warm_up = self.warm_up()
        cases, skipped = [], []
        # N by N, each over every k: a phase cut by the budget still has
        # whole rows to compare
        for n in self.counts:
            for k in self.steps:
                if self.budget_s and time.monotonic() - started > self.budget_s:
                    skipped.append({"n": n, "k": k})
                    continue
                case = {"n": n, "k": k}
                for ways in (("fork", "fork_again"), ("snapshot", "replay")):
                    try:
                        parent, state, took = self.episode(k)
                    except Exception as e:
                        for key in ways:
                            case[key] = {"error": f"the episode: {e!r}"}
                        continue
                    case.setdefault("episode_ms", took)
                    self.log(f"n={n} k={k}: parent at step {k} in {took:.0f} ms: {state}")
                    try:
                        for key in ways:
                            way = "fork" if key == "fork_again" else key
                            self.way(case, key, way, parent, n, k, state)
                    finally:
                        b.kill(parent)
                        b.cleanup()
                cases.append(case)
                self.progress(cases)
        wins_from, losses = crossover(cases, self.counts, self.steps)
        return {
            "counts": self.counts,
            "steps": self.steps,
            "cases": cases,
            "fork_wins_from_k": wins_from,
            "fork_loses": losses,
            "warm_up_not_counted": warm_up,
            # past --rl-budget: not measured
            "not_measured": skipped,
            "method": "per (N, k) a fresh episode run to step k in a parent sandbox; "
            "fork: its first fork, fork_again: a second fork of the same parent; "
            "snapshot on another fresh parent, replay checked against that one; per "
            "way: from the call until every child answered a command (replay: ran "
            "the k steps too), children checked against their parent (files digest, "
            "background process alive, its in-memory total), node memory with the "
            "children up minus before them (warm pool settled both times), over N; "
            "the node's first fork and snapshot are a warm-up, not counted",
        }

    def branch(self, way, parent, n, k, state):
        b = self.b
        from sdk_bench import describe, ms

        baseline = b.settle(still_s=SETTLE_S)
        before = self.node_memory(b.args.server_pid, b.args.vmm_exe)
        avail_before = self.mem_available_kib()
        errors, extra = [], {}
        t0 = time.perf_counter()
        if way == "fork":
            children = self.fork(parent, n, errors, extra)
        elif way == "snapshot":
            children = self.snapshot(parent, n, errors, extra)
        else:
            children = self.replay(n, k, errors)
        ready_ms = ms(time.perf_counter() - t0)
        checks = []
        for c in children:
            try:
                checks.append(self.check(c))
            except Exception as e:
                errors.append(f"check {c.sandbox_id}: {describe(e)}")
                checks.append({})
        b.settle(at_least=baseline + len(children), still_s=SETTLE_S)
        after = self.node_memory(b.args.server_pid, b.args.vmm_exe)
        avail_after = self.mem_available_kib()
        got = max(1, len(children))
        result = {
            "ready_ms": ready_ms if not errors and len(children) == n else None,
            "children": len(children),
            "parent_paused_ms": extra.pop("paused_ms", None),
            "child_pss_mib": round((after["pss_kib"] - before["pss_kib"]) / 1024.0 / got, 2),
            "mem_available_drop_mib": round((avail_before - avail_after) / 1024.0 / got, 2),
            "fidelity": fidelity(state, checks),
            **extra,
        }
        if errors:
            result["errors"] = errors[:10]
            result["elapsed_ms"] = ready_ms
        snapshot_id = extra.get("snapshot_id")
        b.kill_all(children)
        if snapshot_id:
            try:
                b.Sandbox.delete_snapshot(snapshot_id, **b.opts)
            except Exception as e:
                self.log(f"deleting snapshot {snapshot_id}: {describe(e)}")
        return result

    def _ready_all(self, n, make, errors):
        """`make(i)` for i < n at once; the sandboxes that answered."""
        from sdk_bench import describe

        def one(i):
            try:
                return make(i)
            except Exception as e:
                return e

        with ThreadPoolExecutor(max(1, n)) as pool:
            results = list(pool.map(one, range(n)))
        errors.extend(describe(r) for r in results if isinstance(r, Exception))
        return [r for r in results if not isinstance(r, Exception)]

    def _child(self, item, params):
        """A fork child from the node's answer, built as the SDK's own
        `Sandbox.fork` builds it (no further request)."""
        from e2b.connection_config import ConnectionConfig
        from packaging.version import Version

        s = item["sandbox"]
        headers = {
            "E2b-Sandbox-Id": s["sandboxID"],
            "E2b-Sandbox-Port": str(ConnectionConfig.envd_port),
        }
        if s.get("envdAccessToken") is not None:
            headers["X-Access-Token"] = s["envdAccessToken"]
        return self.b.Sandbox(
            sandbox_id=s["sandboxID"],
            sandbox_domain=s.get("domain"),
            envd_version=Version(s["envdVersion"]),
            envd_access_token=s.get("envdAccessToken"),
            traffic_access_token=s.get("trafficAccessToken"),
            connection_config=ConnectionConfig(extra_sandbox_headers=headers, **params),
        )

    def fork(self, parent, n, errors, extra):
        """The SDK's fork request, sent here so that the node's header with
        the parent's pause can be read; the children then as the SDK makes
        them."""
        b = self.b
        from sdk_bench import PARENT_PAUSED_HEADER, SANDBOX_TTL_S, _api

        answer = _api(
            "POST",
            f"/sandboxes/{parent.sandbox_id}/fork",
            json={"count": n, "timeout": SANDBOX_TTL_S},
        )
        if answer.status_code != 201:
            raise RuntimeError(f"fork of {n}: {answer.status_code} {answer.text[:500]}")
        paused = answer.headers.get(PARENT_PAUSED_HEADER)
        extra["paused_ms"] = float(paused) if paused is not None else None
        params = b.Sandbox._resolve_api_params(**b.opts)
        children = []
        for item in answer.json():
            if "sandbox" not in item:
                errors.append(f"fork: {item.get('error', item)}")
                continue
            child = self._child(item, params)
            with b.lock:
                b.created.append(child)
            children.append(child)

        def ready(i):
            b.answer(children[i])
            return children[i]

        return self._ready_all(len(children), ready, errors)

    def snapshot(self, parent, n, errors, extra):
        b = self.b
        from sdk_bench import ms

        t0 = time.perf_counter()
        info = parent.create_snapshot(**b.opts)
        extra["paused_ms"] = ms(time.perf_counter() - t0)
        extra["parent_paused_is_upper_bound"] = True
        extra["snapshot_id"] = info.snapshot_id

        def make(_):
            sbx = b.Sandbox.create(info.snapshot_id, timeout=3600, metadata=b.meta, **b.opts)
            with b.lock:
                b.created.append(sbx)
            b.answer(sbx)
            return sbx

        return self._ready_all(n, make, errors)

    def replay(self, n, k, errors):
        lock = threading.Lock()
        bad = []

        def make(_):
            sbx = self.b.create()
            for i in range(1, k + 1):
                out = self.run(step_command(i), sbx).stdout.strip()
                if out != f"total={expected_total(i)}":
                    with lock:
                        bad.append(f"{sbx.sandbox_id} step {i}: {out!r}")
            return sbx

        children = self._ready_all(n, make, errors)
        errors.extend(bad)
        return children


def self_test():
    assert expected_total(3) == 14
    assert "mkfifo" in step_command(1) and "mkfifo" not in step_command(2)
    assert "f_032" in step_command(32)
    parent = parse_check("mem=14\nfiles=abc\nproc=alive\n")
    assert parent == {"mem": "14", "files": "abc", "proc": "alive"}
    same = dict(parent)
    replayed = {"mem": "14", "files": "other", "proc": "alive"}
    f = fidelity(parent, [same, replayed])
    assert f == {"files": 1, "process": 2, "memory": 2, "children": 2, "all": False}, f
    assert fidelity(parent, [same, same])["all"]
    assert not fidelity(parent, [])["all"]

    def case(n, k, fork, snap, replay):
        return {
            "n": n,
            "k": k,
            "fork": {"ready_ms": fork},
            "snapshot": {"ready_ms": snap},
            "replay": {"ready_ms": replay},
        }

    cases = [
        case(4, 1, 900, 1500, 600),  # replay of one step beats the fork
        case(4, 8, 900, 1500, 1200),
        case(4, 32, 950, 1600, 4000),
        case(16, 1, 2000, 5000, 3000),
        case(16, 8, None, 5000, 6000),  # the fork failed
        case(16, 32, 2100, 5200, 9000),
    ]
    wins, losses = crossover(cases, [4, 16], [1, 8, 32])
    assert wins == {"4": 8, "16": 32}, wins
    assert [(x["n"], x["k"], x["faster"]) for x in losses] == [
        (4, 1, "replay"),
        (16, 8, "snapshot"),
    ], losses
    # never faster: no k
    wins, _ = crossover([case(4, 1, 900, 100, 100)], [4], [1])
    assert wins == {"4": None}, wins
    group_self_test()


# --- fork per group: a task set up once, or once per child -------------------
#
# The `rl_group` phase (`--only rl` runs it after the (N, k) cases): a rollout
# group of N starts from one task state, after a setup of realistic length:
# a repository checkout (a git clone of a bundle of real source uploaded to
# the guest) and a `pip install` of a few small packages from the package
# index, through the guest's own pip (the host's index settings and trust
# store handed over, as the SDK's network test does). `each`: N sandboxes
# created at once, each running the setup (what frameworks do today);
# `fork`: one sandbox runs it, then forks N children (sandfork's
# `TaskState.group`). Both until every child answered a check of the state
# (the checkout's head, the packages importable).

# Pure-Python wheels of a few kB to a few hundred, without dependencies.
GROUP_PACKAGES = ("six", "idna", "iniconfig", "attrs")
GROUP_REPO = "/home/user/repo"
GROUP_CHECK = (
    f"cd {GROUP_REPO} && git rev-parse --short HEAD && git ls-files | wc -l && "
    f"python3 -c 'import {', '.join(GROUP_PACKAGES)}; print(\"imports=ok\")'"
)


def host_pip_settings():
    """This host's pip settings that say where the index is and how to trust
    it (`pip config list`: files, then PIP_* variables, pip's precedence):
    index-url, extra-index-url, cert, trusted-host. Local find-links are left
    out: they would spare the guest the index."""
    import subprocess

    out = ""
    # The venv may have no pip; the host's pip3 reads the same files.
    for pip in ([sys.executable, "-m", "pip"], ["pip3"]):
        try:
            done = subprocess.run(
                [*pip, "config", "list"], capture_output=True, text=True, check=False
            )
        except OSError:
            continue
        if done.returncode == 0:
            out = done.stdout
            break
    wanted = ("index-url", "extra-index-url", "cert", "trusted-host")
    settings = {}
    for line in sorted(out.splitlines(), key=lambda line: line.startswith(":env:")):
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in wanted and value:
            settings[name] = value.strip().strip("'\"")
    return settings


def guest_pip_env(settings):
    """The guest's pip variables from the host's settings, and the trust
    store to upload (bytes or None)."""
    env = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    for name in ("index-url", "extra-index-url", "trusted-host"):
        if name in settings:
            env["PIP_" + name.upper().replace("-", "_")] = settings[name]
    cert = settings.get("cert")
    bundle = None
    if cert and os.path.isfile(cert):
        with open(cert, "rb") as f:
            bundle = f.read()
        env["PIP_CERT"] = "/tmp/pip-ca.pem"
    return env, bundle


def source_bundle(workdir):
    """A git bundle of real source (the e2b SDK's package, as installed here)
    in a few commits: what the guest clones. Its bytes and a description."""
    import shutil
    import subprocess

    import e2b

    src = os.path.dirname(e2b.__file__)
    repo = os.path.join(workdir, "repo")
    git = ["git", "-C", repo, "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    subprocess.run(["git", "init", "-q", repo], check=True)
    parts = sorted(e for e in os.listdir(src) if e != "__pycache__")
    # one commit per top-level entry: a history, not one blob
    for entry in parts:
        path = os.path.join(src, entry)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(repo, entry), ignore=ignore)
        else:
            shutil.copy(path, os.path.join(repo, entry))
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", f"add {entry}", "--allow-empty"], check=True)
    bundle = os.path.join(workdir, "repo.bundle")
    subprocess.run([*git, "bundle", "create", "-q", bundle, "--all"], check=True)
    with open(bundle, "rb") as f:
        data = f.read()
    files = subprocess.run([*git, "ls-files"], capture_output=True, text=True, check=True)
    return data, {
        "files": len(files.stdout.splitlines()),
        "commits": len(parts),
        "bytes": len(data),
    }


def setup_command():
    """The task's setup, in the guest, as its user: the checkout, then the
    install (into ~/.local, as a plain `pip install` does for a user). pip
    retries a reset connection 10 times, not 5: 16 guests installing at once
    through this lab's TLS-inspecting proxy had one of them reset 5 times in a
    row (`each` of 16 lost a child to it)."""
    return (
        f"git clone -q /tmp/repo.bundle {GROUP_REPO} && cd {GROUP_REPO} && "
        f"pip install --quiet --retries 10 {' '.join(GROUP_PACKAGES)}"
    )


def per_child(before, after, n):
    """The node's memory that `n` children added, per child (MiB)."""
    return {
        "child_private_mib": round((after["private_kib"] - before["private_kib"]) / 1024.0 / n, 2),
        "child_pss_mib": round((after["pss_kib"] - before["pss_kib"]) / 1024.0 / n, 2),
    }


def group_keys(cases):
    """The phase's keys from its cases: per N (as a string) the time of each
    way and the private memory per child."""
    keys = {
        "group_setup_fork_ms": {},
        "group_setup_each_ms": {},
        "group_child_private_mib": {"fork": {}, "each": {}},
    }
    for case in cases:
        n = str(case["n"])
        for way in ("fork", "each"):
            got = case.get(way, {})
            keys[f"group_setup_{way}_ms"][n] = got.get("ready_ms")
            keys["group_child_private_mib"][way][n] = got.get("child_private_mib")
    return keys


class GroupBench:
    """The `rl_group` phase on the rl phase's helpers (`RlBench`: fork,
    answers, the node's memory)."""

    def __init__(self, rl, counts, workdir, progress=None):
        self.rl = rl
        self.b = rl.b
        self.counts = counts
        self.workdir = workdir
        # called with the cases so far after each N (the bench saves them)
        self.progress = progress or (lambda cases: None)

    def log(self, msg):
        self.rl.log(f"group: {msg}")

    def set_up(self, sbx, env, ca, bundle):
        """The task's setup in one sandbox, and what it answers after."""
        if ca is not None:
            sbx.files.write("/tmp/pip-ca.pem", ca)
        sbx.files.write("/tmp/repo.bundle", bundle)
        self.rl.run_env(setup_command(), sbx, env, timeout=1800)
        return self.rl.run(GROUP_CHECK, sbx).stdout

    def measure(self):
        from sdk_bench import describe

        env, ca = guest_pip_env(host_pip_settings())
        bundle, repo = source_bundle(self.workdir)
        cases = []
        for n in self.counts:
            case = {"n": n}
            for way in ("each", "fork"):
                try:
                    case[way] = bounded_way(self, way, n, env, ca, bundle)
                except Exception as e:
                    case[way] = {"error": describe(e)}
                finally:
                    self.b.cleanup()
                got = case[way]
                self.log(f"n={n} {way}: {got.get('ready_ms', got.get('error'))}")
            cases.append(case)
            self.progress(cases)
        errors = [
            f"n={c['n']} {w}: {c[w]['error']}"
            for c in cases
            for w in ("each", "fork")
            if "error" in c[w]
        ]
        return {
            **group_keys(cases),
            # a way that could not run fails the phase (a null is no figure)
            **({"failed": "; ".join(errors)} if errors else {}),
            "cases": cases,
            "setup": {
                "repository": repo,
                "packages": list(GROUP_PACKAGES),
                "command": setup_command(),
                "index": "the host's pip settings (index, trust store), else pip's default",
            },
            "method": "per N: `each`, N sandboxes created at once, each uploading a git "
            "bundle of real source and its CA bundle, cloning it and `pip install`ing the "
            "packages from the index, until all N answered a check of that state; `fork`, "
            "one sandbox doing the same, then one fork call of N children until all N "
            "answered the check (ready_ms is the setup plus the fork); memory is the node's "
            "(smaps_rollup over its processes) with the children up minus once they are killed "
            "(fork: the set-up parent up both times), over N, the warm pool settled both times",
        }

    def way(self, way, n, env, ca, bundle):
        b, rl = self.b, self.rl
        from sdk_bench import ms

        baseline = b.settle(still_s=SETTLE_S)
        errors, extra = [], {}
        if way == "each":
            t0 = time.perf_counter()

            def make(_):
                sbx = b.create()
                return sbx, self.set_up(sbx, env, ca, bundle)

            made = rl._ready_all(n, make, errors)
            took = ms(time.perf_counter() - t0)
            children = [s for s, _ in made]
            states = [st for _, st in made]
            expected = states[0] if states else None
            result = {}
        else:
            t0 = time.perf_counter()
            parent = b.create()
            expected = self.set_up(parent, env, ca, bundle)
            setup_ms = ms(time.perf_counter() - t0)
            t1 = time.perf_counter()
            children = rl.fork(parent, n, errors, extra)
            states = []
            for c in children:
                try:
                    states.append(rl.run(GROUP_CHECK, c).stdout)
                except Exception as e:
                    errors.append(f"check {c.sandbox_id}: {e!r}")
            fork_ms = ms(time.perf_counter() - t1)
            took = setup_ms + fork_ms
            result = {
                "setup_ms": setup_ms,
                "fork_ms": fork_ms,
                "parent_paused_ms": extra.get("paused_ms"),
            }
            baseline += 1
        b.settle(at_least=baseline + len(children), still_s=SETTLE_S)
        up = rl.node_memory(b.args.server_pid, b.args.vmm_exe)
        # The baseline is taken once the children are gone (the pool
        # settled again), not before them: a fork writes the parent's
        # memory out, which turns its private pages into shared ones.
        b.kill_all(children)
        b.settle(at_least=baseline, still_s=SETTLE_S)
        gone = rl.node_memory(b.args.server_pid, b.args.vmm_exe)
        same = sum(st == expected for st in states)
        result.update(
            {
                "ready_ms": took if not errors and len(children) == n and same == n else None,
                "children": len(children),
                "same_state": same,
                "state": expected,
                **per_child(gone, up, max(1, len(children))),
            }
        )
        if errors:
            result["errors"] = errors[:10]
            result["elapsed_ms"] = took
        return result


def bounded_way(group, way, n, env, ca, bundle):
    from sdk_bench import bounded

    return bounded(
        functools.partial(group.way, way, n, env, ca, bundle),
        group.b.sample_timeout(),
        f"group {way} of {n}",
    )


def group_self_test():
    cmd = setup_command()
    assert (
        cmd.startswith("git clone -q /tmp/repo.bundle")
        and "pip install --quiet --retries 10 six" in cmd
    )
    env, ca = guest_pip_env({"cert": "/nonexistent", "index-url": "https://idx.test/simple"})
    assert env["PIP_INDEX_URL"] == "https://idx.test/simple" and ca is None
    assert "PIP_CERT" not in env
    mem = per_child(
        {"private_kib": 1024, "pss_kib": 2048}, {"private_kib": 5120, "pss_kib": 6144}, 2
    )
    assert mem == {"child_private_mib": 2.0, "child_pss_mib": 2.0}, mem
    keys = group_keys(
        [
            {"n": 8, "fork": {"ready_ms": 10, "child_private_mib": 1.5}, "each": {"error": "x"}},
            {"n": 16, "fork": {"ready_ms": 20}, "each": {"ready_ms": 90, "child_private_mib": 9}},
        ]
    )
    assert keys["group_setup_fork_ms"] == {"8": 10, "16": 20}, keys
    assert keys["group_setup_each_ms"] == {"8": None, "16": 90}, keys
    assert keys["group_child_private_mib"] == {
        "fork": {"8": 1.5, "16": None},
        "each": {"8": None, "16": 9},
    }, keys
