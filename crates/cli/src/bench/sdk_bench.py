"""Node figures through the unmodified E2B Python SDK, for `sandfork bench`.

Run by `sandfork bench` (crates/cli/src/bench/sdk.rs) with the SDK venv's
python, next to the `sandfork serve` it started (E2B_API_URL, E2B_SANDBOX_URL
and E2B_API_KEY point at it); prints one JSON object on stdout, progress on
stderr. It runs on the same machine as the server so that it can read the
memory of the server's processes from /proc (inside the KVM lab when the host
cannot boot Linux: then the client's own CPU time is emulated too, and
reported as `client_cpu_ms`).

`--self-test` checks the helpers without a server (the Rust tests run it).
"""

import argparse
import functools
import json
import math
import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Sandboxes outlive every phase; the bench kills them itself.
SANDBOX_TTL_S = 3600
# Slow in the lab: one emulated CPU restores every VM.
REQUEST_TIMEOUT_S = 900.0
# A sandbox whose `echo` has not answered in this long is stuck, not slow
# (creates answer in seconds in the lab): the bench says so with the node's
# diagnostics of it instead of waiting out REQUEST_TIMEOUT_S.
ANSWER_TIMEOUT_S = 300.0
# Concurrent creators of the throughput phases (`sdk_creates_per_s_4way`,
# `sdk_creates_per_s_16way`).
CONCURRENCY = 4
WIDE_CONCURRENCY = 16
KILL_TIMEOUT_S = 60.0
# The density phase stops after this many creates that failed (rather than
# being refused), and has this many of its sandboxes answer a command.
DENSITY_MAX_ERRORS = 3
DENSITY_SAMPLE = 10
# `Sandbox.fork` of the Python SDK refuses more children than this itself.
PYTHON_SDK_MAX_FORK = 20
# Children answering their command at once (each a blocking SDK call).
FORK_ANSWER_THREADS = 32
# Creates measured with the working set prefetched.
FAULT_SAMPLES = 3
# Sandfork's header on a fork's answer: how long the parent was stopped.
PARENT_PAUSED_HEADER = "sandfork-parent-paused-ms"
# ... and where the fork's time went (a JSON object, milliseconds).
FORK_PHASES_HEADER = "sandfork-fork-phases"
# The fork_phases phase: (children, samples) of each fork size measured.
FORK_PHASE_COUNTS = ((1, 3), (16, 2), (100, 1))
# ... and the snapshot calls of the same kind of parent it compares the
# parent's pause with.
SNAPSHOT_PAUSE_SAMPLES = 3
# guest_tcp: MiB each way per sample, samples, the guest's sink and source
# ports (reached at the sandbox's slot host address, as the node reaches a
# guest; the guest cannot open a connection to the node, which is always
# denied to it).
GUEST_TCP_MIB = 64
GUEST_TCP_RUNS = 3
GUEST_TCP_SINK, GUEST_TCP_SOURCE = 5301, 5302
# Run in the guest (a file next to this script; see it for the protocol).
GUEST_TCP_SERVER = (Path(__file__).parent / "guest_tcp_server.py").read_text()


def log(msg):
    print(f"sdk-bench: {msg}", file=sys.stderr, flush=True)


def ms(seconds):
    return round(seconds * 1000.0, 1)


def percentile(samples, p):
    """Nearest-rank percentile (no interpolation between a handful of samples)."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(1, math.ceil(p / 100.0 * len(ordered)))
    return ordered[rank - 1]


def summary(samples):
    return {
        "p50": percentile(samples, 50),
        "p95": percentile(samples, 95),
        "samples": samples,
    }


# --- the node's memory ----------------------------------------------------


def _ppid(pid):
    with open(f"/proc/{pid}/stat") as f:
        # the command name, in parentheses, may hold spaces
        return int(f.read().rsplit(")", 1)[1].split()[1])


def node_pids(server_pid, vmm_exe):
    """The server, its descendants, and every process of the VMM binary (a
    server may leave its VMMs detached so that they outlive it)."""
    vmm_exe = os.path.realpath(vmm_exe)
    parents, vmms = {}, set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            parents[pid] = _ppid(pid)
            if os.readlink(f"/proc/{pid}/exe") == vmm_exe:
                vmms.add(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or a kernel thread
    node = {server_pid}
    grew = True
    while grew:
        new = {p for p, pp in parents.items() if pp in node} - node
        node |= new
        grew = bool(new)
    return node | vmms, vmms


def rollup_kib(pid):
    """Pss and private (clean + dirty) memory of a process, in KiB."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return {
        "pss": fields["Pss"],
        "private": fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
    }


