"""The test suite, a package: ``tests.gbn_jax`` cannot shadow ``gbn_jax``.

pytest imports each test module under its full package name with the
repository root on ``sys.path`` (not ``tests/``), so the folders that mirror
the code (``tests/gbn_jax``, ``tests/train``, ``tests/benchmarks``) never
stand in for the packages they test.
"""
