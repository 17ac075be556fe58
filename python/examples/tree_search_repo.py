"""A tiny tree search over a repository task: fix a failing test suite by
trying candidate fixes in forked branches and keeping the passing one.

The task: a git repository in the guest (``/home/user/repo``) whose
``stats.py`` has two bugs that fail three of its four tests. At every level
the "policy" reads the test output, proposes candidate edits for the first
failing test, and each candidate runs in its own fork of the current best
state (one fork call, the edit and the tests run in all children at once);
the child that passes the most tests is kept, the others are killed at
once. The policy is scripted so that the example runs without a model: put
an LLM's proposals where ``propose`` is. Against a local node (a minute)::

    export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
    export E2B_API_KEY=$(cat /var/lib/sandfork/api-key) E2B_VALIDATE_API_KEY=false
    python examples/tree_search_repo.py
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shlex
import time

from sandfork import Reward, SandboxEnv, StepContext, Task

REPO = "/home/user/repo"

STATS = """\
def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0


def median(xs):
    s = xs
    n = len(s)
    mid = n // 2
    if n % 2:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def clamp(x, lo, hi):
    return max(lo, min(x, lo))
"""

TESTS = """\
import unittest

from stats import clamp, mean, median


class Stats(unittest.TestCase):
    def test_mean(self):
        self.assertEqual(mean([1, 2, 3]), 2)

    def test_median_odd(self):
        self.assertEqual(median([3, 1, 2]), 2)

    def test_median_even(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_clamp(self):
        self.assertEqual(clamp(5, 0, 3), 3)
        self.assertEqual(clamp(-1, 0, 3), 0)
        self.assertEqual(clamp(2, 0, 3), 2)


if __name__ == "__main__":
    unittest.main()
"""

SETUP = [
    f"mkdir -p {REPO} && cd {REPO} && git init -q && "
    "git config user.email agent@example.com && git config user.name agent",
    f"cd {REPO} && printf %s {shlex.quote(STATS)} > stats.py",
    f"cd {REPO} && printf %s {shlex.quote(TESTS)} > test_stats.py",
    f"cd {REPO} && git add -A && git commit -qm 'stats with bugs'",
]

# What failed, by name, and the count line.
RUN_TESTS = f"cd {REPO} && python3 -m unittest 2>&1 | grep -E '^(FAIL|ERROR):|^Ran |^OK|^FAILED'"

# What a model would propose for each failing test: sed edits of stats.py,
# right and wrong ones.
CANDIDATES = {
    "median": [
        r"s/^    s = xs$/    s = xs[::-1]/",
        r"s/^    s = xs$/    s = sorted(xs)[1:]/",
        r"s/^    s = xs$/    s = sorted(xs)/",
    ],
    "clamp": [
        r"s/min(x, lo))$/min(x, hi))/",
        r"s/max(lo, min(x, lo))$/min(lo, max(x, hi))/",
        r"s/max(lo, min(x, lo))$/max(hi, min(x, lo))/",
    ],
}


def tests_passed(ctx: StepContext[object]) -> Reward:
    """The reward: tests that pass; the episode ends when all do."""
    ran = re.search(r"Ran (\d+) test", ctx.stdout)
    total = int(ran.group(1)) if ran else 0
    bad = sum(int(n) for n in re.findall(r"(?:failures|errors)=(\d+)", ctx.stdout))
    return Reward(float(total - bad), terminated=total > 0 and bad == 0)


def propose(observation: str) -> list[str]:
    """The policy: candidate commands for the first failing test."""
    failing = re.findall(r"(?:FAIL|ERROR): test_(\w+?)(?:_odd|_even)? ", observation)
    edits = CANDIDATES.get(failing[0], []) if failing else []
    return [f"cd {REPO} && sed -i {shlex.quote(e)} stats.py && {RUN_TESTS}" for e in edits]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--template", default="base")
    ap.add_argument("--max-depth", type=int, default=4)
    args = ap.parse_args()

    started = time.perf_counter()
    best = SandboxEnv(template=args.template, reward_fn=tests_passed, command_timeout=120)
    await best.reset(Task("make the tests in /home/user/repo pass", setup=SETUP), seed=1)
    first = await best.step(RUN_TESTS)
    observation = first.observation
    print(f"failing at the start:\n{observation}")
    try:
        for depth in range(1, args.max_depth + 1):
            candidates = propose(observation)
            if not candidates:
                print("no candidate for what fails:", observation)
                break
            t = time.perf_counter()
            children = await best.fork(len(candidates))
            forked = time.perf_counter() - t
            steps = (c.step(a) for c, a in zip(children, candidates, strict=True))
            results = await asyncio.gather(*steps)
            for i, (a, r) in enumerate(zip(candidates, results, strict=True)):
                print(
                    f"  depth {depth} branch {i}: {r.reward:.0f} tests pass  <- {a.split('&&')[1]}"
                )
            keep = max(range(len(children)), key=lambda i: results[i].reward)
            print(f"depth {depth}: forked {len(children)} in {forked:.2f} s, kept branch {keep}")
            await asyncio.gather(*(c.close() for i, c in enumerate(children) if i != keep))
            await best.close()
            best, observation = children[keep], results[keep].observation
            if results[keep].terminated:
                assert best.sandbox is not None
                diff = await best.sandbox.commands.run(f"cd {REPO} && git diff")
                print(f"all tests pass after {depth} levels:\n{diff.stdout}")
                break
        else:
            print("the search ran out of depth")
    finally:
        await best.close()
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    asyncio.run(main())
