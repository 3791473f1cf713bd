"""Dataset preparation (data/prepare.py) and the token loader shared by training and evaluation (data/loader.py)."""


class DataError(ValueError):
    """Bad input or an unusable dataset; the CLI prints it as one line, without a traceback."""
