"""weightsync package."""
