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
import json
import math
import os
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

# Sandboxes outlive every phase; the bench kills them itself.
SANDBOX_TTL_S = 3600
# Slow in the lab: one emulated CPU restores every VM.
REQUEST_TIMEOUT_S = 900.0
# A sandbox whose `echo` has not answered in this long is stuck, not slow
# (creates answer in seconds in the lab): the bench says so with the node's
# diagnostics of it instead of waiting out REQUEST_TIMEOUT_S.
ANSWER_TIMEOUT_S = 300.0
# Concurrent creators of the throughput phase (`sdk_creates_per_s_4way`).
CONCURRENCY = 4


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


# --- the phases -----------------------------------------------------------


class Bench:
    def __init__(self, args):
        from e2b import Sandbox  # only here: --self-test runs without the SDK

        self.Sandbox = Sandbox
        self.args = args
        self.meta = {"sandfork_bench": secrets.token_hex(4)}
        self.opts = {"request_timeout": REQUEST_TIMEOUT_S, "retries": 0}

    def create(self):
        return self.Sandbox.create(
            self.args.template, timeout=SANDBOX_TTL_S, metadata=self.meta, **self.opts
        )

    def answer(self, sbx):
        try:
            result = sbx.commands.run(
                "echo ready", timeout=ANSWER_TIMEOUT_S, request_timeout=ANSWER_TIMEOUT_S
            )
        except Exception as e:
            log(
                f"{sbx.sandbox_id} did not answer `echo ready` within {ANSWER_TIMEOUT_S:.0f} s"
                f" ({type(e).__name__}: {e}); the node's diagnostics of it:\n"
                f"{node_diagnostics(sbx.sandbox_id)}"
            )
            raise
        if result.stdout.strip() != "ready":
            raise RuntimeError(f"{sbx.sandbox_id} answered {result.stdout!r}")

    def kill_all(self, sandboxes):
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda s: s.kill(**self.opts), sandboxes))

    def settle(self, at_least=None):
        if at_least is None:
            at_least = self.args.pool_size
        return wait_settled(self.args.server_pid, self.args.vmm_exe, at_least)

    def create_to_first_command(self):
        # One create first, not counted: the SDK's first call imports and sets
        # up its clients (1.6 s of emulated client CPU in the lab).
        c0, t0 = time.process_time(), time.perf_counter()
        warm = self.create()
        self.answer(warm)
        warmup = {"ms": ms(time.perf_counter() - t0), "client_cpu_ms": ms(time.process_time() - c0)}
        warm.kill(**self.opts)
        log(f"warm-up create: {warmup['ms']:.0f} ms (not counted)")
        self.settle()
        total, create_call, cpu, second = [], [], [], []
        for run in range(1, self.args.runs + 1):
            c0, t0 = time.process_time(), time.perf_counter()
            sbx = self.create()
            t1 = time.perf_counter()
            self.answer(sbx)
            t2, c1 = time.perf_counter(), time.process_time()
            total.append(ms(t2 - t0))
            create_call.append(ms(t1 - t0))
            cpu.append(ms(c1 - c0))
            # not in the figure: what any command costs, for comparison
            self.answer(sbx)
            second.append(ms(time.perf_counter() - t2))
            log(f"create {run}/{self.args.runs}: {total[-1]:.0f} ms to the first command result")
            sbx.kill(**self.opts)
        return summary(total), {
            "warmup_not_counted": warmup,
            "create_call_ms": summary(create_call),
            "client_cpu_ms": summary(cpu),
            "second_command_ms": summary(second),
        }

    def fork(self):
        count = self.args.fork_count
        parent = self.create()
        self.answer(parent)
        self.settle()
        children, errors = [], []
        try:
            c0, t0 = time.process_time(), time.perf_counter()
            results = parent.fork(count=count, timeout=SANDBOX_TTL_S, **self.opts)
            t1 = time.perf_counter()
            for r in results:
                (errors if isinstance(r, Exception) else children).append(r)
            errors = [f"fork: {e!r}" for e in errors]

            def answers(child):
                try:
                    self.answer(child)
                    return None
                except Exception as e:  # one child's failure is a result
                    return f"{child.sandbox_id}: {e!r}"

            with ThreadPoolExecutor(max(1, len(children))) as pool:
                errors += [e for e in pool.map(answers, children) if e]
            t2, c1 = time.perf_counter(), time.process_time()
            log(f"fork of {count}: {len(children)} children, all answered after {ms(t2 - t0):.0f} ms")
            detail = {
                "children": count,
                "fork_call_ms": ms(t1 - t0),
                "all_answered_ms": ms(t2 - t0),
                "client_cpu_ms": ms(c1 - c0),
                "errors": errors,
            }
            return (None if errors else ms(t2 - t0)), detail
        finally:
            self.kill_all(children + [parent])

    def creates_concurrent(self):
        total, workers = self.args.creates, CONCURRENCY
        self.settle()
        made, latency, errors = [], [], []
        lock = threading.Lock()
        claimed = [0]

        def worker():
            while True:
                with lock:
                    if claimed[0] >= total:
                        return
                    claimed[0] += 1
                t0 = time.perf_counter()
                try:
                    sbx = self.create()
                    with lock:
                        made.append(sbx)
                    self.answer(sbx)
                except Exception as e:  # counted as not created
                    with lock:
                        errors.append(repr(e))
                    continue
                with lock:
                    latency.append(ms(time.perf_counter() - t0))

        c0, t0 = time.process_time(), time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed, c1 = time.perf_counter() - t0, time.process_time()
        try:
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
            return round(rate, 3), detail
        finally:
            self.kill_all(made)

    def idle_memory(self):
        k = self.args.idle
        baseline_vmms = self.settle()
        before = node_memory(self.args.server_pid, self.args.vmm_exe)
        avail_before = mem_available_kib()
        sandboxes = []
        try:
            for _ in range(k):
                sbx = self.create()
                sandboxes.append(sbx)
                self.answer(sbx)
            log(f"{k} sandboxes up; idling {self.args.idle_seconds} s")
            time.sleep(self.args.idle_seconds)
            # the pool refills behind the creates: wait for it too
            self.settle(at_least=baseline_vmms + k)
            after = node_memory(self.args.server_pid, self.args.vmm_exe)
            avail_after = mem_available_kib()
        finally:
            self.kill_all(sandboxes)
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
        return round(per, 2), detail

    def run(self):
        report, detail = {}, {
            "sdk": "e2b (Python) " + _sdk_version(),
            "template": self.args.template,
            "client": "runs on the node next to the server, so the node's processes "
            "can be read from /proc; in the lab its CPU time is emulated too "
            "(client_cpu_ms)",
        }
        report["sdk_create_to_first_command_ms"], detail["create_to_first_command"] = (
            self.create_to_first_command()
        )
        report["sdk_fork16_ms"], detail["fork16"] = self.fork()
        report["sdk_creates_per_s_4way"], detail["creates_concurrent"] = (
            self.creates_concurrent()
        )
        report["idle_sandbox_mib"], detail["idle"] = self.idle_memory()
        per = report["idle_sandbox_mib"]
        report["idle_sandboxes_per_24gib"] = math.floor(24 * 1024 / per) if per > 0 else None
        report["sdk_detail"] = detail
        return report


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
    p.add_argument("--idle", type=int, default=8)
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--pool-size", type=int, default=4)
    p.add_argument("--health-timeout", type=float, default=1200.0)
    args = p.parse_args()
    if args.self_test:
        self_test()
        return
    if args.server_pid is None or not args.vmm_exe:
        p.error("--server-pid and --vmm-exe are needed")
    url = os.environ["E2B_API_URL"]
    log(f"waiting for {url}/health (the first start builds the base template)")
    wait_for_health(url, args.health_timeout)
    print(json.dumps(Bench(args).run()))


if __name__ == "__main__":
    main()
