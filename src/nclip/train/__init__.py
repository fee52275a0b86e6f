"""Training: the loop, optimizer and schedule, checkpoints, monitors."""
