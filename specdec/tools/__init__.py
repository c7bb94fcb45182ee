"""Tools around the server: the demo, the mutation harness, the README tables, ShareGPT selection, `specdec serve --model` (benchmarks live in specdec.bench, drafter training in specdec.training).
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving, specdec.launcher, specdec_client, specdec_openai."""
