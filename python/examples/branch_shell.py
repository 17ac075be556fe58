"""Branch a shell episode at step k into N children (default: k=3, N=8).

Runs a stateful episode (a file written each step, a counter process running
in the background), forks it at step k, lets every child take a different
next step, and prints what each child saw and how long the fork took. Against
a local node::

    export E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000
    export E2B_API_KEY=$(cat /var/lib/sandfork/api-key) E2B_VALIDATE_API_KEY=false
    python examples/branch_shell.py --k 3 --n 8
"""

from __future__ import annotations

import argparse
import time

from sandfork import SyncSandboxEnv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=3, help="steps before the branch")
    ap.add_argument("--n", type=int, default=8, help="children")
    ap.add_argument("--template", default="base")
    args = ap.parse_args()

    with SyncSandboxEnv(template=args.template, command_timeout=120) as env:
        env.reset("count and branch", seed=1)
        # a process whose state lives only in memory: it counts while we work
        counter = "i=0; while :; do i=$((i+1)); echo $i > /tmp/ticks; sleep 1; done"
        env.step(f"nohup sh -c '{counter}' >/dev/null 2>&1 &")
        for step in range(args.k):
            env.step(f"echo step{step} >> /home/user/log")
        t = time.perf_counter()
        children = env.fork(args.n)
        took = time.perf_counter() - t
        print(f"fork of {args.n} at step {env.state.steps}: {took:.2f} s")
        try:
            for i, child in enumerate(children):
                r = child.step(
                    f"echo child{i} >> /home/user/log; tail -n 2 /home/user/log; cat /tmp/ticks"
                )
                lin = child.sandbox.lineage if child.sandbox else None
                print(
                    f"child {i} (seed {child.state.seed}, depth {lin.depth if lin else '?'}):",
                    r.observation.replace("\n", " | "),
                )
        finally:
            for child in children:
                child.close()


if __name__ == "__main__":
    main()
