"""The data layer: tokens, requests and results (``types``), prompts and their constraints, the run
model (``gate_run``), verdict types, where models and caches live. Plain data and its readers;
imports nothing from the rest of specparity.
"""
