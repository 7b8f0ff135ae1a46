"""What a run records about itself: per-step metrics, summaries, traces."""
