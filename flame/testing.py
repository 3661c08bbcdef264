"""Testing utilities. Placeholder."""
