"""One run of the suite: the build, the quick checks, then side by side the lab
lanes (their queue), the test build and the host jobs."""

import glob
import json
import os
import shlex
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from . import jobs, lab, proc
from .cargo import binaries, executables, failed_tests, relinked
from .cpu import CpuLoad
from .jobs import Group, Job, Tier
from .queue import JobQueue
from .record import JobRecord, Result, Try, clock, failure_report, outcome, summary
from .retry import Outcome, rerun_in_place, run_again, stood_still
from .timings import PerTestClock

# how many of a test binary's slowest tests a try records and prints
SLOWEST_SHOWN = 6


@dataclass(frozen=True)
class Plan:
    """What a run runs, from its flags."""

    quick: tuple[Job, ...]
    lab: tuple[Job, ...]
    host: tuple[Job, ...]
    lanes: int

    @property
    def test_build(self) -> bool:
        return any(job.needs_tests for job in self.lab + self.host)

    @property
    def lab_binaries(self) -> list[str]:
        """The integration tests the lab jobs run, built first."""
        return sorted({job.binary for job in self.lab if job.binary})

    def jobs(self) -> list[Job]:
        """Every job of the run, in the order it meets them."""
        build = [jobs.DEPS, jobs.BUILD, *self.quick]
        tests = [jobs.TEST_BUILD] if self.test_build else []
        if self.test_build and self.lab_binaries:
            tests.insert(0, jobs.LAB_TEST_BUILD)
        return [*build, *tests, *self.lab, *self.host]


# Host jobs at once: one while the lanes run, as the labs hold the CPU; two
# once they are done, when both cores are free (one after the other, clippy,
# fuzz and fast_tests were the run's last 8 min).
HOST_JOBS_BESIDE_LANES = 1
HOST_JOBS_AFTER_LANES = 2


def next_host_job(
    pending: list[Job], running: int, lanes_over: bool, tests_built: bool
) -> Job | None:
    """The host job to start now, if any: the first of `pending` whose test
    binaries are built (when it needs them), while fewer run than the width."""
    width = HOST_JOBS_AFTER_LANES if lanes_over else HOST_JOBS_BESIDE_LANES
    if running >= width:
        return None
    return next((job for job in pending if tests_built or not job.after_tests), None)


class UnknownJob(ValueError):
    pass


def plan(*, lab_only: bool, only: list[str] | None, long: bool, lanes: int) -> Plan:
    """The default tier (and with `long` the long one too), or the jobs named
    by `only` (of any tier); `lab_only` leaves out the quick and host jobs.
    No more lanes than lab jobs."""
    if only is not None:
        known = {job.name for job in jobs.QUICK + jobs.LAB + jobs.HOST}
        unknown = [name for name in only if name not in known]
        if unknown:
            raise UnknownJob(
                f"no job {', '.join(unknown)} (the jobs: {', '.join(sorted(known))}; see --list)"
            )

        def chosen(job: Job) -> bool:
            return job.name in only
    else:

        def chosen(job: Job) -> bool:
            return job.tier is Tier.DEFAULT or long

    quick = () if lab_only else tuple(j for j in jobs.QUICK if chosen(j))
    host = () if lab_only else tuple(j for j in jobs.HOST if chosen(j))
    lab_jobs = tuple(j for j in jobs.LAB if chosen(j))
    return Plan(quick, lab_jobs, host, min(max(lanes, 1), len(lab_jobs), len(lab.LOCKS)))


