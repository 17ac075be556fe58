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

Imported by sdk_bench.py (written next to it by `sandfork bench`).
"""

import functools
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
