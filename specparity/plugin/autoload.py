"""What pytest loads in every session of an environment where specparity is installed.

pytest imports every ``pytest11`` entry point of the environment into every session, including
those of projects that have nothing to do with specparity. The gate's options (``--engine``,
``--target``, ``--device``-like generic names) registered there would collide with a project's own
``conftest.py`` ("option dest 'engine' already used"), so this module, the entry point
``specparity``, registers no option and no fixture. It loads the gate plugin
(:mod:`specparity.plugin.pytest_plugin`) only when the session asks for specparity by name:

* ``-p specparity`` (also under ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``);
* ``--pyargs specparity.suite`` (the packaged gate named as a module, before any conftest of it
  could load: pytest finds initial conftests by path, not by module name).

Named by path (``specparity lossless``, ``pytest <site-packages>/specparity/suite``), the gate
suite's own ``conftest.py`` loads the plugin; the checkout's root ``conftest.py`` does so for its
suites. ``-p no:specparity`` turns all of it off.
"""

from __future__ import annotations

from typing import Sequence

import pytest

#: The entry point's name (pyproject.toml), as ``-p`` and ``-p no:`` spell it.
ENTRY_POINT = "specparity"
#: The gate plugin, registered under its module name wherever it is loaded (so a conftest naming
#: it in ``pytest_plugins`` and this module never register it twice).
GATE_PLUGIN = "specparity.plugin.pytest_plugin"
#: The packaged gate suite, as ``--pyargs`` names it.
SUITE_MODULE = "specparity.suite"


def names_packaged_suite(args: Sequence[str]) -> bool:
    """Whether ``--pyargs`` arguments name the packaged gate suite (or a module or test in it)."""
    for arg in args:
        module = str(arg).split("::")[0]
        if module == SUITE_MODULE or module.startswith(SUITE_MODULE + "."):
            return True
    return False


def asks_for_the_gate(plugins: Sequence[str], pyargs: bool, args: Sequence[str]) -> bool:
    """Whether the command line asks for specparity: ``-p specparity``, or ``--pyargs`` naming its suite."""
    if any(p.strip() == ENTRY_POINT for p in plugins):
        return True
    return pyargs and names_packaged_suite(args)


def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser, args: list[str]) -> None:
    """Runs after the command line is pre-parsed and before the final parse: a plugin registered
    here still gets its options onto the command line."""
    ns = early_config.known_args_namespace
    if asks_for_the_gate(ns.plugins or [], bool(ns.pyargs), ns.file_or_dir or []):
        early_config.pluginmanager.import_plugin(GATE_PLUGIN)
