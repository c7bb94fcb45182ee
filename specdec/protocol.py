"""The wire contract (tensor names and dtypes of every model, metric names, header names) is
defined once, in specdec_client.protocol, so that the client installs on its own
(`pip install ./client`, no torch); the engine and the Triton models read it through here."""
from specdec_client.protocol import *  # noqa: F401,F403
