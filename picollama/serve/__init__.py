"""`python -m picollama.serve`: an OpenAI-compatible server. A request goes HTTP (app.py, checked
by protocol.py) -> rows of tokens (rows.py) -> the engine's queue (engine.py) -> the decode loop
in picollama.sampling. The answer goes back out through responses.py."""
