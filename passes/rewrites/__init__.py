"""The rewrites, one module per pass; each registers itself by name when imported."""
