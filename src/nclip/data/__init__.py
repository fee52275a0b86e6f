"""Datasets (built-in and user data), tokenization and image transforms."""
