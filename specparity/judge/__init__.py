"""The pure judge: token streams and scores in, verdicts and the checks behind them out (``compare``,
``checks``), noise and calibration, path coverage, invariance, acceptance statistics. Never sees an
engine. May import: ``model``.
"""
