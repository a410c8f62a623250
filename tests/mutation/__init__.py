"""Seeded bugs (mutants) and the tests that must catch them; run by tools/mutants.py."""
