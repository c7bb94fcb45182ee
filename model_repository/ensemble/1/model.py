"""The speculative loop (specdec.triton_models.loop_model); this directory's config.pbtxt
chooses the contract it serves."""
from specdec.triton_models.loop_model import TritonPythonModel  # noqa: F401
