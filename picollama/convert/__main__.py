"""`python -m picollama.convert`: the conversion commands (main.py), with their one error line."""

import sys

from picollama.cli.command import run_command
from picollama.convert.main import main

sys.exit(run_command(main))
