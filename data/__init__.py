"""Datasets: prepared from a corpus (prepare.py, the command, and its rooms) and read as batches by
training and evaluation (loader.py)."""
