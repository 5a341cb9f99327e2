"""kvtier reference engine."""
