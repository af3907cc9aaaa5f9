"""`deltarec-serve`: predictions over HTTP from a run's live model (docs/design/serving.md).

The stages of a served checkpoint, each in its own file:

- `servable.py`   what is served: a model, its scoring function and the request's schema
                  (deltarec-train's DLRM, or a user's own model through `--model`);
- `setup.py`      the run, the limits and the model one command line names;
- `versions.py`   two copies of the model; the follower (ckpt/follow/follower.py) writes a
                  checkpoint into the one nobody reads, then swaps it in;
- `requests.py`   a JSON request, checked, as the model's input batch;
- `freshness.py`  from a checkpoint's step to the first response it served, and the server's
                  Prometheus metrics;
- `app.py`        the HTTP endpoints (aiohttp);
- `server.py`     the process: the follower's thread, the HTTP server, signals, the summary.
"""
