"""The attnpass test suite (a package, so tests import their helpers from ``tests.util``)."""
