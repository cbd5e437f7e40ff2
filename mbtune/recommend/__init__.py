"""recommend."""
