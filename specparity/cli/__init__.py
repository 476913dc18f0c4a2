"""The ``specparity`` command: option declarations and their validation (``option_table``,
``options``), the subcommands (``commands``, ``golden_commands``, ``sweep``). May import everything
below it; nothing imports it but ``plugin``.
"""
