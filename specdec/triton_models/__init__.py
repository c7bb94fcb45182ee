"""The Triton glue: each model.py of the model repository re-exports a TritonPythonModel from here; the models' internal contract and keys live here too.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving."""
