"""The ``rayfleet`` command line: one module per command, wired together by ``entry``.

A user-facing package like ``rayfleet.sdk`` and ``rayfleet.demo``: it may import every area,
and no area imports it (docs/architecture.md, rule 5). Importing it stays cheap (no torch, no
Ray) so that ``rayfleet --help`` answers at once.
"""

from rayfleet.cli.entry import AREA_COMMANDS, build_parser, main

__all__ = ["main", "build_parser", "AREA_COMMANDS"]
