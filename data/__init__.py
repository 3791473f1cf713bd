"""Datasets. prepare.py, the command, and its modules make them from a corpus. Training and
evaluation read them as batches through loader.py."""
