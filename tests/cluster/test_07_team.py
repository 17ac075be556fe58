"""A team's limit holds across gateways and nodes. The team is made through
one gateway (so on one node), its key through the other: both are in etcd,
and every node accepts the key. Six creates race, three through each
gateway; two are made. A pause gives a slot back; a resume and a fork
beyond the limit are refused."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from harness import PREFIX, Cluster, log

LIMIT_SAID = "maximum number of concurrent sandboxes (2)"


@dataclass
class Team:
    id: str
    key: str
    made: list[str]  # by the racing creates
    refused: int
    failed: list[str]  # creates that failed otherwise


@pytest.fixture(scope="module")
def team(cluster: Cluster) -> Iterator[Team]:
    first, second = cluster.gateways
    team_id = cluster.cli("team", "create", "quota", "--max-sandboxes", "2", url=first)
    key = cluster.cli("key", "create", team_id, url=second)
    creates = [
        subprocess.Popen(
            [str(cluster.bin), "create", "--timeout", "900"],
            env=cluster.cli_env(cluster.gateways[i % 2], key),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(6)
    ]
    made, refused, failed = [], 0, []
    for proc in creates:
        out, err = proc.communicate()
        if proc.returncode == 0:
            made.append(out.strip())
        elif LIMIT_SAID in err:
            refused += 1
        else:
            failed.append(err.strip())
    yield Team(team_id, key, made, refused, failed)
    for sandbox in made:  # what a failed test left
        if cluster.route(sandbox):
            cluster.cli_run("rm", sandbox)


def slots(cluster: Cluster, team: Team) -> int:
    return len(cluster.etcd.keys(f"{PREFIX}/teams/{team.id}/running/"))


def test_racing_creates_make_two(team: Team) -> None:
    assert not team.failed, f"creates as the team failed otherwise: {team.failed}"
    assert len(team.made) == 2 and team.refused == 4, (
        f"a team of 2 got {len(team.made)} sandboxes from 6 racing creates ({team.refused} refused)"
    )


def test_the_team_holds_two_slots_and_lists_two(cluster: Cluster, team: Team) -> None:
    held = slots(cluster, team)
    assert held == 2, f"the team holds {held} slots for 2 sandboxes"
    listed = json.loads(cluster.cli("ls", "--json", url=cluster.gateways[1], key=team.key))
    assert len(listed) == 2, f"the team lists {len(listed)} sandboxes"
    # The gateway sums the team's use over the nodes.
    answer = cluster.http("GET", f"{cluster.gateway}/admin/teams/{team.id}")
    assert answer.is_success, f"the team's use: {answer.status_code} {answer.text}"
    used = answer.json()["usage"]["sandboxes"]
    on = [cluster.owner(s) for s in team.made]
    assert used == 2, f"the gateway says the team uses {used} sandboxes (on {on})"


def test_a_pause_frees_a_slot_and_the_limit_holds(cluster: Cluster, team: Team) -> None:
    first, second = cluster.gateways
    paused, running = team.made
    cluster.cli("pause", paused, url=first, key=team.key)
    third = cluster.cli(
        "create", "--timeout", "900", url=second, key=team.key, why="a create after a pause"
    )
    resumed = cluster.cli_run("resume", paused, url=first, key=team.key)
    assert resumed.returncode != 0, f"the resume of {paused} went beyond the team's 2"
    assert LIMIT_SAID in resumed.stderr, f"resume refused otherwise: {resumed.stderr}"
    # A fork of a full team makes no child.
    answer = cluster.http("POST", f"{second}/sandboxes/{running}/fork", {"count": 1}, key=team.key)
    assert answer.status_code == 429, (
        f"a fork of a full team answered {answer.status_code}: {answer.text}"
    )
    cluster.cli("rm", third, url=second, key=team.key)
    cluster.cli("resume", paused, url=first, key=team.key, why=f"resuming {paused} after a kill")
    out = cluster.cli("exec", paused, "--", "echo", "back", url=second, key=team.key)
    assert out == "back", f"exec in the resumed {paused} printed {out!r}"
    cluster.cli("rm", *team.made, url=first, key=team.key)
    held = slots(cluster, team)
    assert held == 0, f"the team holds {held} slots after its kills"
    log.info("a team of 2: a pause freed a slot; a resume and a fork beyond the limit refused")
