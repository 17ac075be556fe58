"""Creates per second: 8 at once straight to one node, then 8 through the
gateway (placed over the three). The nodes share the lab's one emulated CPU,
so this shows what the gateway and placement cost more than how the cluster
scales. A figure for the bench more than a check (six creates at once are
in the etcd leader's section too): the long tier's (SANDFORK_TEST_TIER=long)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
from harness import Cluster, log


def creates_per_s(cluster: Cluster, url: str) -> float:
    """8 creates at once through url; all are killed after."""
    start = time.monotonic()
    creates = [
        subprocess.Popen(
            [str(cluster.bin), "create", "--timeout", "300"],
            env=cluster.cli_env(url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    answers = [p.communicate() for p in creates]
    took = time.monotonic() - start
    made = [out.strip() for (out, _), p in zip(answers, creates, strict=True) if p.returncode == 0]
    if made:
        cluster.rm(*made)
    failed = [err.strip() for (_, err), p in zip(answers, creates, strict=True) if p.returncode]
    assert not failed, f"a create through {url} failed: {failed}"
    return round(8 / took, 3)


@pytest.mark.skipif(
    os.environ.get("SANDFORK_TEST_TIER") != "long",
    reason="long tier (scripts/test.sh --only cluster_long)",
)
def test_creates_per_second(cluster: Cluster, bench: dict[str, float]) -> None:
    one = creates_per_s(cluster, cluster.nodes["n1"].api)
    bench["cluster_creates_per_s_1node"] = one
    three = creates_per_s(cluster, cluster.gateway)
    bench["cluster_creates_per_s_3nodes"] = three
    log.info(
        "creates per second (8 at once): %s straight to n1, %s through the gateway", one, three
    )
