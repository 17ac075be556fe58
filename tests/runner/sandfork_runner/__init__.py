"""sandfork's test runner: `scripts/test.sh` (README, "Tests")."""
