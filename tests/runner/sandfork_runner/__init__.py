"""sandfork's test runner: `scripts/test.sh` (README, "The two commands";
docs/src/testing/runner.md)."""
