"""meshkit's pytest plugin and conformance kit for plugin authors."""
