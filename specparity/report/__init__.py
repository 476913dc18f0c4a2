"""What a run says: the summary, triage report and HTML (``render``, ``templates/``) and their plots.
Renders the checks the judge and the gate made; decides nothing. May import: ``model``, ``judge``
(check types and constants), ``gate``.
"""
