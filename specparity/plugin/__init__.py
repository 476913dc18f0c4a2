"""The pytest face: the plugin (``pytest_plugin``: options, per-prompt parametrisation, the session
run, exit status) and the probe options. May import everything below it.
"""
