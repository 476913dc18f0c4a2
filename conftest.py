"""Root conftest: loads the specparity pytest plugin (options, per-prompt parametrisation, reports)."""

pytest_plugins = ["specparity.pytest_plugin"]
