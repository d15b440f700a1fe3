"""Subcommands of the ``torchparity`` CLI: each module has ``add_arguments`` and ``run``."""
