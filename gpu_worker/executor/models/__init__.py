"""kvfleet's own torch model implementations."""
