"""The `rl` phase of `sandfork bench` (`--only rl`): when does fork pay?

One stateful episode runs in a parent sandbox; at step k it is branched N
ways three ways, one after the other:

  fork      `POST /sandboxes/{id}/fork` (count N), each child connected and
            answering a command;
  snapshot  `create_snapshot()` of the parent, then N creates from it (at
            once, one thread each), each answering;
  replay    N fresh creates of the parent's template (at once), each running
            the episode's k steps again.

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
token; fork and snapshot copy it.

Imported by sdk_bench.py (written next to it by `sandfork bench`).
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

EPISODE = "/home/user/episode"
WAYS = ("fork", "snapshot", "replay")

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
    f"cd {EPISODE} && echo get > in && read -r v < out && echo mem=$v && "
    "echo files=$(cat token log f_* | sha256sum | cut -c1-16) && "
    'p=$(cat pid) && if kill -0 "$p" 2>/dev/null; then echo proc=alive; else echo proc=gone; fi'
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

    def __init__(self, bench, counts, steps, node_memory, mem_available_kib, fork_over_http):
        self.b = bench
        self.counts = counts
        self.steps = sorted(steps)
        self.node_memory = node_memory
        self.mem_available_kib = mem_available_kib
        self.fork_over_http = fork_over_http

    def log(self, msg):
        from sdk_bench import log

        log(f"rl: {msg}")

    def run(self, cmd, sbx, timeout=300):
        return sbx.commands.run(cmd, timeout=timeout, request_timeout=timeout)

    def check(self, sbx):
        return parse_check(self.run(CHECK, sbx).stdout)

    def measure(self):
        b = self.b
        from sdk_bench import bounded, describe, ms

        parent = bounded(b.create, b.sample_timeout(), "the episode's parent")
        with b.lock:
            b.created.remove(parent)  # not for `cleanup`: it outlives each way
        cases, done = [], 0
        try:
            for k in self.steps:
                t0 = time.perf_counter()
                for i in range(done + 1, k + 1):
                    out = self.run(step_command(i), parent).stdout.strip()
                    if out != f"total={expected_total(i)}":
                        raise RuntimeError(f"step {i} of the parent answered {out!r}")
                done = k
                state = self.check(parent)
                self.log(f"parent at step {k} ({ms(time.perf_counter() - t0):.0f} ms): {state}")
                for n in self.counts:
                    case = {"n": n, "k": k}
                    for way in WAYS:
                        try:
                            case[way] = bounded(
                                lambda way=way: self.branch(way, parent, n, k, state),
                                b.sample_timeout(),
                                f"{way} of {n} at step {k}",
                            )
                        except Exception as e:
                            case[way] = {"error": describe(e)}
                        finally:
                            b.cleanup()
                        shown = case[way].get("ready_ms", case[way].get("error"))
                        self.log(f"n={n} k={k} {way}: {shown}")
                    cases.append(case)
        finally:
            b.kill(parent)
            b.cleanup()
        wins_from, losses = crossover(cases, self.counts, self.steps)
        return {
            "counts": self.counts,
            "steps": self.steps,
            "cases": cases,
            "fork_wins_from_k": wins_from,
            "fork_loses": losses,
            "method": "one episode in a parent sandbox branched at each step k in turn; "
            "per way: from the call until every child answered a command (replay: "
            "ran the k steps), children checked against the parent (files digest, "
            "background process alive, its in-memory total), node memory with the "
            "children up minus before them (warm pool settled both times), over N",
        }

    def branch(self, way, parent, n, k, state):
        b = self.b
        from sdk_bench import describe, ms

        baseline = b.settle()
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
        b.settle(at_least=baseline + len(children))
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

    def _connect(self, sandbox_id):
        b = self.b
        sbx = b.Sandbox.connect(sandbox_id, **b.opts)
        with b.lock:
            if sandbox_id in b.created_ids:
                b.created_ids.remove(sandbox_id)
            b.created.append(sbx)
        b.answer(sbx)
        return sbx

    def fork(self, parent, n, errors, extra):
        b = self.b
        results, extra["paused_ms"] = self.fork_over_http(parent.sandbox_id, n)
        ids = [r for r in results if isinstance(r, str)]
        errors.extend(f"fork: {r}" for r in results if not isinstance(r, str))
        with b.lock:
            b.created_ids.extend(ids)
        return self._ready_all(len(ids), lambda i: self._connect(ids[i]), errors)

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
