"""What the suite runs, as data: the quick checks, the lab jobs and the host jobs.

A command is an argv run from the repository's root. In it and in its env,
`{bin}` stands for the path of the job's test binary (`binary`, a test
target's name, from the test build); an argument holding `*` is a glob
(sorted; it must match something).
"""

from dataclasses import dataclass, field, replace
from enum import Enum


class Group(Enum):
    # in the order a run meets them
    BUILD = "build"
    QUICK = "quick"
    LAB = "lab"
    HOST = "host"


class Tier(Enum):
    DEFAULT = "default"
    # run by `--long` (beside the default tier), or named with `--only`: the
    # cases too slow for every landing, run before a capability is called done
    LONG = "long"


@dataclass(frozen=True)
class Job:
    name: str
    group: Group
    command: tuple[str, ...]
    about: str
    # expected minutes (docs/src/testing/runner.md): the lab queue is taken longest first
    minutes: float = 0.0
    # the integration test (a `tests/NAME.rs` target) whose binary the job
    # runs: it waits for the lab jobs' step of the test build
    binary: str | None = None
    # a binary of `#[ignore = "lab: ..."]` tests: run inside the lab (unless
    # the host has hardware KVM), re-run by the names of the tests that failed
    lab_tests: bool = False
    # a test binary's harness output: a re-run names the tests that failed
    by_test_name: bool = False
    # its pytest suites re-run a failed test once in place (`--reruns 1`): the
    # job runs again only after a lab stall (retry.py)
    reruns_tests: bool = False
    env: tuple[tuple[str, str], ...] = field(default=())
    # stdout goes nowhere (its report is long; stderr carries the diagnostics)
    discard_stdout: bool = False
    tier: Tier = Tier.DEFAULT
    # a host job that runs the test build's binaries through cargo (not
    # by `binary`): it starts once they are built, if the run builds them
    after_tests: bool = False
    # a suite against one node (it takes `--node DIR`): run through
    # scripts/shared-node.sh on its lane's node, which the lane starts once
    # and the lane's next such jobs share
    shared_node: bool = False

    @property
    def needs_tests(self) -> bool:
        return self.binary is not None

    @property
    def retried(self) -> bool:
        """Under the retry rule (retry.py): what runs tests or machines. A
        build or a quick check runs once: a re-run does not change a compile
        error or a lint."""
        return self.group in (Group.LAB, Group.HOST)


def argv(words: str) -> tuple[str, ...]:
    return tuple(words.split())


# What a long-tier job of a suite sets: the suite runs its long cases too.
LONG_TIER = ("SANDFORK_TEST_TIER", "long")


def lab_tests(name: str, minutes: float, about: str) -> Job:
    """A test binary of lab tests (crates/vmm/tests, crates/server/tests/lab_*)."""
    return Job(
        name,
        Group.LAB,
        argv("{bin} --ignored --test-threads=1"),
        about,
        minutes=minutes,
        binary=name,
        lab_tests=True,
        by_test_name=True,
    )


# Before everything, and nothing runs when one fails. deps first, alone: it
# installs the compiler cache whose server the run starts before the build.
DEPS = Job(
    "deps",
    Group.BUILD,
    argv("scripts/deps.sh"),
    "the Debian packages and tools the build and tests need (installs, as root)",
)
BUILD = Job(
    "build",
    Group.BUILD,
    argv("scripts/build.sh"),
    "the workspace, the static agent, the guest kernel and base image",
)

# Skipped by --lab-only. The first that fails ends the run.
QUICK = (
    Job("fmt", Group.QUICK, argv("cargo fmt --all --check"), "the workspace's formatting"),
    Job(
        "fmt_fuzz",
        Group.QUICK,
        argv("cargo fmt --check --manifest-path fuzz/Cargo.toml"),
        "the fuzz crate's formatting (it is outside the workspace)",
    ),
    # A script hashed into a cache key keeps its directives in a
    # .shellcheckrc beside it, so they rebuild nothing.
    Job(
        "shellcheck",
        Group.QUICK,
        argv("shellcheck scripts/*.sh images/*/*.sh crates/lab/src/init.sh .ci/run"),
        "every shell script, the lab's init included",
    ),
    Job(
        "deny",
        Group.QUICK,
        argv("scripts/deny.sh"),
        "dependency licences, bans and sources against deny.toml, offline",
    ),
    Job(
        "runner",
        Group.QUICK,
        argv("python3 -m sandfork_runner.selfcheck"),
        "this runner: ruff, mypy and its unit tests",
        env=(("PYTHONPATH", "tests/runner"),),
    ),
)

