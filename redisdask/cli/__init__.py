"""The ``redisdask`` command: its parser (``parser``), what each command runs
(``commands``) and the demo.

``main`` is the console script's entry point (``redisdask = "redisdask.cli:main"``) and
``python -m redisdask``'s."""

from redisdask.cli.commands import main

__all__ = ["main"]
