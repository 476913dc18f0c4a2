"""Root conftest of the checkout: loads the gate's pytest plugin for this repository's suites.

specparity's ``pytest11`` entry point registers no option in other projects' sessions
(:mod:`specparity.plugin.autoload`); here, where ``pytest suites/lossless --engine …`` and the
harness's own tests need the gate's options, this file names the plugin, as a team's rootdir
conftest does to run the gate from its own test tree. ``pytest -p no:specparity`` leaves it inert.

An environment installed before the entry point moved to ``specparity.plugin.autoload`` still
registers the plugin itself under the entry point's name; naming it here as well would register
the module twice (pluggy refuses that), so it is left out there (re-run ``pip install -e .``).
"""

from importlib.metadata import entry_points

PLUGIN = "specparity.plugin.pytest_plugin"


def _registered_by_stale_entry_point() -> bool:
    return any(ep.value.split(":")[0].strip() == PLUGIN for ep in entry_points(group="pytest11"))


pytest_plugins = [] if _registered_by_stale_entry_point() else [PLUGIN]
