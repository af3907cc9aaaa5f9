"""CPR's partial recovery: survivors' snapshots (survivor), which of them a restore adds (partial),
the samples a failure lost (lost_samples) and the rows worth saving most often (priority)."""
