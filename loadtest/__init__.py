"""Load tests: Locust scenarios and their runner, the soak and the stress run.
May import: specdec_wire, specdec_client, specdec.config, specdec.launcher, specdec.tools.sharegpt."""