# The test build (`cargo test --workspace --no-run`), beside the first lab
# jobs, in two steps: first only the integration tests the lab jobs run
# (`--test NAME` each: a few minutes), so that those jobs start while the
# rest builds (the server's and the CLI's unit tests alone take over 8 min on
# one core); then everything, for the fast tests. From the whole workspace
# both times, as naming packages with -p would resolve features for them
# alone and compile their dependencies again (6 min of a CI run). Niced: the
# labs' guests notice time lost to it (an rl test's 60 s command overran
# beside it).
TEST_BUILD_ARGV = argv("nice -n 10 cargo test --workspace --no-run --quiet") + argv(
    "--message-format=json-render-diagnostics"
)
LAB_TEST_BUILD = Job(
    "lab_bins",
    Group.BUILD,
    TEST_BUILD_ARGV,
    "the lab jobs' test binaries (their integration tests named with --test), first",
)
TEST_BUILD = Job(
    "tests",
    Group.BUILD,
    TEST_BUILD_ARGV,
    "the test binaries, the fast tests' and the lab's",
)

# Taken from one queue by the lab lanes, longest first, so that the lanes
# end close together. Each needs a lab machine to itself, but the suites
# against one node (`shared_node`) share their lane's node and its machine.
LAB: tuple[Job, ...] = (
    Job(
        "sdk",
        Group.LAB,
        argv("scripts/sdk-test.sh --no-build"),
        "the real e2b Python and JS SDKs and the E2B CLI against a real node: "
        "the basic suites, then pause, fork and snapshots",
        # measured 12:41 and 13:30 in full runs (2026-12-06)
        minutes=13.5,
        reruns_tests=True,
        shared_node=True,
    ),
    Job(
        "cluster",
        Group.LAB,
        argv("scripts/cluster-test.sh --no-build"),
        "the pytest suite tests/cluster: 3 nodes and 2 gateways on a real etcd of 3 "
        "members and S3: routing, the SDK, etcd's leader and quorum lost, a fork across "
        "nodes, a team's limit, durable pauses, a node cut off, the store down",
        # 12:19 in a full run before its long sections moved out (3 min of
        # them); 13:30 in one of 2026-12-07; test_11's images add about 4
        minutes=14,
    ),
    lab_tests("lab_serve", 7.5, "sandfork serve in the lab (crates/server/tests/lab_serve.rs)"),
    Job(
        "rl",
        Group.LAB,
        argv("scripts/rl-test.sh --no-build"),
        "the sandfork Python package: ruff, the pure tests, then forks, environments, "
        "Gymnasium's checker and the branching runner",
        # 3:13 in a full run; 4:19 alone with the fork-per-group tests
        minutes=4.5,
        reruns_tests=True,
        shared_node=True,
    ),
    Job(
        "harbor",
        Group.LAB,
        argv("scripts/harbor-test.sh --no-build"),
        "Harbor from PyPI (`harbor run --env e2b -a oracle`) on tests/harbor/tasks against "
        "a real node, at concurrency 4 (and 1 in the long tier), then through sandfork's "
        "fork-per-group adapter: every trial solved",
        # 4:15 with both concurrencies in a full run; the n1 pass was 1.5 of it;
        # the adapter's pass 2-3 min more
        minutes=5.5,
        shared_node=True,
    ),
    Job(
        "frameworks",
        Group.LAB,
        argv("scripts/frameworks-test.sh --no-build"),
        "the RL frameworks' own E2B code from PyPI against a real node (tests/frameworks): "
        "NeMo Gym's `e2b` provider, its template build helper, a rollout and a group",
        # measured 1:04 alone, 2:02 beside another lab lane, venv cached
        # (docs/src/nemo-gym.md); a cold venv adds 3.5
        minutes=2,
        shared_node=True,
    ),
    lab_tests("snapshot", 4, "snapshots and restores (crates/vmm/tests/snapshot.rs)"),
    lab_tests("lab_network", 3.5, "the node's networking (crates/server/tests/lab_network.rs)"),
    lab_tests("microvm", 2, "boots, vCPUs and devices (crates/vmm/tests/microvm.rs)"),
    lab_tests("lab_restart", 2, "a node restarted (crates/server/tests/lab_restart.rs)"),
    Job(
        "soak",
        Group.LAB,
        argv("scripts/soak-test.sh --no-build"),
        "the short soak (docs: testing/soak.md): 4 sandboxes, 300 commands, 100 files, "
        "no error and the server's RSS flat",
        minutes=1.5,
    ),
    Job(
        "cli",
        Group.LAB,
        argv("scripts/cli-test.sh --no-build"),
        "every sandfork CLI command against one real node, the shell through tmux",
        minutes=1.5,
        binary="cli_node",
        env=(("CLI_NODE_TEST_BIN", "{bin}"),),
    ),
    Job(
        "lab_tool",
        Group.LAB,
        argv("{bin} --ignored --test-threads=1 -q"),
        "the lab tooling's own tests (QEMU on this host)",
        minutes=1.5,
        binary="lab_run",
        by_test_name=True,
    ),
    Job(
        "stress",
        Group.LAB,
        argv("target/debug/sandfork stress --boots 2 --restores 2 --forks 2 --two-vm 1"),
        "the short sandfork stress (docs: testing/hangs.md): boots, restores, forks, two VMs",
        minutes=1,
        discard_stdout=True,
    ),
    lab_tests("network", 1, "the network device (crates/vmm/tests/network.rs)"),
    # The long tier. Minutes measured (README, "Soak") or estimated.
    Job(
        "soak_long",
        Group.LAB,
        argv("scripts/soak-test.sh --no-build --sandboxes 32 --commands 10000")
        + argv("--files 2000 --duration 30m"),
        "the longer soak (docs: testing/soak.md): 32 sandboxes, 10 000 commands, 2 000 files, "
        "at most 30 min of load, in a 16 GiB lab machine",
        minutes=35,
        env=(("SOAK_LAB_MEMORY", "16384"), ("SOAK_LAB_TIMEOUT", "3600")),
        tier=Tier.LONG,
    ),
    Job(
        "stress_long",
        Group.LAB,
        argv("target/debug/sandfork stress --boots 40 --restores 40 --forks 40 --two-vm 40"),
        "sandfork stress with 40 of each (docs: testing/hangs.md)",
        minutes=20,
        discard_stdout=True,
        tier=Tier.LONG,
    ),
)


