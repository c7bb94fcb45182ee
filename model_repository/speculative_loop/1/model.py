"""The speculative loop (specdec_triton/loop_model.py); this directory's config.pbtxt
chooses the contract it serves."""
from specdec_triton.loop_model import TritonPythonModel  # noqa: F401
