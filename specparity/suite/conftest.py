"""Loads the gate plugin for the packaged suite when pytest is given its path.

``specparity lossless`` runs pytest on this directory; pytest reads this file before it parses the
command line, so the gate's options (``--engine``, ``--target`` …) are known there. The
``pytest11`` entry point registers none of them (:mod:`specparity.plugin.autoload` says why).
"""

pytest_plugins = ["specparity.plugin.pytest_plugin"]
