"""What a run says: the summary, triage report and HTML (``render``, ``templates/``), their plots, and
the reproducers of failing prompts (``reproducers``, ``repro_scripts``). Renders the checks the judge
and the gate made; decides nothing. May import: ``model``, ``judge`` (check types and constants),
``engines`` (the server adapters' request bodies, for the reproducers), ``gate``.
"""