def last_line(log: Path) -> str:
    """The last line a job wrote: a skipped job's reason."""
    lines = log.read_text(errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else "(no reason given)"


def expand(argv: list[str], root: Path) -> list[str]:
    """An argument holding `*` is a glob from the root, sorted; one that
    matches nothing is an error (bash would pass it on as it is)."""
    out = []
    for arg in argv:
        if "*" not in arg:
            out.append(arg)
            continue
        found = sorted(glob.glob(arg, root_dir=root))
        if not found:
            raise FileNotFoundError(f"{arg} matches no file")
        out.extend(found)
    return out


class Interrupted(Exception):
    pass


class Run:
    def __init__(
        self, root: Path, the_plan: Plan, run_dir: Path, console: proc.Console, argv: list[str]
    ) -> None:
        self.root = root
        self.plan = the_plan
        self.run_dir = run_dir
        self.console = console
        self.argv = argv
        self.processes = proc.Processes()
        self.records = {job.name: JobRecord(job) for job in the_plan.jobs()}
        self.queue = JobQueue(the_plan.lab)
        self.locks = lab.Locks()
        # the lab jobs' binaries built; all the tests built
        self.lab_bins_done = threading.Event()
        self.tests_done = threading.Event()
        self.test_bins: dict[str, str] = {}
        self.hardware = False
        self.rw_dir = ""
        self.interrupted = False
        self.error = ""
        self._sccache = False
        self.cpu = CpuLoad(self.console.elapsed)
        # set by each lane thread and the host jobs' thread as it ends:
        # Thread.join interrupted by Ctrl+C can leave is_alive() false for a
        # thread that still runs
        self._threads_done: list[threading.Event] = []
        # the lanes' own, among them: the host jobs widen once all are set
        self._lanes_done: list[threading.Event] = []

    # --- the run ------------------------------------------------------------

    def main(self) -> int:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.cpu.start()
        try:
            if self.prepare():
                self.suite()
        except KeyboardInterrupt:
            # one stop: a second signal (`timeout` sends its own group one
            # more) must not cut the summary short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self.interrupted = True
            self.console.stage("interrupted: stopping the jobs")
            self.stop()
        except Exception as e:
            # a fault of the runner's own, or of what it reads (the lab's
            # detect): the run fails, saying so, with what it recorded
            self.error = f"{e!r}"
            self.console.line("runner", traceback.format_exc().encode())
            self.stop()
        finally:
            self.cpu.stop()
            if self._sccache:
                subprocess.run(
                    ["sccache", "--stop-server"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                )
        return self.report(started)

    def prepare(self) -> bool:
        """deps, the compiler cache's server, the build, the quick checks.
        False when one failed (the run ends there)."""
        if not self.step(jobs.DEPS):
            return False
        os.environ.update(proc.sourced_env(Path("scripts/sccache.sh"), self.root))
        if os.environ.get("RUSTC_WRAPPER") == "sccache":
            # One cache server for the whole run, stopped when it ends (a
            # server a cargo started would outlive the run). Started before
            # the lab locks are held, though they are not inherited anyway.
            # One already running (another run's, on a shared machine) is
            # used and left running: stopping it would fail that run's builds.
            os.environ["SCCACHE_IDLE_TIMEOUT"] = "0"
            started = subprocess.run(
                ["sccache", "--start-server"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
            self._sccache = started.returncode == 0
        if not self.step(jobs.BUILD):
            return False
        os.environ.update(proc.sourced_env(Path("target/sandfork.env"), self.root))
        # A directory shared read-write with the lab over 9p, as `sandfork
        # serve`'s cache and data dir are there (lab tests that need such a
        # share use it).
        cache = os.environ.get("SANDFORK_CACHE", "/var/cache/sandfork")
        self.rw_dir = os.environ["SANDFORK_LAB_RW_DIR"] = f"{cache}/lab-rw"
        Path(self.rw_dir).mkdir(parents=True, exist_ok=True)
        if self.plan.quick:
            self.console.stage("format, shell scripts, licences, this runner")
        return all(self.step(job) for job in self.plan.quick)

    def step(self, job: Job) -> bool:
        """A build step or quick check, in the main thread."""
        self.run_job(job, "")
        return self.records[job.name].result is Result.PASSED

    def suite(self) -> None:
        """The lab lanes, each with its own lab machine and lock, taking jobs
        from one queue; the tests built beside their first jobs (or while the
        lanes wait for their locks); then the host jobs beside the rest. With
        one lane, one after the other."""
        lanes = self.plan.lanes
        if lanes:
            os.environ["SANDFORK_LAB_LOCKED"] = "1"
            if any(job.lab_tests for job in self.plan.lab):
                self.hardware = lab.hardware_kvm(self.root)
                where = "on this host's KVM" if self.hardware else "inside the lab"
                self.console.stage(f"lab test binaries run {where}")
        if not self.plan.test_build:
            self.lab_bins_done.set()
            self.tests_done.set()
        if lanes <= 1:
            self.build_tests()
            self.host()
            if lanes:
                self.lane("lane1", threading.Event())
            return
        self._lanes_done = [threading.Event() for _ in range(lanes)]
        self._threads_done = list(self._lanes_done)
        for n, done in enumerate(self._lanes_done):
            threading.Thread(target=self.lane, args=(f"lane{n + 1}", done), daemon=True).start()
        host_done = threading.Event()
        self._threads_done.append(host_done)
        threading.Thread(target=self.host, args=(host_done,), daemon=True).start()
        self.build_tests()
        for done in self._threads_done:
            # with a timeout, so that Ctrl+C reaches this thread
            while not done.wait(timeout=1):
                pass

    def lane(self, name: str, done: threading.Event) -> None:
        """Takes a lab lock, then jobs until the queue is empty."""

        def ready(job: Job) -> bool:
            return not job.needs_tests or self.lab_bins_done.is_set()

        node_up = False

        def shares_the_node(job: Job) -> bool:
            return node_up and job.shared_node

        try:
            held = self.locks.take(self.console.stage, lambda: len(self.queue) > 0)
            if held is None:
                return
            self.console.stage(f"{name}: holding {held}")
            while job := self.queue.take(ready, shares_the_node):
                self.run_job(job, name)
                node_up = node_up or job.shared_node
        finally:
            if node_up:
                self.stop_lane_node(name)
            done.set()

    def lane_node(self, lane: str) -> Path:
        """Where the node a lane's suites share keeps its log, store and
        files (scripts/shared-node.sh)."""
        return self.root / "target/lane-node" / lane

    def stop_lane_node(self, lane: str) -> None:
        self.console.stage(f"{lane}: stopping its node")
        subprocess.run(
            ["scripts/shared-node.sh", "--stop", str(self.lane_node(lane))],
            cwd=self.root,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )

    def host(self, done: threading.Event | None = None) -> None:
        """The host jobs at the lowest CPU priority: those that need no test
        binary at once, beside the test build, the rest once it is done; one
        at a time while the lanes run, two once they are done (next_host_job).
        They have the labs' half hour to finish in, while the labs' guests
        notice time lost to them (commands and starts bounded in time)."""
        try:
            pending = sorted(self.plan.host, key=lambda j: j.after_tests)
            running: list[threading.Thread] = []
            while pending and not self.processes.stopping:
                running = [t for t in running if t.is_alive()]
                lanes_over = all(e.is_set() for e in self._lanes_done)
                job = next_host_job(pending, len(running), lanes_over, self.tests_done.is_set())
                if job is None:
                    time.sleep(1)
                    continue
                pending.remove(job)
                build = self.records.get(jobs.TEST_BUILD.name)
                if job.after_tests and build is not None and build.result is not Result.PASSED:
                    self.records[job.name].note = "the test build failed"
                    continue
                thread = threading.Thread(target=self.run_job, args=(job, "host"), daemon=True)
                thread.start()
                running.append(thread)
            for thread in running:
                thread.join()
        finally:
            if done is not None:
                done.set()

    def stop(self) -> None:
        """No more jobs; those running are stopped, and their lanes given a
        while to record them."""
        for job in self.queue.close():
            self.records[job.name].note = "the run was stopped"
        self.processes.terminate_all()
        self.lab_bins_done.set()
        self.tests_done.set()
        deadline = time.monotonic() + 30
        for done in self._threads_done:
            done.wait(timeout=max(0.0, deadline - time.monotonic()))

    # --- the test build -----------------------------------------------------

    def build_tests(self) -> None:
        """The test binaries in two steps (jobs.py, TEST_BUILD): the lab
        jobs' first, then the jobs that wait for them go on; then the rest."""
        if not self.plan.test_build:
            return
        try:
            lab = self.plan.lab_binaries
            if lab:
                named = [f"--test={name}" for name in lab]
                if not self.build_test_step(jobs.LAB_TEST_BUILD, named):
                    # nothing more: the full build would fail the same way
                    return
                self.lab_bins_done.set()
            self.build_test_step(jobs.TEST_BUILD, [])
        finally:
            self.lab_bins_done.set()
            self.tests_done.set()

    def build_test_step(self, job: Job, extra: list[str]) -> bool:
        """One `cargo test --no-run`; its binaries added to `test_bins`. It
        must not link the binaries the labs are running anew: a lab that runs
        a binary replaced under it over 9p starts VMMs that never listen (seen
        for 4 minutes of one run). `cargo build` and `cargo test` agree on
        every dependency's features only while no dev-dependency turns on one
        of its own (tokio's `test-util` did), so a test build that relinks
        them fails the run, naming them."""
        record = self.records[job.name]
        record.lane = "main"
        debug = self.root / "target/debug"
        before = binaries(debug)
        captured: list[bytes] = []
        self.console.stage("building the lab jobs' tests" if extra else "building the tests")
        t = self.attempt(record, self.command(job, None) + extra, None, "capture", captured)
        self.test_bins.update(executables(line.decode() for line in captured))
        changed = relinked(before, binaries(debug))
        if changed:
            message = (
                "the test build linked the binaries anew while labs ran them (a "
                "dev-dependency turns on a feature `cargo build` lacks: compare `cargo "
                "tree -e features` with and without `-e dev`): " + " ".join(changed)
            )
            with open(self.root / t.log, "a") as log:
                log.write(message + "\n")
            self.console.line(job.name, message.encode())
            t.exit_code = t.exit_code or 1
        record.result = Result.PASSED if t.passed else Result.FAILED
        self.end(record)
        return t.passed

    # --- one job ------------------------------------------------------------

    def run_job(self, job: Job, lane: str) -> None:
        """A job under the retry rule; a failure is recorded, never raised."""
        record = self.records[job.name]
        record.lane = lane
        self.console.stage(f"{job.name} ({lane})" if lane else job.name)
        try:
            if job.binary is not None:
                if not self.lab_bins_done.is_set():
                    self.console.stage(f"{job.name}: waiting for the test build")
                    self.lab_bins_done.wait()
                binary = self.test_bins.get(job.binary)
                if binary is None or not os.access(binary, os.X_OK):
                    record.note = f"no test binary {job.binary} (the test build failed?)"
                    record.result = Result.FAILED
                    self.console.line(job.name, record.note.encode())
                    self.end(record)
                    return
            outcomes: list[Outcome] = []
            tests: list[str] | None = None
            while not self.processes.stopping:
                argv = self.command(job, tests)
                if job.shared_node and lane:
                    argv = ["scripts/shared-node.sh", str(self.lane_node(lane)), "--", *argv]
                t = self.attempt(record, argv, tests)
                outcomes.append(Outcome(t.passed, t.stood_still))
                if t.skipped:
                    break
                if self.processes.stopping:
                    record.note = "stopped: the run was interrupted"
                    break
                if not job.retried or not run_again(outcomes, reruns_inside=job.reruns_tests):
                    break
                if job.by_test_name:
                    tests = failed_tests((self.root / t.log).read_text(errors="replace")) or None
                first_rerun = len(outcomes) == 1 and not job.reruns_tests
                why = "it failed" if first_rerun else "the lab stood still during it"
                again = "the tests " + " ".join(tests) if tests else "whole"
                self.console.stage(f"{job.name}: re-running ({why}): {again}")
            if record.tries:
                record.result = outcome(record.tries[-1])
                if record.result is Result.SKIPPED:
                    record.note = last_line(self.root / record.tries[-1].log)
        except Exception as e:
            # a fault of the runner's: this job fails, the others still run
            record.note = f"runner error: {e!r}"
            record.result = Result.FAILED
            self.console.line(job.name, traceback.format_exc().encode())
        self.end(record)

    def end(self, record: JobRecord) -> None:
        name = record.job.name
        if record.result is Result.PASSED:
            self.console.stage(f"{name}: passed in {clock(record.duration)}")
        elif record.result is Result.FAILED:
            self.console.stage(f"{name}: FAILED")
        elif record.result is Result.SKIPPED:
            self.console.stage(f"{name}: SKIPPED: {record.note}")

    def command(self, job: Job, tests: list[str] | None) -> list[str]:
        """Its argv: {bin} replaced, globs expanded, the tests named
        when only some run again, inside the lab when it is one's, niced when
        it runs on the host beside the labs."""
        binary = self.test_bins.get(job.binary, "") if job.binary else ""
        argv = [a.replace("{bin}", binary) for a in job.command]
        argv = expand(argv, self.root)
        if tests:
            argv += ["--exact", *tests]
        if job.lab_tests and not self.hardware:
            argv = lab.in_lab(argv, self.rw_dir)
        if job.group is Group.HOST:
            argv = ["nice", "-n", "19", *argv]
        return argv

    def attempt(
        self,
        record: JobRecord,
        argv: list[str],
        tests: list[str] | None,
        stdout: proc.Stdout | None = None,
        captured: list[bytes] | None = None,
    ) -> Try:
        """One try of a job, its whole output in its own log file."""
        job = record.job
        number = len(record.tries) + 1
        log = self.run_dir / (f"{job.name}.log" if number == 1 else f"{job.name}.try{number}.log")
        log.write_text(f"# {shlex.join(argv)}\n")
        binary = self.test_bins.get(job.binary, "") if job.binary else ""
        env = dict(os.environ)
        env.update((k, v.replace("{bin}", binary)) for k, v in job.env)
        start = self.console.elapsed()
        test_clock = PerTestClock(self.console.elapsed) if job.by_test_name else None

        def ended(code: int) -> Try:
            text = log.read_bytes()
            t = Try(
                number=number,
                start=start,
                duration=self.console.elapsed() - start,
                exit_code=code,
                stood_still=stood_still(text),
                log=str(log.relative_to(self.root)),
                tests=tests,
                slowest=test_clock.slowest(SLOWEST_SHOWN) if test_clock else [],
                rerun=rerun_in_place(text) if job.reruns_tests else [],
            )
            t.cpu_busy = self.cpu.busy(t.start, t.start + t.duration)
            record.tries.append(t)
            if t.slowest:
                said = ", ".join(f"{name} {s:.0f} s" for name, s in t.slowest)
                self.console.line(job.name, f"slowest tests: {said}\n".encode())
            if t.rerun:
                self.console.line(job.name, f"ran again in place: {' '.join(t.rerun)}\n".encode())
            return t

        try:
            code = proc.run(
                argv,
                name=job.name,
                log_path=log,
                console=self.console,
                processes=self.processes,
                cwd=self.root,
                env=env,
                stdout=stdout or ("discard" if job.discard_stdout else "console"),
                captured=captured,
                on_line=test_clock.saw if test_clock else None,
            )
        except KeyboardInterrupt:
            # a job of the main thread's, stopped with the run: recorded too
            ended(128 + signal.SIGTERM)
            record.result = Result.FAILED
            record.note = "stopped: the run was interrupted"
            raise
        return ended(code)

    # --- the end ------------------------------------------------------------

    def report(self, started: str) -> int:
        records = list(self.records.values())
        elapsed = self.console.elapsed()
        data = summary(
            records,
            started=started,
            duration=elapsed,
            argv=self.argv,
            run_dir=str(self.run_dir.relative_to(self.root)),
            interrupted=self.interrupted,
            error=self.error,
            cpu_busy=self.cpu.timeline(),
        )
        path = self.run_dir / "summary.json"
        path.write_text(json.dumps(data, indent=2) + "\n")
        out = self.console
        out.write(b"")
        head = f"{'job':<12} {'lane':<6} {'start':>6} {'took':>6} {'cpu':>4} tries  result"
        out.write(head.encode())
        for r in records:
            start = "" if r.start is None else clock(r.start)
            took = clock(r.duration) if r.tries else ""
            busy = [t.cpu_busy for t in r.tries if t.cpu_busy is not None]
            cpu = f"{round(100 * sum(busy) / len(busy))}%" if busy else ""
            line = f"{r.job.name:<12} {r.lane:<6} {start:>6} {took:>6} {cpu:>4} {len(r.tries):>5}  "
            out.write((line + r.result.value + (f" ({r.note})" if r.note else "")).encode())
        failures = failure_report(records, self.root)
        if failures:
            out.write(b"failed:")
            for line in failures:
                out.write(f"  {line}".encode())
        out.write(f"summary: {path.relative_to(self.root)}".encode())
        if self.error:
            out.stage(f"the runner failed: {self.error}")
            return 1
        if self.interrupted:
            out.stage("interrupted")
            return 130
        if data["passed"]:
            skipped = data["skipped"]
            out.stage(f"passed; skipped: {' '.join(skipped)}" if skipped else "all passed")
            return 0
        out.stage(f"done: failed: {' '.join(data['failed'])}")
        return 1
