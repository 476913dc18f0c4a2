"""Running the gate: the two phases and their dispatch (``runner``), the journal, goldens, teacher-
forced scoring, invariance runs, one gate command from options to exit code (``gate_command``). May
import: ``model``, ``judge``, ``engines``, ``probes``, ``gate``, ``report``.
"""
