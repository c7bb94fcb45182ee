"""The verifier: the target and the drafters beside it (specdec.triton_models.verifier_model)."""
from specdec.triton_models.verifier_model import TritonPythonModel  # noqa: F401
