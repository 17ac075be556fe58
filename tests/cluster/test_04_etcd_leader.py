"""etcd loses its leader during a burst of creates: six creates through both
gateways, the leading member killed (SIGKILL) once they are under way. Each
create answers (made, or a clear error) and the routes are exactly the
sandboxes made: none lost, none twice, none for a create that failed. The
member then comes back on its data."""

from __future__ import annotations

import subprocess
import time

from harness import Cluster, log, wait_until


def test_leader_lost_during_a_create_burst(cluster: Cluster, etcd_members_back: None) -> None:
    mapped = cluster.routes()
    leader = cluster.etcd.leader()
    assert leader in (1, 2, 3), f"no etcd member leads ({leader})"
    burst = [
        subprocess.Popen(
            [str(cluster.bin), "create", "--timeout", "900"],
            env=cluster.cli_env(cluster.gateways[i % 2]),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(6)
    ]
    time.sleep(1)
    cluster.etcd.kill(leader)
    made = []
    for proc in burst:
        out, _ = proc.communicate()
        if proc.returncode == 0:
            made.append(out.strip())
        else:
            log.info("a create while etcd lost its leader failed: %s", out.strip())
    new_leader = wait_until(
        cluster.etcd.leader, 60, f"no new etcd leader after member {leader}'s loss"
    )
    assert new_leader != leader, f"member {leader} leads after its loss"
    # Creates go on under the new leader.
    made.append(cluster.create(why="a create after etcd's new leader"))
    routes = cluster.routes()
    assert routes == mapped + len(made), (
        f"after the burst {routes} sandboxes are mapped, not {mapped} + {len(made)} made"
        " (one after it)"
    )
    for sandbox in made:
        assert cluster.route(sandbox), f"{sandbox} was made but has no route"
        out = cluster.cli("exec", sandbox, "--", "echo", "up")
        assert out == "up", f"{sandbox} (made while etcd changed leaders) printed {out!r}"
    cluster.etcd.start(leader)
    cluster.rm(*made)
    routes = cluster.routes()
    assert routes == mapped, f"after the burst's kills {routes} sandboxes are mapped, not {mapped}"
    for n in ("n1", "n2", "n3"):
        assert cluster.registered(n), f"node {n} lost its registration while etcd changed leaders"
    log.info(
        "etcd member %d (the leader) killed during 6 creates: %d made, each mapped once;"
        " member %d leads",
        leader, len(made) - 1, new_leader,
    )  # fmt: skip
