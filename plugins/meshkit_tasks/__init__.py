"""Built-in meshkit plugin (placeholder until its component lands)."""
