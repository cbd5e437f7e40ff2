"""A run directory: the trial record (one typed row per finished trial, the columns of
trials.csv), the run directory written as a search goes (nothing finished is ever lost),
and a run read back, as typed records or as pandas.

May import: mbtune.errors, mbtune.lattice, mbtune.config. Pure: no torch, no ray (pandas
only where a run is read as a frame).
"""
