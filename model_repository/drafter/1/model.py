"""The drafter: drafting methods served apart from the target (specdec.triton_models.drafter_model)."""
from specdec.triton_models.drafter_model import TritonPythonModel  # noqa: F401
