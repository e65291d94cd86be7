"""Helpers the benches share with the tests (issue 23: bench/ imports nothing from tests/ or examples/)."""
