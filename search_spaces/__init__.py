"""The named search spaces (search_spaces/ at the repository's top level), package data of mbtune."""
