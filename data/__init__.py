"""Dataset preparation (prepare.py) and the token loader of training and evaluation (loader.py)."""
