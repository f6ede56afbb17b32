"""meshkit's test suite (a package, so that ``tests.support`` imports by name)."""
