"""trial."""