def long_variant(name: str, about: str, minutes: float) -> Job:
    """A lab job of the default tier run again in the long tier with its
    long cases (SANDFORK_TEST_TIER=long)."""
    job = next(j for j in LAB if j.name == name)
    return replace(
        job, name=f"{name}_long", about=about, minutes=minutes, env=(*job.env, LONG_TIER),
        tier=Tier.LONG,
    )  # fmt: skip


LAB += (
    long_variant(
        "sdk",
        "the SDK suites with their long cases: the JS SDK's long streaming command too",
        15,
    ),
    long_variant(
        "cluster",
        "the cluster suite with its long sections: the SDK's four files whole through "
        "the gateways, creates per second, and TLS between all the parts",
        # 17 in plain HTTP; TLS in the lab about doubles it (one default-tier
        # run with TLS outlived the lab's 40-min bound, 2026-12-07)
        40,
    ),
    long_variant("harbor", "Harbor at concurrency 4, then 1 (each template found by its tag)", 6),
)

# On the host, one after the other, at the lowest CPU priority, beside the
# lab lanes; skipped by --lab-only. Those that need no test binary start
# beside the test build (the lanes' guests and the test build leave a core
# idle for much of it: its longest units compile on one); `fast_tests` once
# the tests are built. Clippy checks in a target dir of its own, as cargo
# would otherwise hold the test build's lock while it runs.
HOST = (
    Job(
        "docs",
        Group.HOST,
        argv("scripts/docs.sh"),
        "the book under docs/ built with mdBook, its links and anchors checked, the README's too",
    ),
    Job(
        "clippy",
        Group.HOST,
        argv("cargo clippy --workspace --all-targets --quiet -- -D warnings"),
        "lints of every target, with the workspace's [workspace.lints]",
        env=(("CARGO_TARGET_DIR", "target/clippy"),),
    ),
    Job(
        "fuzz",
        Group.HOST,
        argv("scripts/fuzz.sh"),
        "every fuzz target: corpora replayed, then each fuzzed briefly (docs: testing/fuzzing.md)",
    ),
    # The long tier: on the host (no guest), as root for the conversion's
    # loop mounts; minutes measured (docs: benchmarks.md, the image keys),
    # plus the task images made once (about 2 min, cached by content).
    Job(
        "images_bench",
        Group.HOST,
        argv("target/debug/sandfork bench --only images --runs 1 --json target/bench/images.json"),
        "the task images bench (docs: benchmarks.md): 1 and 4 GiB images pulled and converted "
        "cold against the whole-image path, and the disk 1, 4 and 16 images sharing a base take",
        minutes=12,
        discard_stdout=True,
        tier=Tier.LONG,
    ),
    Job(
        "cluster_scale_bench",
        Group.HOST,
        argv("target/debug/sandfork bench --only cluster-scale")
        + argv("--json target/bench/cluster-scale.json"),
        "the control plane at a fleet's size (docs: benchmarks.md): three etcd members, 100 "
        "node records, 10k, 50k and 100k routes; a gateway's reload, memory and lookups",
        minutes=5,
        discard_stdout=True,
        tier=Tier.LONG,
    ),
    Job(
        "fast_tests",
        Group.HOST,
        argv("cargo test --workspace --quiet"),
        "unit tests, the VMM's API tests against the real binary, the agent as a host process",
        after_tests=True,
    ),
)

ALL = (DEPS, BUILD, *QUICK, LAB_TEST_BUILD, TEST_BUILD, *LAB, *HOST)


def by_name(name: str) -> Job:
    for job in ALL:
        if job.name == name:
            return job
    raise KeyError(name)
