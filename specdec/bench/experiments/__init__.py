"""One-off experiment drivers (scripts and shell runs) behind figures in docs/results.md, one folder per results/ folder they write to; results/ holds their data only.
May import: specdec_wire, specdec.config, specdec.errors, specdec.engine, specdec.serving, specdec.launcher, specdec.tools, specdec.training, specdec.bench, specdec_client, specdec_openai, loadtest."""