def node_memory(server_pid, vmm_exe):
    pids, vmms = node_pids(server_pid, vmm_exe)
    total = {"pss": 0, "private": 0}
    counted = set()
    for pid in pids:
        try:
            kib = rollup_kib(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        counted.add(pid)
        for key in total:
            total[key] += kib[key]
    return {
        "pss_kib": total["pss"],
        "private_kib": total["private"],
        "processes": len(counted),
        "vmm_processes": len(vmms & counted),
    }


def mem_available_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def wait_settled(server_pid, vmm_exe, at_least, timeout_s=600.0, still_s=5.0):
    """Waits until the node runs at least `at_least` VMM processes and their
    number has not changed for `still_s` (the warm pool refilled, killed
    sandboxes' VMMs gone)."""
    deadline = time.monotonic() + timeout_s
    last, since = None, time.monotonic()
    while True:
        count = len(node_pids(server_pid, vmm_exe)[1])
        now = time.monotonic()
        if count != last:
            last, since = count, now
        elif count >= at_least and now - since >= still_s:
            return count
        if now > deadline:
            raise RuntimeError(
                f"the node did not settle: {count} VMM processes, wanted at least {at_least}"
            )
        time.sleep(0.5)


# --- bounded samples --------------------------------------------------------


def describe(e):
    return f"{type(e).__name__}: {e}"


def bounded(fn, timeout_s, what):
    """fn()'s result, run on a daemon thread, or TimeoutError after
    `timeout_s`: a stuck SDK call cannot be interrupted, so it is left behind
    (its sandbox is killed with the phase's others) and the bench goes on."""
    box = {}
    done = threading.Event()

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True, name=what).start()
    if not done.wait(timeout_s):
        raise TimeoutError(f"{what}: no result within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def phase_failure(detail):
    """Why a phase that returned could not give its figure (its `failed`:
    e.g. a fork whose children did not all answer), or None. The exit status
    counts it as a failed phase."""
    return detail.get("failed") if isinstance(detail, dict) else None


def collect(n, sample, timeout_s, what):
    """`n` results of `sample(i)`, each bounded by `timeout_s`; a sample that
    fails or times out is recorded with its error and the others go on.
    Returns (values, failures)."""
    values, failures = [], []
    for i in range(1, n + 1):
        try:
            values.append(bounded(lambda i=i: sample(i), timeout_s, f"{what} {i}"))
        except Exception as e:
            log(f"{what} {i}/{n} failed: {describe(e)}")
            failures.append({"sample": i, "error": describe(e)})
    return values, failures


def is_refusal(e):
    """The node said no for capacity (429 or 503), rather than failing."""
    names = {c.__name__ for c in type(e).__mro__}
    text = str(e)
    return bool(names & {"RateLimitException", "ServiceBusyException"}) or (
        "over capacity" in text or "runs at most" in text
    )


# --- the phases -----------------------------------------------------------


class Bench:
    def __init__(self, args, report):
        from e2b import Sandbox  # only here: --self-test runs without the SDK

        self.Sandbox = Sandbox
        self.args = args
        self.meta = {"sandfork_bench": secrets.token_hex(4)}
        self.opts = {"request_timeout": REQUEST_TIMEOUT_S, "retries": 0}
        # Every sandbox created and not killed yet, so that a sample left
        # behind by a timeout does not keep its sandbox.
        self.created = []
        # Children of an HTTP fork not yet reached through the SDK.
        self.created_ids = []
        self.lock = threading.Lock()
        self.report = report

    def create(self):
        sbx = self.Sandbox.create(
            self.args.template, timeout=SANDBOX_TTL_S, metadata=self.meta, **self.opts
        )
        with self.lock:
            self.created.append(sbx)
        return sbx

    def answer(self, sbx):
        try:
            result = sbx.commands.run(
                "echo ready", timeout=ANSWER_TIMEOUT_S, request_timeout=ANSWER_TIMEOUT_S
            )
        except Exception as e:
            log(
                f"{sbx.sandbox_id} did not answer `echo ready` within {ANSWER_TIMEOUT_S:.0f} s"
                f" ({describe(e)}); the node's diagnostics of it:\n"
                f"{node_diagnostics(sbx.sandbox_id)}"
            )
            raise
        if result.stdout.strip() != "ready":
            raise RuntimeError(f"{sbx.sandbox_id} answered {result.stdout!r}")

    def kill(self, sbx):
        with self.lock:
            if sbx in self.created:
                self.created.remove(sbx)
        try:
            bounded(lambda: sbx.kill(request_timeout=KILL_TIMEOUT_S), KILL_TIMEOUT_S + 5, "kill")
        except Exception as e:  # the node reaps it at its end of life
            log(f"killing {sbx.sandbox_id}: {describe(e)}")

    def kill_all(self, sandboxes):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(self.kill, sandboxes))

    def cleanup(self):
        with self.lock:
            left = list(self.created)
            ids, self.created_ids = self.created_ids, []
        self.kill_all(left)
        for sandbox_id in ids:
            kill_over_http(sandbox_id)

    def settle(self, at_least=None, still_s=None):
        """Waits for the warm pool to be full; a node that does not settle is
        a warning in the report, not the end of the phase."""
        if at_least is None:
            at_least = self.args.pool_size
        try:
            return wait_settled(
                self.args.server_pid,
                self.args.vmm_exe,
                at_least,
                timeout_s=self.args.settle_timeout,
                still_s=self.args.settle_seconds if still_s is None else still_s,
            )
        except RuntimeError as e:
            log(str(e))
            self.report.setdefault("sdk_warnings", []).append(str(e))
            return len(node_pids(self.args.server_pid, self.args.vmm_exe)[1])

    def sample_timeout(self):
        return self.args.sample_timeout

    def first_command_faults(self):
        """The VMM's page faults across a sandbox's first command, before the
        node has the template's working set (the first create of a fresh
        node: its first command records it) and after (creates that
        prefetch it)."""

        def faults(sbx):
            answer = _api("GET", f"/sandboxes/{sbx.sandbox_id}")
            f = answer.json().get("vmmPageFaults")
            if f is None:
                raise RuntimeError(f"the node reports no vmmPageFaults: {answer.text[:300]}")
            return f

        def one(_run):
            sbx = self.create()
            try:
                before = faults(sbx)
                t0 = time.perf_counter()
                self.answer(sbx)
                took = ms(time.perf_counter() - t0)
                after = faults(sbx)
                # the node records the working set a second after the answer
                time.sleep(self.args.working_set_settle_seconds)
            finally:
                self.kill(sbx)
            return {
                "minor": after["minor"] - before["minor"],
                "major": after["major"] - before["major"],
                "first_command_ms": took,
            }

        self.settle()
        without = bounded(lambda: one(0), self.sample_timeout(), "first command (no working set)")
        self.settle()
        with_, failures = collect(
            FAULT_SAMPLES, one, self.sample_timeout(), "first command (working set prefetched)"
        )
        self.cleanup()
        total = lambda f: f["minor"] + f["major"]  # noqa: E731
        log(
            f"first command: {total(without)} faults without the working set, "
            f"{[total(f) for f in with_]} with it"
        )
        return {
            "first_command_page_faults": {
                "without_prefetch": total(without),
                "with_prefetch": summary([total(f) for f in with_]) if with_ else None,
            }
        }, {
            "method": "minflt + majflt of the sandbox's VMM (/proc/<pid>/stat, from the "
            "node's vmmPageFaults) just before and after its first `echo ready`; the first "
            "create of a fresh node has no working set yet and records it",
            "without_prefetch": without,
            "with_prefetch": with_,
            "failed_samples": failures,
        }

    def create_to_first_command(self):
        # One create first, not counted: the SDK's first call imports and sets
        # up its clients (1.6 s of emulated client CPU in the lab).
        def warm_up():
            c0, t0 = time.process_time(), time.perf_counter()
            warm = self.create()
            self.answer(warm)
            took = {
                "ms": ms(time.perf_counter() - t0),
                "client_cpu_ms": ms(time.process_time() - c0),
            }
            self.kill(warm)
            return took

        try:
            warmup = bounded(warm_up, self.sample_timeout(), "warm-up create")
            log(f"warm-up create: {warmup['ms']:.0f} ms (not counted)")
        except Exception as e:
            warmup = {"error": describe(e)}
            log(f"warm-up create failed: {describe(e)}")
        self.cleanup()
        self.settle()

        def one(run):
            c0, t0 = time.process_time(), time.perf_counter()
            sbx = self.create()
            t1 = time.perf_counter()
            try:
                self.answer(sbx)
                t2, c1 = time.perf_counter(), time.process_time()
                # not in the figure: what any command costs, for comparison
                self.answer(sbx)
                second = ms(time.perf_counter() - t2)
            finally:
                self.kill(sbx)
            log(f"create {run}/{self.args.runs}: {ms(t2 - t0):.0f} ms to the first command result")
            return ms(t2 - t0), ms(t1 - t0), ms(c1 - c0), second

        values, failures = collect(self.args.runs, one, self.sample_timeout(), "create")
        self.cleanup()
        parts = list(zip(*values, strict=True)) or [[], [], [], []]
        stats = [summary(list(p)) if p else None for p in parts]
        return {"sdk_create_to_first_command_ms": stats[0]}, {
            "warmup_not_counted": warmup,
            "create_call_ms": stats[1],
            "client_cpu_ms": stats[2],
            "second_command_ms": stats[3],
            "failed_samples": failures,
        }

    def create_image(self, reference):
        """A create naming an image (issue 39), waiting out the node's
        "being built" answers (503 with Retry-After) as a client would."""
        from e2b.exceptions import ServiceBusyException

        deadline = time.monotonic() + self.sample_timeout()
        while True:
            try:
                sbx = self.Sandbox.create(
                    reference, timeout=SANDBOX_TTL_S, metadata=self.meta, **self.opts
                )
                break
            except ServiceBusyException as e:
                if "being built" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(2)
        with self.lock:
            self.created.append(sbx)
        return sbx

    def image_builds(self, reference):
        """The node's builds of the template of `reference` (its conversions)."""
        answer = _api("GET", "/templates")
        answer.raise_for_status()
        named = [t for t in answer.json() if reference in t.get("names", [])]
        return sum(t.get("buildCount", 0) for t in named), named

    def images(self):
        """Creates by image against task images (tests/support/task_images.py
        on the registry `--task-registry`): the node's first create of the
        1 GiB image (a cold pull, conversion into layers, boot and template
        snapshot) to its first command's answer; warm creates of it; then 8
        concurrent creates of a variant the node has not seen (sharing the
        first's base layers) and how many conversions they caused."""
        registry = self.args.task_registry
        if not registry:
            raise RuntimeError("no --task-registry (the bench starts one for this phase)")
        first = f"{registry}/task/swe-1g:v1"
        self.settle()

        def cold():
            t0 = time.perf_counter()
            sbx = self.create_image(first)
            t1 = time.perf_counter()
            try:
                self.answer(sbx)
            finally:
                self.kill(sbx)
            return ms(time.perf_counter() - t0), ms(t1 - t0)

        first_ms, first_create_call_ms = bounded(cold, self.sample_timeout(), "first create")
        log(f"first create of {first}: {first_ms:.0f} ms to the first command result")

        def warm(run):
            t0 = time.perf_counter()
            sbx = self.create_image(first)
            try:
                self.answer(sbx)
            finally:
                self.kill(sbx)
            took = ms(time.perf_counter() - t0)
            log(f"warm create {run}/{self.args.runs}: {took:.0f} ms")
            return took

        values, failures = collect(self.args.runs, warm, self.sample_timeout(), "warm create")
        builds_first, _ = self.image_builds(first)
        variant = f"{registry}/task/var-01:v1"

        def concurrent8():
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                boxes = list(pool.map(lambda _: self.create_image(variant), range(8)))
            try:
                for sbx in boxes:
                    self.answer(sbx)
            finally:
                self.kill_all(boxes)
            return ms(time.perf_counter() - t0)

        c8_ms = bounded(concurrent8, self.sample_timeout(), "8 concurrent creates")
        builds, listed = self.image_builds(variant)
        log(f"8 concurrent creates of {variant}: {c8_ms:.0f} ms, {builds} conversion(s)")
        self.cleanup()
        return {
            "image_first_create_ms": summary([first_ms]),
            "image_create_ms": summary(values) if values else None,
            "image_concurrent8_builds": builds,
        }, {
            "image": first,
            "first_create_call_ms": first_create_call_ms,
            "first_image_builds": builds_first,
            "concurrent8_image": variant,
            "concurrent8_all_answered_ms": c8_ms,
            "concurrent8_templates": listed,
            "failed_samples": failures,
        }

    def fork(self, count=None, over_http=None):
        """A fork of `count` children (default --fork-count), from the call
        until every child answers a command. Up to the Python SDK's own
        limit through `Sandbox.fork`; past it (the node serves 100, the
        SDK refuses more than 20 before asking), or when `over_http`, the
        same request over HTTP, each child then reached with
        `Sandbox.connect` (and the node's phases of it in the detail)."""
        count = count or self.args.fork_count
        parent = bounded(self.create, self.sample_timeout(), "the fork's parent")
        bounded(lambda: self.answer(parent), self.sample_timeout(), "the fork's parent")
        self.settle()
        children, errors = [], []
        paused = {}
        if over_http is None:
            over_http = count > PYTHON_SDK_MAX_FORK

        def answers(child):
            try:
                if isinstance(child, str):
                    sbx = self.Sandbox.connect(child, **self.opts)
                    with self.lock:
                        self.created_ids.remove(child)
                        self.created.append(sbx)
                    child = sbx
                self.answer(child)
                return None
            except Exception as e:  # one child's failure is a result
                return f"{getattr(child, 'sandbox_id', child)}: {e!r}"

        def fork_and_answer():
            c0, t0 = time.process_time(), time.perf_counter()
            if over_http:
                results, paused["ms"], paused["phases"] = fork_over_http(parent.sandbox_id, count)
            else:
                results = parent.fork(count=count, timeout=SANDBOX_TTL_S, **self.opts)
            t1 = time.perf_counter()
            for r in results:
                (errors if isinstance(r, Exception) else children).append(r)
            with self.lock:
                self.created.extend(
                    c for c in children if not isinstance(c, str) and c not in self.created
                )
                self.created_ids.extend(c for c in children if isinstance(c, str))
            errors[:] = [f"fork: {e!r}" for e in errors]
            with ThreadPoolExecutor(max(1, min(len(children), FORK_ANSWER_THREADS))) as pool:
                errors.extend(e for e in pool.map(answers, children) if e)
            t2, c1 = time.perf_counter(), time.process_time()
            return t0, t1, t2, c1 - c0

        detail = {"children": count, "fork_call": "http" if over_http else "sdk"}
        try:
            t0, t1, t2, cpu = bounded(fork_and_answer, self.sample_timeout(), f"fork of {count}")
            answered = ms(t2 - t0)
            log(f"fork of {count}: {len(children)} children, all answered after {answered:.0f} ms")
            detail.update(
                fork_call_ms=ms(t1 - t0), all_answered_ms=ms(t2 - t0), client_cpu_ms=ms(cpu)
            )
        except Exception as e:
            errors.append(describe(e))
            t0 = t2 = None
        finally:
            self.cleanup()
        detail["errors"] = errors[:20]
        detail["failed_children"] = len(errors)
        if errors:
            detail["failed"] = f"{len(errors)} of {count} children failed; the first: {errors[0]}"
        value = None if errors else ms(t2 - t0)
        figures = {f"sdk_fork{count}_ms": value}
        # Only from a node that says it (the header is sandfork's).
        if paused.get("ms") is not None:
            detail["parent_paused_ms"] = paused["ms"]
            figures["fork_parent_pause_ms"] = paused["ms"]
        if paused.get("phases") is not None:
            detail["phases"] = paused["phases"]
        return figures, detail

    def fork100(self):
        return self.fork(100)

    def fork_phases(self):
        """Where a fork's time goes, for 1, 16 and 100 children, each sample
        a fork over HTTP of a fresh parent: the node's phases (its
        `sandfork-fork-phases` header), and the client's fork call and wait
        until every child answered `echo` (its first command). Then the
        parent's pause of a fork against a snapshot call of the same kind
        of parent (the call's whole time: an upper bound of its pause)."""
        figures, detail = {}, {}
        fork_pauses, failures = [], []
        for count, samples in FORK_PHASE_COUNTS:
            runs = []
            for i in range(samples):
                try:
                    _, one = self.fork(count, over_http=True)
                except Exception as e:
                    failures.append(f"fork of {count}, sample {i}: {describe(e)}")
                    self.cleanup()
                    continue
                if one.get("failed"):
                    failures.append(f"fork of {count}, sample {i}: {one['failed']}")
                if one.get("phases") is None:
                    failures.append(f"fork of {count}, sample {i}: the node gave no phases")
                    continue
                runs.append(fork_sample(one))
                fork_pauses.append(one["phases"]["parentPausedMs"])
            figures[f"fork{count}_phases"] = phase_summary(runs)
        snapshot_pauses = []
        for i in range(SNAPSHOT_PAUSE_SAMPLES):
            try:
                snapshot_pauses.append(self.snapshot_pause())
            except Exception as e:
                failures.append(f"snapshot, sample {i}: {describe(e)}")
            finally:
                self.cleanup()
        figures["fork_parent_pause_ms"] = summary(fork_pauses) if fork_pauses else None
        figures["snapshot_parent_pause_ms"] = summary(snapshot_pauses) if snapshot_pauses else None
        detail["snapshot_parent_pause_is_upper_bound"] = True
        if failures:
            detail["failed"] = f"{len(failures)} samples failed; the first: {failures[0]}"
            detail["errors"] = failures[:20]
        return figures, detail

    def snapshot_pause(self):
        """A snapshot call of a fresh parent that answered a command: its
        whole time, in ms (the node pauses the parent for its length)."""
        parent = bounded(self.create, self.sample_timeout(), "the snapshot's parent")
        bounded(lambda: self.answer(parent), self.sample_timeout(), "the snapshot's parent")
        self.settle()
        t0 = time.perf_counter()
        bounded(lambda: parent.create_snapshot(**self.opts), self.sample_timeout(), "the snapshot")
        return ms(time.perf_counter() - t0)

    def rl(self):
        import rl_bench  # next to this script

        counts = [int(x) for x in self.args.rl_counts.split(",")]
        steps = [int(x) for x in self.args.rl_steps.split(",")]

        def progress(cases):
            self.report["rl"] = {"cases": cases, "partial": True}
            save_report(self.args.report_file, self.report)

        bench = rl_bench.RlBench(
            self,
            counts,
            steps,
            node_memory,
            mem_available_kib,
            progress=progress,
            budget_s=self.args.rl_budget,
        )
        figures = bench.measure()
        return {"rl": figures}, {"cases": len(figures["cases"])}

    def rl_group(self):
        """Fork per group against a setup per child (rl_bench.GroupBench)."""
        import tempfile

        import rl_bench  # next to this script

        counts = [int(x) for x in self.args.rl_groups.split(",")]
        rl = rl_bench.RlBench(self, [], [], node_memory, mem_available_kib)

        def progress(cases):
            self.report.update(rl_bench.group_keys(cases))
            self.report.setdefault("sdk_detail", {})["rl_group"] = {"cases": cases, "partial": True}
            save_report(self.args.report_file, self.report)

        with tempfile.TemporaryDirectory(prefix="sandfork-rl-group-") as workdir:
            figures = rl_bench.GroupBench(rl, counts, workdir, progress).measure()
        keys = ("group_setup_fork_ms", "group_setup_each_ms", "group_child_private_mib")
        return {k: figures[k] for k in keys}, figures

    def rollback(self):
        """Back to a checkpoint, `--runs` times each way, in turn: in place
        (`POST /sandboxes/{id}/rollback`, then a command answered) and the
        way without it (a create from the snapshot, answering, and a kill of
        the sandbox left behind). Each sample first changes a file, and each
        rollback is checked to have undone it."""
        sbx = bounded(self.create, self.sample_timeout(), "rollback's sandbox")
        snapshot_id = None
        try:
            path = "/home/user/rollback.txt"
            sbx.commands.run(f"echo checkpoint > {path}")
            snapshot_id = sbx.create_snapshot().snapshot_id
            in_place, by_create = [], []
            for run in range(1, self.args.runs + 1):
                sbx.commands.run(f"echo run {run} > {path}")
                t0 = time.perf_counter()
                answer = _api(
                    "POST",
                    f"/sandboxes/{sbx.sandbox_id}/rollback",
                    json={"snapshotID": snapshot_id},
                )
                if answer.status_code != 200:
                    raise RuntimeError(f"rollback: {answer.status_code} {answer.text[:500]}")
                self.answer(sbx)
                in_place.append(ms(time.perf_counter() - t0))
                seen = sbx.commands.run(f"cat {path}").stdout.strip()
                if seen != "checkpoint":
                    raise RuntimeError(f"after a rollback the file holds {seen!r}")

                t0 = time.perf_counter()
                fresh = self.Sandbox.create(
                    snapshot_id, timeout=SANDBOX_TTL_S, metadata=self.meta, **self.opts
                )
                self.answer(fresh)
                fresh.kill(request_timeout=KILL_TIMEOUT_S)
                by_create.append(ms(time.perf_counter() - t0))
                log(
                    f"rollback {run}/{self.args.runs}: in place {in_place[-1]:.0f} ms, "
                    f"by a create and a kill {by_create[-1]:.0f} ms"
                )
            values = {
                "rollback_ms": summary(in_place),
                "rollback_by_create_ms": summary(by_create),
            }
            return values, dict(values)
        finally:
            self.kill(sbx)
            if snapshot_id is not None:
                _api("DELETE", f"/templates/{snapshot_id}")

    def guest_tcp(self):
        """TCP through a sandbox's network slot (tap, virtio-net, the slot's
        NAT, its veth), both ways: the node's side connects to the guest's
        sink and source at the slot's host address."""
        import socket

        sbx = bounded(self.create, self.sample_timeout(), "guest_tcp's sandbox")
        try:
            sbx.files.write("/tmp/tcp_bench.py", GUEST_TCP_SERVER)
            sbx.commands.run(
                f"python3 /tmp/tcp_bench.py {GUEST_TCP_MIB} {GUEST_TCP_SINK} {GUEST_TCP_SOURCE}",
                background=True,
                timeout=0,
            )
            # Its slot: the one routed slot address whose guest listens.
            deadline = time.monotonic() + 60
            addr = None
            while addr is None and time.monotonic() < deadline:
                for ip in slot_host_ips():
                    try:
                        socket.create_connection((ip, GUEST_TCP_SOURCE), timeout=2).close()
                        addr = ip
                        break
                    except OSError:
                        pass
                else:
                    time.sleep(0.5)
            if addr is None:
                raise RuntimeError("the guest's TCP server answered at no slot address")
            size = GUEST_TCP_MIB << 20
            block = b"\0" * (1 << 20)

            def to_guest():
                with socket.create_connection((addr, GUEST_TCP_SINK), timeout=120) as c:
                    t0 = time.perf_counter()
                    for _ in range(GUEST_TCP_MIB):
                        c.sendall(block)
                    c.shutdown(socket.SHUT_WR)
                    got = int(c.recv(64) or b"0")
                    took = time.perf_counter() - t0
                if got != size:
                    raise RuntimeError(f"the guest received {got} of {size} bytes")
                return GUEST_TCP_MIB / took

            def from_guest():
                with socket.create_connection((addr, GUEST_TCP_SOURCE), timeout=120) as c:
                    t0 = time.perf_counter()
                    c.sendall(b"g")
                    got = 0
                    while True:
                        b = c.recv(1 << 20)
                        if not b:
                            break
                        got += len(b)
                    took = time.perf_counter() - t0
                if got != size:
                    raise RuntimeError(f"the node received {got} of {size} bytes")
                return GUEST_TCP_MIB / took

            runs = {"host_to_guest": [], "guest_to_host": []}
            for i in range(GUEST_TCP_RUNS):
                runs["host_to_guest"].append(to_guest())
                runs["guest_to_host"].append(from_guest())
                log(
                    f"guest_tcp {i + 1}/{GUEST_TCP_RUNS}: to the guest"
                    f" {runs['host_to_guest'][-1]:.1f} MiB/s, from it"
                    f" {runs['guest_to_host'][-1]:.1f} MiB/s"
                )
        finally:
            self.kill(sbx)
        figures = {f"guest_tcp_{way}_mib_s": round(percentile(v, 50), 2) for way, v in runs.items()}
        return figures, {
            "mib_per_sample": GUEST_TCP_MIB,
            "samples_mib_s": {k: [round(x, 2) for x in v] for k, v in runs.items()},
            "slot_host_ip": addr,
            "path": "node socket -> slot veth -> DNAT -> tap -> virtio-net -> guest python socket",
        }

    def creates_concurrent(self):
        return self.creates_with(CONCURRENCY, self.args.creates)

    def creates_concurrent16(self):
        return self.creates_with(WIDE_CONCURRENCY, self.args.creates16)

    def creates_with(self, workers, total):
        """`total` creates by `workers` threads at once, each to its first
        command's answer: creates a second over the whole."""
        self.settle()
        latency, errors = [], []
        lock = threading.Lock()
        claimed = [0]

        def one():
            t0 = time.perf_counter()
            sbx = self.create()
            self.answer(sbx)
            return ms(time.perf_counter() - t0)

        def worker():
            while True:
                with lock:
                    if claimed[0] >= total:
                        return
                    claimed[0] += 1
                try:
                    took = bounded(one, self.sample_timeout(), "create")
                except Exception as e:  # counted as not created
                    with lock:
                        errors.append(describe(e))
                    continue
                with lock:
                    latency.append(took)

        c0, t0 = time.process_time(), time.perf_counter()
        threads = [threading.Thread(target=worker, daemon=True) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            # Each sample is bounded, so each worker ends.
            t.join()
        elapsed, c1 = time.perf_counter() - t0, time.process_time()
        self.cleanup()
        rate = len(latency) / elapsed
        log(f"{len(latency)}/{total} creates answered in {elapsed:.1f} s with {workers} creators")
        detail = {
            "concurrency": workers,
            "creates": total,
            "answered": len(latency),
            "elapsed_s": round(elapsed, 2),
            "create_to_first_command_ms": summary(latency) if latency else None,
            "client_cpu_ms": ms(c1 - c0),
            "errors": errors,
        }
        return {f"sdk_creates_per_s_{workers}way": round(rate, 3)}, detail

    def idle_memory(self):
        k = self.args.idle
        baseline_vmms = self.settle()
        before = node_memory(self.args.server_pid, self.args.vmm_exe)
        avail_before = mem_available_kib()
        try:
            for i in range(k):
                bounded(
                    lambda: self.answer(self.create()),
                    self.sample_timeout(),
                    f"idle sandbox {i + 1}",
                )
            log(f"{k} sandboxes up; idling {self.args.idle_seconds} s")
            time.sleep(self.args.idle_seconds)
            # the pool refills behind the creates: wait for it too
            self.settle(at_least=baseline_vmms + k)
            after = node_memory(self.args.server_pid, self.args.vmm_exe)
            avail_after = mem_available_kib()
        finally:
            self.cleanup()
        per = (after["pss_kib"] - before["pss_kib"]) / 1024.0 / k
        detail = {
            "method": "sum of Pss (/proc/<pid>/smaps_rollup) over the server, its "
            "descendants and every VMM process, with K idle sandboxes minus before "
            "them (warm pool full both times), divided by K",
            "sandboxes": k,
            "idle_s": self.args.idle_seconds,
            "node_before": before,
            "node_after": after,
            "private_mib_per_sandbox": round(
                (after["private_kib"] - before["private_kib"]) / 1024.0 / k, 2
            ),
            "mem_available_drop_mib_per_sandbox": round(
                (avail_before - avail_after) / 1024.0 / k, 2
            ),
        }
        log(f"idle sandbox: {per:.1f} MiB (Pss)")
        per = round(per, 2)
        return {
            "idle_sandbox_mib": per,
            "idle_sandboxes_per_24gib": math.floor(24 * 1024 / per) if per > 0 else None,
        }, detail

    def density(self):
        """Creates until the node refuses (or --density-max), all idle
        --idle-seconds, then a sample of them answers a command."""
        limit = self.args.density_max
        baseline_vmms = self.settle()
        before = node_memory(self.args.server_pid, self.args.vmm_exe)
        admitted, errors, refusal = [], [], None
        t0 = time.perf_counter()
        try:
            while len(admitted) < limit:
                try:
                    sbx = bounded(self.create, self.sample_timeout(), "density create")
                except Exception as e:
                    if is_refusal(e):
                        refusal = describe(e)
                        log(f"density: the node refused sandbox {len(admitted) + 1}: {refusal}")
                        break
                    errors.append(describe(e))
                    log(f"density: create {len(admitted) + 1} failed: {describe(e)}")
                    if len(errors) >= DENSITY_MAX_ERRORS:
                        break
                    continue
                admitted.append(sbx)
                if len(admitted) % 10 == 0:
                    log(f"density: {len(admitted)} sandboxes admitted")
            created_s = time.perf_counter() - t0
            n = len(admitted)
            log(f"density: {n} admitted; idling {self.args.idle_seconds} s")
            time.sleep(self.args.idle_seconds)
            sample = admitted[:: max(1, n // DENSITY_SAMPLE)][:DENSITY_SAMPLE] if n else []
            answered, failed = collect(
                len(sample),
                lambda i: self.answer(sample[i - 1]),
                self.sample_timeout(),
                "density answer",
            )
            self.settle(at_least=baseline_vmms + n)
            after = node_memory(self.args.server_pid, self.args.vmm_exe)
            avail = mem_available_kib()
            node = node_info()
        finally:
            self.cleanup()
        per = round((after["pss_kib"] - before["pss_kib"]) / 1024.0 / n, 2) if n else None
        log(f"density: {n} admitted, {per} MiB each (Pss), {avail // 1024} MiB available")
        return {
            "density_idle_sandboxes": n,
            "density_sandbox_mib": per,
            "density_mem_available_mib": avail // 1024,
        }, {
            "max": limit,
            "refused_with": refusal,
            "create_errors": errors,
            "create_s": round(created_s, 1),
            "idle_s": self.args.idle_seconds,
            "sampled": len(sample),
            "answered": len(answered),
            "failed_answers": failed,
            "node_before": before,
            "node_after": after,
            "node_capacity_at_end": node,
        }

    def run(self, save):
        """Every phase, each on its own: one that fails is recorded with its
        error and the next one runs; `save` is called after each."""
        report = self.report
        detail = report.setdefault("sdk_detail", {})
        detail.update(
            sdk="e2b (Python) " + _sdk_version(),
            template=self.args.template,
            client="runs on the node next to the server, so the node's processes "
            "can be read from /proc; in the lab its CPU time is emulated too "
            "(client_cpu_ms)",
        )
        phases = [
            # First: on a fresh node, its first create has no working set yet.
            ("first_command_faults", self.first_command_faults, ["first_command_page_faults"]),
            (
                "create_to_first_command",
                self.create_to_first_command,
                ["sdk_create_to_first_command_ms"],
            ),
            ("fork16", self.fork, [f"sdk_fork{self.args.fork_count}_ms"]),
            ("fork100", self.fork100, ["sdk_fork100_ms", "fork_parent_pause_ms"]),
            (
                "fork_phases",
                self.fork_phases,
                [
                    "fork1_phases",
                    "fork16_phases",
                    "fork100_phases",
                    "fork_parent_pause_ms",
                    "snapshot_parent_pause_ms",
                ],
            ),
            (
                "guest_tcp",
                self.guest_tcp,
                ["guest_tcp_guest_to_host_mib_s", "guest_tcp_host_to_guest_mib_s"],
            ),
            ("creates_concurrent", self.creates_concurrent, ["sdk_creates_per_s_4way"]),
            ("creates_concurrent16", self.creates_concurrent16, ["sdk_creates_per_s_16way"]),
            ("idle", self.idle_memory, ["idle_sandbox_mib", "idle_sandboxes_per_24gib"]),
        ]
        # Branching a stateful episode: fork vs snapshot vs replay (rl_bench.py).
        phases.append(("rl", self.rl, ["rl"]))
        # A rollout group set up once and forked, against a setup per child.
        phases.append(
            (
                "rl_group",
                self.rl_group,
                ["group_setup_fork_ms", "group_setup_each_ms", "group_child_private_mib"],
            )
        )
        # Back to a checkpoint: in place against a create from it.
        phases.append(("rollback", self.rollback, ["rollback_ms", "rollback_by_create_ms"]))
        # Creates by image (issue 39): only when asked (`--sdk-phases images`).
        if self.args.task_registry:
            phases.append(
                (
                    "images",
                    self.images,
                    ["image_first_create_ms", "image_create_ms", "image_concurrent8_builds"],
                )
            )
        if self.args.density_max > 0:
            phases.append(
                ("density", self.density, ["density_idle_sandboxes", "density_sandbox_mib"])
            )
        only = set(self.args.phases.split(",")) if self.args.phases else None
        for name, phase, keys in phases:
            if only is not None and name not in only:
                continue
            log(f"phase {name}")
            try:
                values, detail[name] = phase()
                report.update(values)
                failure = phase_failure(detail[name])
                if failure:
                    log(f"phase {name} failed: {failure}")
                    report.setdefault("sdk_errors", {})[name] = failure
            except Exception as e:
                log(f"phase {name} failed: {describe(e)}")
                for key in keys:
                    report[key] = None
                detail[name] = {"error": describe(e)}
                report.setdefault("sdk_errors", {})[name] = describe(e)
                self.cleanup()
            save()
        return report


def slot_host_ips():
    """The node's routes to its network slots' host addresses (each via a
    slot veth `sfv-<i>`)."""
    import subprocess

    out = subprocess.run(
        ["ip", "-4", "-o", "route"], capture_output=True, text=True, check=False
    ).stdout
    ips = []
    for line in out.splitlines():
        words = line.split()
        if "dev" in words and words[words.index("dev") + 1].startswith("sfv-"):
            dest = words[0]
            if "/" not in dest:
                ips.append(dest)
    return ips


def _sdk_version():
    from importlib.metadata import version

    return version("e2b")


def node_diagnostics(sandbox_id):
    """The node's view of a running sandbox's VMM (sandfork's own route)."""
    import httpx

    url = f"{os.environ['E2B_API_URL']}/v1/sandboxes/{sandbox_id}/diagnostics"
    try:
        answer = httpx.get(url, headers={"X-API-KEY": os.environ["E2B_API_KEY"]}, timeout=60)
        return answer.text
    except httpx.HTTPError as e:
        return f"(no diagnostics: {e})"


@functools.cache
def _api_client():
    """The node's API on kept connections (a pool), as the SDKs' clients
    keep theirs: a new connection per call cost ~0.2 s through the lab's
    port forward, which fork and rollback samples paid and the SDK's
    creates did not."""
    import httpx

    return httpx.Client(
        base_url=os.environ["E2B_API_URL"],
        headers={"X-API-KEY": os.environ["E2B_API_KEY"]},
        timeout=REQUEST_TIMEOUT_S,
    )


def _api(method, path, **kwargs):
    return _api_client().request(method, path, **kwargs)


def fork_over_http(sandbox_id, count):
    """`POST /sandboxes/{id}/fork` as the SDKs send it: the children's ids
    (an exception for each child the node could not start), how long the
    node says the parent was paused and where it says the fork's time went
    (each None if it does not say)."""
    answer = _api(
        "POST", f"/sandboxes/{sandbox_id}/fork", json={"count": count, "timeout": SANDBOX_TTL_S}
    )
    if answer.status_code != 201:
        raise RuntimeError(f"fork of {count}: {answer.status_code} {answer.text[:500]}")
    results = [
        item["sandbox"]["sandboxID"]
        if "sandbox" in item
        else RuntimeError(f"{item.get('error', item)}")
        for item in answer.json()
    ]
    paused = answer.headers.get(PARENT_PAUSED_HEADER)
    phases = answer.headers.get(FORK_PHASES_HEADER)
    return (
        results,
        float(paused) if paused is not None else None,
        json.loads(phases) if phases is not None else None,
    )


def fork_sample(detail):
    """One fork's phases as the bench reports them: the node's (its header,
    flattened to `name_ms`), then the client's call and its wait until every
    child answered its first command."""
    phases = detail["phases"]
    flat = {}
    for key, value in phases.items():
        if isinstance(value, dict):
            for inner, v in value.items():
                if isinstance(v, dict):  # a spread over the children
                    for stat, x in v.items():
                        flat[f"{key}_{snake(inner)}_{stat}"] = x
                else:
                    flat[f"{key}_{snake(inner)}"] = v
        else:
            flat[snake(key)] = value
    flat["client_fork_call_ms"] = detail.get("fork_call_ms")
    answered, call = detail.get("all_answered_ms"), detail.get("fork_call_ms")
    flat["client_first_command_ms"] = (
        round(answered - call, 1) if answered is not None and call is not None else None
    )
    flat["client_all_answered_ms"] = answered
    return flat


def snake(name):
    """`vmmsTakenMs` -> `vmms_taken_ms`."""
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


def phase_summary(runs):
    """Each phase's median over a fork size's samples, with the samples."""
    keys = list(dict.fromkeys(k for r in runs for k in r))
    median = {}
    for key in keys:
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if values:
            median[key] = percentile(values, 50)
    return {"median": median, "samples": runs}


def kill_over_http(sandbox_id):
    try:
        _api("DELETE", f"/sandboxes/{sandbox_id}")
    except Exception as e:  # the node reaps it at its end of life
        log(f"killing {sandbox_id}: {describe(e)}")


def node_info():
    """The node's capacity and use (`GET /v1/node`, sandfork's own)."""
    import httpx

    url = f"{os.environ['E2B_API_URL']}/v1/node"
    try:
        answer = httpx.get(url, headers={"X-API-KEY": os.environ["E2B_API_KEY"]}, timeout=60)
        return answer.json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": describe(e)}


def save_report(path, report):
    """Writes the report so far where `sandfork bench` finds it if this
    script dies or overruns (written whole, then renamed into place)."""
    if not path:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def wait_for_health(url, timeout_s):
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code < 300:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {url}/health after {timeout_s} s")
        time.sleep(1)


def self_test():
    assert percentile([5.0], 50) == 5.0 and percentile([5.0], 95) == 5.0
    assert percentile([4, 1, 3, 2], 50) == 2 and percentile([4, 1, 3, 2], 95) == 4
    assert percentile(list(range(1, 21)), 95) == 19
    own = rollup_kib(os.getpid())
    assert own["pss"] > 0 and own["private"] > 0, own
    pids, vmms = node_pids(os.getpid(), sys.executable)
    assert os.getpid() in pids and os.getpid() in vmms, (pids, vmms)
    mem = node_memory(os.getpid(), sys.executable)
    assert mem["pss_kib"] >= own["pss"] // 2 and mem["vmm_processes"] >= 1, mem
    assert mem_available_kib() > 0
    # A sample that fails or never answers is recorded; the others go on.
    stuck = threading.Event()

    def sample(i):
        if i == 2:
            raise RuntimeError("no answer")
        if i == 3:
            stuck.wait(60)  # as an SDK call whose command never answers
        return i * 10

    t0 = time.monotonic()
    values, failures = collect(4, sample, 0.5, "sample")
    stuck.set()
    assert values == [10, 40], values
    assert [f["sample"] for f in failures] == [2, 3], failures
    assert failures[0]["error"] == "RuntimeError: no answer", failures
    assert failures[1]["error"].startswith("TimeoutError: sample 3: no result within"), failures
    assert time.monotonic() - t0 < 10
    # A phase that returned but lost samples its figure needs fails the run.
    assert phase_failure({"failed": "2 of 16 children failed"}) == "2 of 16 children failed"
    assert phase_failure({"children": 16, "failed_children": 0}) is None
    try:
        bounded(lambda: 1 / 0, 5, "x")
        raise AssertionError("no error")
    except ZeroDivisionError:
        pass

    class RateLimitException(Exception):
        pass

    assert is_refusal(RateLimitException("429"))
    assert is_refusal(RuntimeError("503: node over capacity: not enough memory"))
    assert not is_refusal(RuntimeError("connection reset"))
    # A fork's phases: the node's header flattened, the client's beside it.
    header = {
        "children": 2,
        "vmmsTakenMs": 1.5,
        "totalMs": 40.0,
        "vmm": {"freezeMs": 0.25, "memoryBytes": 4096},
        "child": {"loadedMs": {"median": 20.0, "max": 30.0}},
    }
    one = fork_sample({"phases": header, "fork_call_ms": 50.0, "all_answered_ms": 80.0})
    assert one["vmms_taken_ms"] == 1.5 and one["vmm_freeze_ms"] == 0.25, one
    assert one["child_loaded_ms_max"] == 30.0 and one["vmm_memory_bytes"] == 4096, one
    assert one["client_first_command_ms"] == 30.0, one
    two = fork_sample({"phases": dict(header, totalMs=60.0), "fork_call_ms": None})
    assert two["client_first_command_ms"] is None, two
    summed = phase_summary([one, two, one])
    assert summed["median"]["total_ms"] == 40.0 and len(summed["samples"]) == 3, summed
    assert "client_first_command_ms" in summed["median"], summed
    assert phase_summary([]) == {"median": {}, "samples": []}
    import rl_bench

    rl_bench.self_test()
    # The report so far is written whole.
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "report.json")
        save_report(path, {"a": 1})
        save_report(path, {"a": 2, "b": None})
        with open(path) as f:
            assert json.load(f) == {"a": 2, "b": None}
        assert os.listdir(d) == ["report.json"]
    print("self-test passed")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--self-test", action="store_true")
    p.add_argument("--server-pid", type=int)
    p.add_argument("--vmm-exe")
    p.add_argument("--template", default="base")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--fork-count", type=int, default=16)
    p.add_argument("--creates", type=int, default=12)
    # Two rounds of the 16 creators.
    p.add_argument("--creates16", type=int, default=32)
    p.add_argument("--idle", type=int, default=8)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--health-timeout", type=float, default=1200.0)
    # Each sample (a create to its first answer, a fork to all answers)
    # at most this long; one that overruns is a failed sample.
    p.add_argument("--sample-timeout", type=float, default=600.0)
    p.add_argument("--density-max", type=int, default=0)
    # How long the node's VMM count must stay unchanged to count as settled.
    p.add_argument("--settle-seconds", type=float, default=5.0)
    p.add_argument("--settle-timeout", type=float, default=600.0)
    # How long the node is given to record a template's working set after
    # the first command (it waits a second after the answer).
    p.add_argument("--working-set-settle-seconds", type=float, default=3.0)
    p.add_argument("--phases", help="comma-separated phases to run (default: all)")
    # The rl phase: children per branch (N) and the steps to branch at (k).
    p.add_argument("--rl-counts", default="4,16")
    p.add_argument("--rl-steps", default="1,8,32")
    # No new rl case after this many seconds (0: no bound).
    p.add_argument("--rl-budget", type=float, default=0.0)
    # The rl_group phase: rollout groups' sizes (N).
    p.add_argument("--rl-groups", default="8,16")
    p.add_argument("--report-file", help="where the report so far is kept")
    # The images phase: the loopback registry of the task images.
    p.add_argument("--task-registry", help="host:port of the task images' registry")
    args = p.parse_args()
    if args.self_test:
        self_test()
        return
    if args.server_pid is None or not args.vmm_exe:
        p.error("--server-pid and --vmm-exe are needed")
    report = {}

    def save():
        save_report(args.report_file, report)

    try:
        url = os.environ["E2B_API_URL"]
        log(f"waiting for {url}/health (the first start builds the base template)")
        wait_for_health(url, args.health_timeout)
        Bench(args, report).run(save)
    except Exception as e:
        # Whatever was measured is still the report.
        log(f"the SDK bench stopped: {describe(e)}")
        report.setdefault("sdk_errors", {})["bench"] = describe(e)
    save()
    print(json.dumps(report), flush=True)
    # Samples left behind by a timeout may still hold threads: do not wait.
    os._exit(1 if report.get("sdk_errors") else 0)


if __name__ == "__main__":
    main()
