"""mbtune."""
