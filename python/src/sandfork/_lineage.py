"""Lineage: where a sandbox sits in a tree of forks.

The Python side keeps it on every sandfork sandbox object; the guest sees it
as JSON in ``/run/sandfork/lineage.json`` (written by the client after a fork
or a restore, and by ``write_lineage()``), so code inside a child can tell
which branch it is and reseed its own randomness from ``seed``.
"""

from __future__ import annotations

import json
import secrets
import shlex
from dataclasses import asdict, dataclass, replace
from typing import Any

#: Where the guest finds its lineage (a tmpfs or the root disk: either way
#: a fork child inherits its parent's file and the client overwrites it).
LINEAGE_PATH = "/run/sandfork/lineage.json"
#: The per-branch seed alone, for shell scripts.
SEED_PATH = "/run/sandfork/seed"


def new_seed() -> int:
    """A fresh 63-bit seed (fits a signed 64-bit integer, e.g. numpy's)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class Lineage:
    """A sandbox's place in its fork tree.

    ``branch_index`` is the child's position among the siblings of one fork
    call (``None`` for a root); ``depth`` counts forks from the root.
    """

    sandbox_id: str
    parent_id: str | None
    root_id: str
    depth: int
    branch_index: int | None
    seed: int

    @classmethod
    def root(cls, sandbox_id: str, seed: int | None = None) -> Lineage:
        return cls(
            sandbox_id=sandbox_id,
            parent_id=None,
            root_id=sandbox_id,
            depth=0,
            branch_index=None,
            seed=new_seed() if seed is None else seed,
        )

    def child(self, sandbox_id: str, branch_index: int) -> Lineage:
        """The lineage of child ``branch_index`` of this sandbox. The seed is
        the parent's: the ``reseed`` hook replaces it."""
        return Lineage(
            sandbox_id=sandbox_id,
            parent_id=self.sandbox_id,
            root_id=self.root_id,
            depth=self.depth + 1,
            branch_index=branch_index,
            seed=self.seed,
        )

    def with_seed(self, seed: int) -> Lineage:
        return replace(self, seed=seed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lineage:
        try:
            return cls(
                sandbox_id=str(data["sandbox_id"]),
                parent_id=None if data.get("parent_id") is None else str(data["parent_id"]),
                root_id=str(data["root_id"]),
                depth=int(data["depth"]),
                branch_index=(
                    None if data.get("branch_index") is None else int(data["branch_index"])
                ),
                seed=int(data["seed"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a sandfork lineage: {data!r} ({e})") from e

    @classmethod
    def from_json(cls, text: str) -> Lineage:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a sandfork lineage: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"not a sandfork lineage: {text!r}")
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def guest_script(self) -> str:
        """One shell command writing the lineage and seed files (atomically,
        so a guest reader never sees half a file)."""
        d = shlex.quote(LINEAGE_PATH.rsplit("/", 1)[0])
        lin, seed = shlex.quote(LINEAGE_PATH), shlex.quote(SEED_PATH)
        return (
            f"mkdir -p {d} && "
            f"printf '%s\\n' {shlex.quote(self.to_json())} > {lin}.tmp && "
            f"printf '%s\\n' {self.seed} > {seed}.tmp && "
            f"chmod 0644 {lin}.tmp {seed}.tmp && "
            f"mv -f {lin}.tmp {lin} && mv -f {seed}.tmp {seed}"
        )
