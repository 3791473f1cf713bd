"""`python -m picollama.convert` runs the commands of main.py. Errors print as one line."""

import sys

from picollama.cli.command import run_command
from picollama.convert.main import main

sys.exit(run_command(main))
