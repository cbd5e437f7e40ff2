"""The named search spaces: package data of mbtune, at the repository's top level."""
