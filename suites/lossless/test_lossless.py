"""The lossless gate: ``pytest suites/lossless``.

The tests live in the package (``specparity/suite/test_lossless.py``, so an installed wheel runs the
same gate: ``specparity lossless``); importing them here collects them under this path, so node ids
(``suites/lossless/test_lossless.py::test_lossless[<prompt id>]``), ``-k``, ``--lf`` and the
xdist grouping stay what they were. A repository of your own gates an engine the same way: one
file with this import.
"""

from specparity.suite.test_lossless import test_gate_policy, test_lossless

__all__ = ["test_gate_policy", "test_lossless"]
