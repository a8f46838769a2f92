"""Deliberately broken adapters: the suite's proof that it fails loudly, naming the broken rule.

``tests/conformance/test_conformance_selftest.py`` runs the suite against each of these in
a subprocess and checks that it fails with the right ``CONFORMANCE RULE``.
Never register them as entry points.
"""
