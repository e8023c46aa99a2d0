"""The commands: ``adaptive-spec run``, ``replay``, ``record``, ``calibrate``, ``bench`` (and ``bench
serve``) and ``distill``, with what only they need (real prompts from data packages, plots, greedy
identity checks).

Each subcommand is a module (or a package with a ``command`` module) exposing ``add_parser(subparsers)``
and ``main(args) -> int``; :mod:`~adaptive_spec.commands.cli` assembles them. The top layer: it may import
every other layer, and nothing imports it.
"""
