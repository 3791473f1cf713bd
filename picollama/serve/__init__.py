"""`python -m picollama.serve`: an OpenAI-compatible server. A request goes HTTP (app.py, checked
by protocol.py) -> rows of tokens (rows.py) -> the engine's queue (engine.py) -> the decode loop
in picollama.sampling. The answer goes back out through responses.py.

How to add an OpenAI endpoint that generates, such as another completion kind. It touches:
- protocol.py: the request body (a Strict model) and its known fields. A function checks a body
  into an Ask. A new kind of answer adds its name to Ask.kind.
- rows.py: ServedModel.rows, which turns the Ask into rows of tokens for the engine.
- responses.py: the answer's shape, whole and streamed. Head.top names its object.
- app.py: the route, which reads the body, checks it and answers. Streaming is in events().
  A route under /v1/ gets the bearer key check from BearerKey by itself. It runs inside
  metrics.request(path), with its path in metrics.ENDPOINTS, so /metrics counts its requests.
- main.py: the endpoints its --help description lists.
- docs/serving.md: the endpoint table and the parameters it takes.
- tests/test_serve.py: its answers, streamed and whole, and its refusals.
An endpoint that needs no model, like /v1/models, touches only app.py, main.py, the docs
and the tests.
The engine and picollama.sampling stay as they are: they decode rows, whatever asked for them."""
