"""Dataset preparation (data/prepare.py) and the token loader shared by training and evaluation (data/loader.py)."""
