"""The speculative loop for unary clients (specdec.triton_models.unary_model)."""
from specdec.triton_models.unary_model import TritonPythonModel  # noqa: F401
