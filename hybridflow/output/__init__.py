"""What a user sees of a run: the console (`console`) and the run directory with its metrics and the
tracking backends (`tracking`)."""
