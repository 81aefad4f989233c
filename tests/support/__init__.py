"""Helpers the test files share, imported as `from support.<module> import ...`, and the
scripts that tests run as separate processes (held_commit.py, multihost_worker.py).

conftest.py puts tests/ on sys.path; this package holds no tests.
"""
