"""What every layer shares: the user-facing error family (`common.errors`)."""
