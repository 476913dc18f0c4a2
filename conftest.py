"""Root conftest of the checkout.

The specparity pytest plugin (options, per-prompt parametrisation, reports) is registered by the
package's ``pytest11`` entry point ``specparity`` (pyproject.toml), as in any repository where
specparity is installed: ``pytest -p no:specparity`` turns it off, ``-p specparity`` loads it when
plugin autoloading is disabled. Registering it here as well would register the same module twice
(pluggy refuses that), so this file loads it only when the installed metadata has no such entry
point: a checkout used without installing it (``PYTHONPATH=.``), or installed before the entry
point existed (re-run ``pip install -e .``).
"""

from importlib.metadata import entry_points

PLUGIN = "specparity.plugin.pytest_plugin"


def _entry_point_installed() -> bool:
    return any(ep.value.split(":")[0].strip() == PLUGIN for ep in entry_points(group="pytest11"))


pytest_plugins = [] if _entry_point_installed() else [PLUGIN]
