"""Tools around the server: in-process and served benchmarks, drafter training, the demo, the stop-string check, ShareGPT selection.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving, specdec.launcher, specdec_client, specdec_openai."""
