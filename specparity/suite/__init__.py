"""The gate's pytest module, shipped in the package so the gate runs from an installed wheel.

``specparity/suite/test_lossless.py`` holds the tests (``test_lossless[<prompt id>]`` and
``test_gate_policy``); the pytest plugin (``specparity.plugin.pytest_plugin``) supplies their fixtures
and options. It is loaded only where the gate runs, never into other projects' sessions
(:mod:`specparity.plugin.autoload`). Three ways to run it:

* ``specparity lossless ARGS``: pytest on this directory, rootdir = the current directory (this
  package's ``conftest.py`` loads the plugin);
* ``pytest --pyargs specparity.suite ARGS`` (the ``pytest11`` entry point loads it);
* a file in your own test tree that re-exports the tests, as ``suites/lossless/test_lossless.py`` in
  the specparity checkout does: ``from specparity.suite.test_lossless import test_gate_policy, test_lossless``,
  with ``pytest_plugins = ["specparity.plugin.pytest_plugin"]`` in the rootdir ``conftest.py`` (or ``-p specparity``).
"""
