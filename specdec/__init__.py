"""specdec: speculative decoding served by Triton, packaged by role (engine, serving, triton_models, launcher, training, bench, tools); config.py and errors.py are the typed settings and errors every part shares.
May import: specdec_wire."""
__version__ = "0.1.0"
