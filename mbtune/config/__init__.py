"""The experiment: YAML in, a frozen, validated :class:`Experiment` out.

Owns the schema (the sections as frozen keyword-only dataclasses, every rule in its
class), the rules' one-line :class:`ConfigError`, the cross-section rules and the lattice
an experiment searches, the YAML loader with ``--set`` overrides, the named search spaces'
lookup, the built-in models' options (checked without torch) and ``mbtune init``'s
starter. Nothing downstream checks or parses the experiment again.

May import: mbtune.errors, mbtune.lattice. Pure: no torch, no ray, no pandas.
"""
