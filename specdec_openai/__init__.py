"""The OpenAI-compatible front end (`specdec openai`): a Triton client that speaks OpenAI's HTTP API.
May import: specdec_wire, specdec_client, specdec.config, specdec.errors."""
