"""The gate's pytest module, shipped in the package so the gate runs from an installed wheel.

``specparity/suite/test_lossless.py`` holds the tests (``test_lossless[<prompt id>]`` and
``test_gate_policy``); the pytest plugin (``specparity.plugin.pytest_plugin``, registered through the
``pytest11`` entry point ``specparity``) supplies their fixtures and options. Three ways to run it:

* ``specparity lossless ARGS``: pytest on this module, rootdir = the current directory;
* ``pytest --pyargs specparity.suite ARGS``;
* a file in your own test tree that re-exports the tests, as ``suites/lossless/test_lossless.py`` in
  the specparity checkout does: ``from specparity.suite.test_lossless import test_gate_policy, test_lossless``.
"""
