"""End-to-end tests on the dev cluster's real node.

A package (this file) so that the ``package``-scoped cluster of conftest.py is stopped when
these tests are done: without it pytest treats the scope as the session's, and that real node
would still run beside tests/integration's.
"""
