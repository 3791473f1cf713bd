"""`python -m picollama.serve`: the server's command (main.py), with its one error line."""

import sys

from picollama.cli.command import run_command
from picollama.serve.main import main

sys.exit(run_command(main))
