"""Test and demo helpers that are real components, not mocks: the reference engine and a server runner."""
